"""ragspec's fused C++ decoder step against ``torch.compile`` of transformers' forward over a
static KV cache (the decoder step compiled or fused: measure both and keep the faster).

What it measures, on CPU, float32, 2 torch threads, the default model
(``smollm2-135m-instruct``), ms per one-token greedy decode step (prefill excluded) at the
context of two real prompts (the first ``rag`` row of the Spec-Bench dev data, a long
retrieval prompt, and the first ``writing`` row, a short one), chat-templated:

* ``native``: ragspec's target as :func:`ragspec.loading.load_target` builds it (the fused
  C++ decoder-layer step, the GGUF-block linear kernels): ``target.prefill``, then per
  step ``target.verify_one(state, token, DraftTree.empty())`` + ``target.commit`` and the
  argmax of the logits.
* ``native_f32``: the same fused C++ step over a second copy of the plain float32 model
  (:func:`ragspec.loading.select_target` with its speed-ups, without the GGUF file:
  dense float32 weights, as transformers reads them), to separate the fusion from the
  4.5-bit weights (``--no-native-f32``: skip).
* ``hf_eager``: a plain transformers model loaded from the same converted HF folder, a
  :class:`transformers.StaticCache` (one size for both prompts), eager prefill, then per
  step ``model(input_ids=[[token]], cache=cache, cache_position=[pos])`` and the
  argmax of the logits.
* ``compile[<mode>]``: the same loop with the decode forward compiled by
  ``torch.compile`` (inductor, CPU; ``fullgraph=True``, falling back to
  ``fullgraph=False`` with the error recorded); modes ``default`` (``mode=None``) and
  ``max-autotune-no-cudagraphs`` (tried when the first compiles), each also with
  inductor's ``freezing`` (``+freezing``: the weights become constants of the graph, which
  lets inductor pre-pack them for its CPU GEMMs; the recipe PyTorch gives for CPU
  inference). Compile time (the
  warm-up's first decode call per prompt) is reported separately and excluded from the
  step timings. It depends on inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``): a
  cold cache took ~40-60 s per mode on the 2-core reference CPU, a warm one ~7-17 s.

Every method runs one warm-up measurement per prompt, then ``--rounds`` rounds in which
the methods are interleaved; each measurement is ``--steps`` decode steps from a fresh
prefill. The table gives the best and median ms/token per method and prompt, and whether
the greedy tokens of each method agree with ``native``'s over the measured steps (the
first divergence if not).

Usage::

    python scripts/bench_torch_compile.py \\
        --json docs/bench/fused-step-vs-torch-compile.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("bench_torch_compile")

DATA = Path("/work/shared/data/specbench-dev.jsonl")
MODES = ("default", "max-autotune-no-cudagraphs", "default+freezing", "max-autotune-no-cudagraphs+freezing")


def first_prompts(path: Path, categories: tuple[str, ...]) -> dict[str, str]:
    """The first turn of the first row of each category in ``categories``."""
    found: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            cat = row.get("category")
            if cat in categories and cat not in found:
                found[cat] = row["turns"][0]
            if len(found) == len(categories):
                break
    missing = [c for c in categories if c not in found]
    if missing:
        raise SystemExit(f"no {', '.join(missing)} row in {path}")
    return found


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [int(t) for t in enc["input_ids"]]


# --------------------------------------------------------------------------- the methods
class NativeRunner:
    """ragspec's plain greedy step over its native KV state."""

    def __init__(self, target: Any) -> None:
        from ragspec.types import DraftTree

        self.target = target
        self.empty = DraftTree.empty()

    def run(self, ids: list[int], steps: int) -> tuple[list[int], float, float]:
        """-> (greedy tokens: prefill's then one per step, seconds of the steps, seconds of
        the first step)."""
        t = self.target
        with torch.inference_mode():
            state = t.new_state()
            token = int(t.prefill(state, ids).logits[0].argmax())
            tokens = [token]
            first = 0.0
            t0 = time.perf_counter()
            for i in range(steps):
                past = t.state_length(state)
                out = t.verify_one(state, token, self.empty)
                t.commit(state, past, [])
                token = int(out.logits[0].argmax())
                tokens.append(token)
                if i == 0:
                    first = time.perf_counter() - t0
            return tokens, time.perf_counter() - t0, first


class StaticRunner:
    """transformers' forward over a StaticCache; the decode forward eager or compiled."""

    def __init__(self, model: Any, max_cache_len: int, step_fn: Optional[Callable] = None) -> None:
        from transformers import StaticCache

        self.model = model
        self.step_fn = step_fn or model.forward
        self.max_cache_len = max_cache_len
        self._cache_cls = StaticCache
        self.caches: dict[int, Any] = {}  # one cache per prompt length (kept across runs)

    def _cache(self, key: int) -> Any:
        cache = self.caches.get(key)
        if cache is None:
            cache = self._cache_cls(config=self.model.config, max_cache_len=self.max_cache_len)
            self.caches[key] = cache
        else:
            cache.reset()
        return cache

    def run(self, ids: list[int], steps: int) -> tuple[list[int], float, float]:
        n = len(ids)
        if n + steps + 1 > self.max_cache_len:
            raise ValueError(f"prompt {n} + {steps} steps exceeds the static cache ({self.max_cache_len})")
        with torch.inference_mode():
            cache = self._cache(n)
            x = torch.tensor([ids], dtype=torch.long)
            out = self.model(input_ids=x, cache=cache, cache_position=torch.arange(n), use_cache=True, logits_to_keep=1)
            token = int(out.logits[0, -1].argmax())
            tokens = [token]
            first = 0.0
            t0 = time.perf_counter()
            for i in range(steps):
                out = self.step_fn(
                    input_ids=torch.tensor([[token]], dtype=torch.long),
                    cache=cache,
                    cache_position=torch.tensor([n + i], dtype=torch.long),
                    use_cache=True,
                )
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                if i == 0:
                    first = time.perf_counter() - t0
            return tokens, time.perf_counter() - t0, first


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    """Index of the first differing token (None: equal over the common length and lengths)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compiled(fn: Callable, mode: str, fullgraph: bool) -> Callable:
    """``torch.compile(fn)`` for a mode name of :data:`MODES` (``<mode>[+freezing]``)."""
    base, _, extra = mode.partition("+")
    if extra not in ("", "freezing"):
        raise SystemExit(f"unknown mode {mode!r}")
    if not extra:
        return torch.compile(fn, mode=None if base == "default" else base, fullgraph=fullgraph)
    from torch._inductor import list_mode_options

    options = dict(list_mode_options(base))
    options["freezing"] = True
    return torch.compile(fn, options=options, fullgraph=fullgraph)


# --------------------------------------------------------------------------- main
def warm(name: str, runner: Any, prompts: dict[str, list[int]], steps: int) -> dict[str, float]:
    """One warm-up measurement of ``runner`` per prompt: the seconds of each first step
    (a compiled runner's compile time)."""
    firsts = {}
    for cat, ids in prompts.items():
        t0 = time.perf_counter()
        _, _, first = runner.run(ids, steps)
        firsts[cat] = first
        logger.info("warm-up %s %s: %.1f s (first step %.2f s)", name, cat, time.perf_counter() - t0, first)
    return firsts


def add_compiled(
    runners: dict[str, Any],
    hf_model: Any,
    max_cache_len: int,
    modes: list[str],
    prompts: dict[str, list[int]],
    steps: int,
) -> dict[str, dict[str, Any]]:
    """Add a runner per ``torch.compile`` mode that compiles (``fullgraph=True``, else
    ``False``; a later mode only when an earlier one compiled), warmed up; returns each
    mode's compile record (its compile seconds, or why it failed)."""
    compile_info: dict[str, dict[str, Any]] = {}
    for mode in modes:
        name = f"compile[{mode}]"
        info: dict[str, Any] = {"mode": mode}
        compile_info[name] = info
        if mode != modes[0] and not any(v.get("ok") for v in compile_info.values() if v is not info):
            info.update(ok=False, skipped="the first mode did not compile")
            continue
        for fullgraph in (True, False):
            fn = compiled(hf_model.forward, mode, fullgraph)
            runner = StaticRunner(hf_model, max_cache_len, step_fn=fn)
            try:
                t0 = time.perf_counter()
                firsts = warm(name, runner, prompts, steps)
                info.update(
                    ok=True,
                    fullgraph=fullgraph,
                    warmup_s=time.perf_counter() - t0,
                    compile_s={cat: round(v, 3) for cat, v in firsts.items()},
                )
                runners[name] = runner
                break
            except Exception as e:  # noqa: BLE001 - record why the compile failed
                err = f"{type(e).__name__}: {e}"
                logger.warning("%s fullgraph=%s failed: %s", name, fullgraph, err.splitlines()[0][:300])
                info[f"error_fullgraph_{fullgraph}"] = err[:4000]
                info[f"traceback_fullgraph_{fullgraph}"] = traceback.format_exc()[-4000:]
                info["ok"] = False
    return compile_info


def interleaved(
    runners: dict[str, Any], prompts: dict[str, list[int]], rounds: int, steps: int
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[int]]]]:
    """``rounds`` rounds of every runner on every prompt, the order rotating each round:
    (ms per step of each measurement, the greedy tokens), per runner and prompt."""
    names = list(runners)
    times: dict[str, dict[str, list[float]]] = {n: {c: [] for c in prompts} for n in names}
    tokens: dict[str, dict[str, list[int]]] = {n: {} for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for cat, ids in prompts.items():
            for name in order:
                toks, secs, _ = runners[name].run(ids, steps)
                times[name][cat].append(1000.0 * secs / steps)
                prev = tokens[name].get(cat)
                if prev is not None and prev != toks:
                    logger.warning("%s %s: tokens changed between rounds", name, cat)
                tokens[name][cat] = toks
        logger.info("round %d done", r + 1)
    return times, tokens


def summarise(
    times: dict[str, dict[str, list[float]]], tokens: dict[str, dict[str, list[int]]], cats: list[str]
) -> dict[str, dict[str, Any]]:
    """Best and median ms per runner and prompt, and whether its tokens agree with
    ``native``'s (the first divergence if not)."""
    results: dict[str, dict[str, Any]] = {}
    for name in times:
        results[name] = {}
        for cat in cats:
            ms = times[name][cat]
            div = first_divergence(tokens["native"][cat], tokens[name][cat])
            results[name][cat] = {
                "ms_best": round(min(ms), 3),
                "ms_median": round(statistics.median(ms), 3),
                "ms_all": [round(v, 3) for v in ms],
                "tokens_agree_with_native": div is None,
                "first_divergence": div,
            }
    return results


def print_table(
    results: dict[str, dict[str, Any]], compile_info: dict[str, dict[str, Any]], names: list[str], cats: list[str]
) -> None:
    """The table of ``results`` and each compile mode's outcome, on stdout."""
    header = f"{'method':44s}" + "".join(f" {c + ' best':>11s} {c + ' med':>10s} {'agree':>6s}" for c in cats)
    lines = [header, "-" * len(header)]
    for name in names:
        row = f"{name:44s}"
        for cat in cats:
            res = results[name][cat]
            agree = "yes" if res["tokens_agree_with_native"] else f"@{res['first_divergence']}"
            row += f" {res['ms_best']:11.2f} {res['ms_median']:10.2f} {agree:>6s}"
        lines.append(row)
    print("\n".join(lines))
    for name, info in compile_info.items():
        if info.get("ok"):
            print(f"{name}: fullgraph={info['fullgraph']}, first compiled call (compile) s: {info['compile_s']}")
        else:
            err = info.get("skipped") or next((v for k, v in info.items() if k.startswith("error")), "?")
            print(f"{name}: FAILED: {err.splitlines()[0][:200]}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per measurement (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--data", type=Path, default=DATA, help="Spec-Bench dev JSONL")
    ap.add_argument("--modes", default=",".join(MODES), help="torch.compile modes, comma-separated ('' = none)")
    ap.add_argument("--no-native-f32", action="store_true", help="skip the native step over float32 weights")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(message)s")

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    from transformers import AutoModelForCausalLM

    from ragspec import models
    from ragspec.backend.base import Capability
    from ragspec.loading import load_target

    target, tok, spec = load_target(device="cpu", dtype="fp32")
    fused = target.capability(Capability.FUSED_STEP) is not None
    logger.info("ragspec target: %s (native step: %s)", spec.name, fused)
    hf_dir = models.converted_model_dir(spec.path) if spec.kind == "gguf" else spec.path
    hf_model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, local_files_only=True).eval()
    logger.info("plain transformers model from %s (attention %s)", hf_dir, hf_model.config._attn_implementation)

    native_f32 = None
    if not args.no_native_f32:
        from ragspec.loading import select_target

        m32 = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, local_files_only=True).eval()
        native_f32 = select_target(m32)
        logger.info("native step over float32 weights: %s", native_f32.capability(Capability.FUSED_STEP) is not None)

    texts = first_prompts(args.data, ("rag", "writing"))
    prompts = {cat: chat_ids(tok, text) for cat, text in texts.items()}
    for cat, ids in prompts.items():
        logger.info("prompt %s: %d tokens", cat, len(ids))
    # one static size for both prompts: the compiled decode graph is shared
    longest = max(len(ids) for ids in prompts.values())
    max_cache_len = ((longest + args.steps + 1 + 63) // 64) * 64

    runners: dict[str, Any] = {"native": NativeRunner(target)}
    if native_f32 is not None:
        runners["native_f32"] = NativeRunner(native_f32)
    runners["hf_eager"] = StaticRunner(hf_model, max_cache_len)
    for name in list(runners):
        warm(name, runners[name], prompts, args.steps)
    modes = [m for m in args.modes.split(",") if m]
    compile_info = add_compiled(runners, hf_model, max_cache_len, modes, prompts, args.steps)
    times, tokens = interleaved(runners, prompts, args.rounds, args.steps)
    results = summarise(times, tokens, list(prompts))
    names, cats = list(runners), list(prompts)
    print(f"ms per decode step, {args.steps} steps, {args.rounds} rounds, {args.threads} threads")
    print("contexts: " + ", ".join(f"{c} {len(ids)} tokens" for c, ids in prompts.items()))
    print_table(results, compile_info, names, cats)

    if args.json:
        payload = {
            "what": "ms per one-token greedy decode step (prefill excluded): ragspec native step vs "
            "transformers StaticCache eager vs torch.compile (inductor, CPU)",
            "model": spec.name,
            "hf_dir": str(hf_dir),
            "dtype": "float32",
            "threads": args.threads,
            "steps": args.steps,
            "rounds": args.rounds,
            "max_cache_len": max_cache_len,
            "contexts": {c: len(ids) for c, ids in prompts.items()},
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "results": results,
            "compile": compile_info,
            "tokens": {n: {c: tokens[n][c] for c in cats} for n in names},
            "total_s": round(time.perf_counter() - t_start, 1),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        logger.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
