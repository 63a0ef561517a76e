"""The Python half of scripts/gpu_check.sh: a random-weights model, the CUDA backend's step
time against rows (eager and under graphs), the bench with
results written after every prompt (the CUDA backend beside, with its drafting as `auto`
picks it and retrieval alone), the concurrency run (8 requests stepped together), the
final table, and the plan of the lent machine's two calls.

    python scripts/gpu_check.py random-model (--config-tar .gpu/c/model-config.tar.gz | --from-default) --out DIR [--layers N]
    python scripts/gpu_check.py cuda-micro --model M --device cuda --modes exact,fast --out cuda-micro.json [--smoke]
    python scripts/gpu_check.py bench --model M --device cuda --dtype bf16 --data P --out bench.json [--cuda-modes exact]
    python scripts/gpu_check.py concurrent --model M --device cuda --data P --modes exact --out concurrent.json
    python scripts/gpu_check.py table --dir OUT [--dir STASH ...]
    python scripts/gpu_check.py plan --left SECONDS [--shell]

Every number is printed and written as JSON; ``table`` reads the JSON files back (from the
first and the second device call) and prints one compact table. This is a command-line
tool: it prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tarfile
import time
from pathlib import Path

import torch

CATEGORIES = ("rag", "summarization", "qa", "translation")


# ---------------------------------------------------------------------------- helpers
def _env() -> dict:
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "cuda": torch.cuda.is_available(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "NVIDIA_TF32_OVERRIDE": os.environ.get("NVIDIA_TF32_OVERRIDE"),
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
    return info


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _no_tf32() -> None:
    """float32 matrix products in full float32 (the identity stages)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


# ---------------------------------------------------------------------------- random-model
def cmd_random_model(args) -> int:
    """The default model's architecture and tokenizer with random weights (seed 0), saved
    as a Hugging Face folder: timings are those of the real shapes; acceptance and
    therefore speedups are not meaningful."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(args.out)
    work = out.with_name(out.name + ".src")
    work.mkdir(parents=True, exist_ok=True)
    if args.config_tar:
        with tarfile.open(args.config_tar) as tf:
            tf.extractall(work, filter="data")
        cfg_dir, tok_dir = work / "config", work / "tokenizer"
    else:  # the fetched default model's config and tokenizer
        from ragspec import models

        spec = models.resolve_model(None)
        cfg_dir, tok_dir = models.converted_model_dir(spec.path), models.converted_tokenizer_dir(spec.path)
        if not (cfg_dir / "config.json").is_file():
            models.load_model(spec, device="cpu")  # the first load converts the GGUF (config, tokenizer)
    cfg = AutoConfig.from_pretrained(cfg_dir, local_files_only=True)
    if args.layers:
        cfg.num_hidden_layers = int(args.layers)
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[: cfg.num_hidden_layers]
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(
        f"random-weights model ({cfg.num_hidden_layers} layers, {model.num_parameters() / 1e6:.0f}M parameters) "
        f"saved to {out} in {time.perf_counter() - t0:.1f} s"
    )
    return 0


# ---------------------------------------------------------------------------- CUDA backend
def _cuda_backend():
    """``ragspec.backend.cuda`` where this tree has it (and triton is installed), else None."""
    try:
        from ragspec.backend import cuda
        from ragspec.backend.cuda import kernels
    except ImportError as e:
        print(f"# the CUDA backend is not available here ({e})")
        return None
    if not kernels.triton_available():
        print("# the CUDA backend needs triton; not installed here")
        return None
    return cuda


def _cuda_engine(
    base,
    numerics: str,
    *,
    budget: int,
    drafts: bool = True,
    slots: int = 16,
    context: int = 2048,
    calibrate: bool = True,
    graphs=None,
    drafting: str = "auto",
    target=None,
    latency=None,
):
    """An engine over the CUDA backend sharing ``base``'s transformers model, tokenizer and
    drafter (:func:`ragspec.loading.engine_on_target`; ``drafts=False``: plain decoding;
    ``drafting="retrieval"``: its retrieval part alone, no head), its latency model measured on the CUDA step (q 1-64 with
    synchronisation on CUDA) unless ``calibrate`` is off, its draft budget ``budget``, or
    with ``budget`` 0 GPU-sized from that latency table
    (:func:`ragspec.backend.cuda.gpu_draft_policy`: 16-64 nodes). ``target``: an existing
    CUDA target to share (its KV pool and graphs); ``latency``: its latency model, measured
    already."""
    import dataclasses

    from ragspec.backend.cuda import gpu_draft_policy, load_cuda_target
    from ragspec.calibrate import measure_latency_model
    from ragspec.loading import compose_drafter, engine_on_target

    if target is None:
        target = load_cuda_target(base.model, numerics=numerics, max_slots=slots, context=context, graphs=graphs)
    drafter = base.drafter if drafts else None
    if drafts and drafting == "retrieval":
        drafter = compose_drafter(base.parts.pld, [], None, drafting="retrieval")
    if latency is None:
        latency = measure_latency_model(target) if calibrate and drafts else base.latency
    if budget > 0:
        policy = dataclasses.replace(base.policy, max_draft_tokens=budget)
    else:
        policy = gpu_draft_policy(latency.table, base.policy)
    if drafts:
        print(f"# CUDA {numerics}: draft budget {policy.max_draft_tokens}, step rows {policy.max_step_rows}"
              + ("" if budget > 0 else " (from its latency table)"), flush=True)  # fmt: skip
    return engine_on_target(base, target, drafter=drafter, policy=policy, latency=latency)


def cmd_cuda_micro(args) -> int:
    """The CUDA backend's step time against rows (1-64) at two contexts, per numerics mode,
    eager and under CUDA graphs (synchronised: wall time of the forward)."""
    from ragspec import models
    from ragspec.backend.cuda import load_cuda_target
    from ragspec.calibrate import measure_latency

    if _cuda_backend() is None:
        return 1
    spec = models.resolve_model(args.model)
    model, _tok = models.load_model(spec, device=args.device, dtype=args.dtype)
    results = {"env": _env(), "model": spec.name, "model_path": str(spec.path), "dtype": args.dtype, "runs": {}}
    kw = (
        dict(qs=(1, 2, 4, 8), contexts=(32,), repeats=1)
        if args.smoke
        else dict(qs=(1, 2, 4, 8, 16, 32, 64), contexts=(512, 2048))
    )
    for mode in [m for m in args.modes.split(",") if m]:
        for graphs in (False, True) if args.device == "cuda" else (False,):
            name = f"{mode} {'graphs' if graphs else 'eager'}"
            t0 = time.perf_counter()
            target = load_cuda_target(
                model, numerics=mode, max_slots=4, context=max(kw["contexts"]) + 80, graphs=graphs
            )
            table = measure_latency(target, model_name=spec.name, **kw)
            runner = target.graphs
            results["runs"][name] = {
                "latency": table.to_dict(),
                "captured": list(runner.captured) if runner else [],
                "graph_steps": runner.graph_steps if runner else 0,
                "eager_steps": runner.eager_steps if runner else None,
                "seconds": time.perf_counter() - t0,
            }
            lat = table.to_dict()["full"]
            print(f"# CUDA backend {name}, {args.dtype}: step ms vs rows"
                  + (f" (graphs captured {sorted(runner.captured)})" if runner else ""))  # fmt: skip
            for ctx, row in sorted(lat.items(), key=lambda kv: int(kv[0])):
                print(f"  context {ctx:>5}: " + "  ".join(f"{q}:{v * 1e3:.2f}" for q, v in row.items()))
            del target
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            _write_json(Path(args.out), results)
    return 0


def cmd_concurrent(args) -> int:
    """Throughput of one request at a time against ``--in-flight`` requests stepped together
    (continuous batching, :meth:`Engine.run_requests`), per CUDA numerics mode, speculative
    and plain; identity: each request's batched output against its solo output and
    speculative against plain; the drafter's time per step."""
    from ragspec import load_engine
    from ragspec.bench import runner as bench
    from ragspec.config import PolicyConfig
    from ragspec.specbench import load_prompts

    if _cuda_backend() is None:
        return 1
    cats = [c for c in args.categories.split(",") if c]
    rows = load_prompts(args.data, cats, args.limit)
    os.environ["RAGSPEC_CUDA_BACKEND"] = "0"  # the base lends its model, tokenizer and drafter only
    base = load_engine(args.model, device=args.device, dtype=args.dtype, calibrate=False,
                       policy=PolicyConfig(max_draft_tokens=args.budget or 8))  # fmt: skip
    os.environ.pop("RAGSPEC_CUDA_BACKEND")
    prompts = [base.encode_prompt(r["turns"][0], chat=True) for r in rows]
    context = max(len(p) for p in prompts) + args.max_new_tokens + (args.budget or 64) + 8
    results = {"env": _env(), "model": base.model_name, "in_flight": args.in_flight, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "budget": args.budget, "modes": {}}  # fmt: skip

    def solo(engine):
        outs, secs, draft_s, steps = [], 0.0, 0.0, 0
        for ids in prompts:
            out, s = bench.timed_call(
                engine.target.device, lambda: engine.generate(ids, max_new_tokens=args.max_new_tokens, chat=False)
            )
            outs.append(list(out.token_ids))
            secs += s
            draft_s += out.stats.draft_s
            steps += max(0, out.stats.num_forward_passes - 1)
        return outs, secs, draft_s, steps

    def together(engine):
        starts = [
            lambda ids=ids: engine.request(ids, chat=False, max_new_tokens=args.max_new_tokens) for ids in prompts
        ]
        outs = [[] for _ in prompts]
        bench.sync_device(engine.target.device)
        t0 = time.perf_counter()
        for step in engine.run_requests(starts, args.in_flight):
            for i, chunk in step:
                outs[i].extend(chunk.token_ids)
        bench.sync_device(engine.target.device)
        return outs, time.perf_counter() - t0

    for mode in [m for m in args.modes.split(",") if m]:
        spec_eng = _cuda_engine(base, mode, budget=args.budget, slots=args.in_flight + 2, context=context,
                                calibrate=not args.no_calibrate)  # fmt: skip
        plain_eng = _cuda_engine(
            base, mode, budget=args.budget, drafts=False, slots=args.in_flight + 2, context=context
        )
        together(spec_eng)  # warm-up: compiles the kernels, captures the graphs
        s1, s1_s, draft_s, steps = solo(spec_eng)
        p1, p1_s, _, _ = solo(plain_eng)
        s8, s8_s = together(spec_eng)
        p8, p8_s = together(plain_eng)
        tokens = sum(len(o) for o in s1)
        r = {
            "solo_tok_s": tokens / s1_s,
            "solo_plain_tok_s": sum(len(o) for o in p1) / p1_s,
            "together_tok_s": sum(len(o) for o in s8) / s8_s,
            "together_plain_tok_s": sum(len(o) for o in p8) / p8_s,
            "spec_eq_plain_solo": sum(a == b for a, b in zip(s1, p1)),
            "spec_eq_plain_together": sum(a == b for a, b in zip(s8, p8)),
            "together_eq_solo": sum(a == b for a, b in zip(s8, s1)),
            "plain_together_eq_solo": sum(a == b for a, b in zip(p8, p1)),
            "draft_ms_per_step": 1e3 * draft_s / max(1, steps),
            "step_ms_solo": 1e3 * s1_s / max(1, steps),
        }
        r["batching_gain"] = r["together_tok_s"] / r["solo_tok_s"]
        r["budget"] = spec_eng.policy.max_draft_tokens
        results["modes"][mode] = r
        n = len(prompts)
        print(f"# CUDA {mode}, {args.dtype}: 1 at a time {r['solo_tok_s']:.1f} tok/s (plain {r['solo_plain_tok_s']:.1f}), "
              f"{args.in_flight} together {r['together_tok_s']:.1f} (plain {r['together_plain_tok_s']:.1f}): "
              f"x{r['batching_gain']:.2f}; speculative == plain {r['spec_eq_plain_solo']}/{n} solo, "
              f"{r['spec_eq_plain_together']}/{n} together; together == solo {r['together_eq_solo']}/{n}; "
              f"drafter {r['draft_ms_per_step']:.2f} ms of a {r['step_ms_solo']:.2f} ms step; budget {r['budget']}",
              flush=True)  # fmt: skip
        _write_json(Path(args.out), results)
        del spec_eng, plain_eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


# ---------------------------------------------------------------------------- bench
def cmd_bench(args) -> int:
    """``ragspec bench`` (the same load_engine + bench.run_bench), writing the
    JSON after every prompt so that a stage cut off by its time limit keeps what it did."""
    import dataclasses

    from ragspec import load_engine
    from ragspec.bench import runner as bench
    from ragspec.config import PolicyConfig
    from ragspec.specbench import load_prompts

    if args.dtype in ("fp32", "float32"):
        _no_tf32()
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    cats = [c for c in args.categories.split(",") if c]
    rows = load_prompts(args.data, cats, args.limit)
    t0 = time.perf_counter()
    # the columns rs@8 / rs@32: ragspec's transformers backend (on CUDA, load_engine would
    # give the CUDA backend: it runs as the cuda-* variants beside)
    os.environ["RAGSPEC_CUDA_BACKEND"] = "0"
    engine = load_engine(args.model, device=args.device, dtype=args.dtype, calibrate=not args.no_calibrate,
                         policy=PolicyConfig(max_draft_tokens=budgets[0]))  # fmt: skip
    os.environ.pop("RAGSPEC_CUDA_BACKEND")
    variants = {}
    modes = [m for m in (args.cuda_modes or "").split(",") if m]
    draftings = [d for d in args.cuda_drafting.split(",") if d]
    if modes and _cuda_backend() is not None:
        longest = max((len(engine.encode_prompt(r["turns"][0], chat=True)) for r in rows), default=0)
        context = longest + args.max_new_tokens + (args.cuda_budget or 64) + 8
        for mode in modes:
            # "X@0": the same backend with drafting off (speculative == plain, per mode);
            # "X/retrieval": retrieval drafting alone (against `auto`: the head's cost on CUDA)
            first = variants[f"cuda-{mode}"] = _cuda_engine(engine, mode, budget=args.cuda_budget, slots=4,
                                                            context=context, calibrate=not args.no_calibrate)  # fmt: skip
            for d in draftings[1:]:
                variants[f"cuda-{mode}/{d}"] = _cuda_engine(engine, mode, budget=args.cuda_budget, drafting=d,
                                                            target=first.target, latency=first.latency)  # fmt: skip
            variants[f"cuda-{mode}@0"] = _cuda_engine(engine, mode, budget=args.cuda_budget, drafts=False,
                                                      target=first.target)  # fmt: skip
    settings = {
        "model": engine.model_name,
        "model_arg": args.model,
        "random_weights": bool(args.random_weights),
        "calibrated": not args.no_calibrate,
        "device": str(engine.target.device),
        "dtype": str(engine.target.dtype),
        "max_new_tokens": args.max_new_tokens,
        "budgets": budgets,
        "static_baseline": args.static,
        "hf_pld": not args.no_hf_pld,
        "prompts": len(rows),
        "eagle": engine.eagle_path,
        "attn_implementation": getattr(engine.model.config, "_attn_implementation", None),
        "latency_ms": {q: v * 1e3 for q, v in engine.latency.table.items()},
        "cuda_variants": sorted(variants),
        "cuda_budget": {n: e.policy.max_draft_tokens for n, e in variants.items() if "@" not in n},
        "cuda_latency_ms": {
            n: {q: v * 1e3 for q, v in e.latency.table.items()} for n, e in variants.items() if "@" not in n
        },
        "load_s": time.perf_counter() - t0,
        "env": _env(),
    }
    print(
        f"# bench {settings['dtype']} on {settings['device']}: {len(rows)} prompts, {args.max_new_tokens} new tokens, "
        f"budgets {budgets}, static baseline {args.static}, loaded in {settings['load_s']:.1f} s",
        flush=True,
    )
    records = []
    out = Path(args.out)

    def save(done: bool) -> None:
        settings["static_compiled"] = bench.static_compiled(engine.model)
        settings["complete"] = done
        _write_json(out, {"settings": settings, "summary": bench.summarize(records) if records else {},
                          "records": [dataclasses.asdict(r) for r in records]})  # fmt: skip

    def progress(i, r) -> None:
        records.append(r)
        more = "  ".join(f"@{b} {m['tokens'] / m['s']:.1f} {'=' if m['identical'] else 'DIFF@%d' % m['first_diff']}"
                         for b, m in r.more_budgets.items())  # fmt: skip
        static = f"static {r.static_tokens / r.static_s:.1f}  " if r.static_s else ""
        cuda = "  ".join(f"{n} {m['tokens'] / m['s']:.1f} {'=' if m['identical'] else 'DIFF@%d' % m['first_diff']}"
                         + ("" if "plain_identical" not in m else " spec==plain" if m["plain_identical"] else " SPEC!=PLAIN")
                         for n, m in r.variants.items() if "@" not in n)  # fmt: skip
        pld = f"pld {r.hf_pld_tokens / r.hf_pld_s:.1f}  " if r.hf_pld_s else ""
        print(f"  [{i + 1}/{len(rows)}] {r.category:<13} base {r.baseline_tokens / r.baseline_s:.1f}  {static}{pld}"
              f"@{r.max_draft_tokens} {r.ragspec_tokens / r.ragspec_s:.1f} "
              f"{'=' if r.identical else 'DIFF@%d' % r.first_diff}  {more}  {cuda}", flush=True)  # fmt: skip
        save(False)

    bench.run_bench(engine, rows, max_new_tokens=args.max_new_tokens, hf_pld=not args.no_hf_pld,
                    static_baseline=args.static, draft_budgets=budgets, warmup=True, progress=progress,
                    variants=variants or None)  # fmt: skip
    save(True)
    print(bench.format_table(bench.summarize(records)))
    _record_drafting(records, modes, draftings, Path(args.out).with_name("drafting.json"))
    return 0


def _record_drafting(records, modes, draftings, path: Path) -> None:
    """Which drafting the CUDA backend decodes faster with, `auto` (the head and retrieval
    merged) or retrieval alone, measured in this bench: written to ``path`` and recorded in
    ragspec's cache, where ``--drafting auto`` reads it on this GPU
    (:func:`ragspec.backend.cuda.drafting.record_drafting`)."""
    if not records or not torch.cuda.is_available() or len(draftings) < 2:
        return
    from ragspec.backend.cuda.drafting import record_drafting
    from ragspec.models import cache_dir

    for mode in modes:
        speeds = {}
        for d in draftings:
            name = f"cuda-{mode}" if d == draftings[0] else f"cuda-{mode}/{d}"
            runs = [r.variants[name] for r in records if name in r.variants]
            if runs:
                speeds[d] = {
                    "tok_s": sum(m["tokens"] for m in runs) / max(1e-9, sum(m["s"] for m in runs)),
                    "draft_ms_per_step": 1e3
                    * sum(m.get("draft_s", 0.0) for m in runs)
                    / max(1, sum(m["forward_passes"] - 1 for m in runs)),
                }
        if len(speeds) < 2 or mode != "exact":
            continue
        gpu = torch.cuda.get_device_name(0)
        choice = "merged" if speeds["auto"]["tok_s"] >= speeds["retrieval"]["tok_s"] else "retrieval"
        saved = record_drafting(gpu, choice, speeds, cache_dir())
        _write_json(path, {"gpu": gpu, "choice": choice, "measured": speeds, "recorded_in": str(saved)})
        print(f"# drafting on {gpu}: auto {speeds['auto']['tok_s']:.1f} tok/s "
              f"({speeds['auto']['draft_ms_per_step']:.2f} ms drafting a step), retrieval alone "
              f"{speeds['retrieval']['tok_s']:.1f} ({speeds['retrieval']['draft_ms_per_step']:.2f} ms): "
              f"--drafting auto picks {choice} on this GPU", flush=True)  # fmt: skip


# ---------------------------------------------------------------------------- table
def _load(dirs, name):
    for d in dirs:
        p = Path(d) / name
        if p.is_file():
            try:
                return json.loads(p.read_text())
            except ValueError:
                continue
    return None


def _junit(dirs, name):
    import xml.etree.ElementTree as ET

    for d in dirs:
        p = Path(d) / name
        if p.is_file():
            try:
                root = ET.parse(p).getroot()
            except ET.ParseError:
                continue
            suites = [root] if root.tag == "testsuite" else list(root)
            tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
            failed = [
                f"{c.get('classname', '').split('.')[-1]}::{c.get('name')}"
                for s in suites
                for c in s.iter("testcase")
                if c.find("failure") is not None or c.find("error") is not None
            ]
            return tot, failed
    return None


def _tps(tokens, seconds):
    return tokens / seconds if seconds else float("nan")


def _fmt(x, width=8, digits=1):
    return f"{x:>{width}.{digits}f}" if isinstance(x, (int, float)) and not math.isnan(x) else f"{'-':>{width}}"


def _width(name: str) -> int:
    """A column wide enough for ``name`` and " tok/s", at least 17."""
    return max(17, len(name) + 8)


def _cuda_lines(dirs, gb: dict, gf: dict, st: dict) -> list:
    """The CUDA backend's part of the table: tokens/s per numerics mode against
    transformers' generate (bf16), identity to transformers greedy (bf16 share, fp32) and
    speculative == plain within the mode; 8 concurrent requests; step time against rows."""
    lines = []
    names = sorted({n for rs in gb.values() for r in rs for n in r.get("variants", {}) if "@" not in n})
    if names:
        head = f"{'category':<14}" + "".join(
            f"{n + ' tok/s':>{_width(n)}}{'x':>6}{'=hf bf16':>10}{'=hf fp32':>10}{'spec=plain':>12}" for n in names
        )
        lines += [f"CUDA backend (draft budgets {st.get('cuda_budget')}): tokens/s in bf16, x over generate; identical to "
                  "transformers greedy (bf16, fp32 TF32 off); speculative == plain (bf16). Columns: cuda-MODE: ragspec's "
                  "CUDA backend in MODE numerics under CUDA graphs, drafting as --drafting auto picks it; "
                  "cuda-MODE/retrieval: the same with retrieval drafting alone (no EAGLE head)", head, "-" * len(head)]  # fmt: skip
        for g, rs in gb.items():
            base = _tps(sum(r["baseline_tokens"] for r in rs), sum(r["baseline_s"] for r in rs))
            cells = ""
            for n in names:
                ms = [r["variants"][n] for r in rs if n in r.get("variants", {})]
                fs = [r["variants"][n] for r in gf.get(g, []) if n in r.get("variants", {})]
                tps = _tps(sum(m["tokens"] for m in ms), sum(m["s"] for m in ms)) if ms else float("nan")
                same = f"{sum(bool(m['identical']) for m in ms)}/{len(ms)}"
                same32 = f"{sum(bool(m['identical']) for m in fs)}/{len(fs)}" if fs else "-"
                plain = [m for m in ms if "plain_identical" in m]
                sp = f"{sum(bool(m['plain_identical']) for m in plain)}/{len(plain)}" if plain else "-"
                cells += f"{_fmt(tps, _width(n))}{_fmt(tps / base if base else float('nan'), 6, 2)}{same:>10}{same32:>10}{sp:>12}"
            lines.append(f"{g:<14}{cells}")
    conc = _load(dirs, "concurrent-bf16.json")
    for mode, r in (conc or {}).get("modes", {}).items():
        n = conc["prompts"]
        lines.append(
            f"CUDA {mode}, {conc['in_flight']} concurrent (bf16): {r['together_tok_s']:.1f} tok/s against "
            f"{r['solo_tok_s']:.1f} one at a time (x{r['batching_gain']:.2f}; plain {r['together_plain_tok_s']:.1f} / "
            f"{r['solo_plain_tok_s']:.1f}); speculative == plain {r['spec_eq_plain_solo']}/{n} solo, "
            f"{r['spec_eq_plain_together']}/{n} together; together == solo {r['together_eq_solo']}/{n}; "
            f"drafter {r['draft_ms_per_step']:.2f} ms per {r['step_ms_solo']:.2f} ms step; budget {r.get('budget')}"
        )
    if conc is None:
        lines.append("CUDA backend, concurrent requests: no results")
    choice = _load(dirs, "drafting.json")
    if choice:
        m = choice["measured"]
        lines.append(f"drafting on {choice['gpu']}: auto {m['auto']['tok_s']:.1f} tok/s ({m['auto']['draft_ms_per_step']:.2f} ms "
                     f"drafting per step) vs retrieval alone {m['retrieval']['tok_s']:.1f} "
                     f"({m['retrieval']['draft_ms_per_step']:.2f} ms): --drafting auto now picks {choice['choice']}")  # fmt: skip
    cm = _load(dirs, "cuda-micro.json")
    for name, r in (cm or {}).get("runs", {}).items():
        lat = r["latency"]["full"]
        cells = "; ".join(
            f"ctx {c}: "
            + " ".join(f"q{q} {v * 1e3:.2f}" for q, v in row.items() if q in ("1", "4", "8", "16", "32", "64"))
            for c, row in sorted(lat.items(), key=lambda kv: int(kv[0]))
        )
        graphs = f" [graphs {r['graph_steps']} steps, {r['eager_steps']} eager]" if r.get("captured") else ""
        lines.append(
            f"CUDA step ms, {name}{' (random weights)' if 'random' in cm.get('model_path', '') else ''}: {cells}{graphs}"
        )
    if cm is None:
        lines.append("CUDA backend micro-benchmark: no results")
    return lines


def _group_rows(res) -> dict:
    """A bench result's records by category (in :data:`CATEGORIES`' order) and ``"all"``."""
    out: dict = {}
    if not res:
        return out
    for r in res["records"]:
        cat = r["category"]
        for g in (cat, "all"):
            out.setdefault(g, []).append(r)
    return {g: out[g] for g in [c for c in CATEGORIES if c in out] + ["all"] if g in out}


def _budget_tps(records, b):
    """ragspec's tokens/s over ``records`` at draft budget ``b`` (nan: none ran at it)."""
    if not records:
        return float("nan")
    if records[0].get("max_draft_tokens") == b:
        return _tps(sum(r["ragspec_tokens"] for r in records), sum(r["ragspec_s"] for r in records))
    ms = [r["more_budgets"][str(b)] for r in records if str(b) in r.get("more_budgets", {})]
    return _tps(sum(m["tokens"] for m in ms), sum(m["s"] for m in ms)) if ms else float("nan")


def _ident(records, b) -> str:
    """How many of ``records`` at draft budget ``b`` are token-identical to the baseline."""
    from ragspec.bench.records import format_identity

    if not records:
        return "-"
    if records[0].get("max_draft_tokens") == b:
        pairs = [(r["identical"], r["first_diff"]) for r in records]
    else:
        pairs = [(m["identical"], m["first_diff"]) for r in records
                 for m in [r.get("more_budgets", {}).get(str(b))] if m]  # fmt: skip
    if not pairs:
        return "-"
    return format_identity(sum(bool(i) for i, _ in pairs), len(pairs), [d for i, d in pairs if not i and d >= 0])


def _test_and_stage_lines(dirs) -> list:
    """The table's last lines: the GPU and e2e test results (JUnit files) and each call's
    stages with their exit status and seconds."""
    lines: list = []
    for name, label in (
        ("tests-gpu.xml", "tests/gpu/test_cuda_backend.py"),
        ("tests-gpu-real.xml", "tests/gpu (real model)"),
        ("tests-e2e.xml", "tests/e2e identity (fp32)"),
    ):
        res = _junit(dirs, name)
        if res is None:
            if name == "tests-gpu.xml":
                lines.append(f"{label}: not run")
            continue
        tot, failed = res
        passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
        lines.append(f"{label}: {passed} passed, {tot['failures'] + tot['errors']} failed, {tot['skipped']} skipped"
                     + (f"; FAILED: {', '.join(failed[:12])}" if failed else ""))  # fmt: skip
    seen = set()
    for d in dirs:
        for p in sorted(Path(d).glob("stages*.tsv")):
            if p.name in seen:  # (the first call's, in this call's results and on the machine)
                continue
            seen.add(p.name)
            stages = [line.split("\t") for line in p.read_text().splitlines() if line.strip()]
            lines.append(
                f"stages ({p}): "
                + ", ".join(
                    f"{s[0]} {'ok' if s[1] == '0' else s[1] if s[1] == 'skipped' else 'rc=' + s[1]} {float(s[2]):.0f}s"
                    for s in stages
                )
            )
    return lines


def cmd_table(args) -> int:
    """One compact table from the JSON files of both device calls."""
    dirs = args.dir
    bf16, fp32, micro = _load(dirs, "bench-bf16.json"), _load(dirs, "bench-fp32.json"), _load(dirs, "cuda-micro.json")
    env = (bf16 or fp32 or {}).get("settings", {}).get("env") or (micro or {}).get("env") or {}
    lines = ["", "=" * 100]
    st = (bf16 or fp32 or {}).get("settings", {})
    lines.append(
        f"ragspec GPU check | {env.get('gpu', 'no GPU (' + str(st.get('device', 'cpu')) + ')')} | torch {env.get('torch')} | "
        f"transformers {env.get('transformers')} | model {st.get('model', '?')}"
        + (" (RANDOM WEIGHTS: speed/acceptance not meaningful)" if st.get("random_weights") else "")
    )
    for label, res in (("bf16", bf16), ("fp32", fp32)):
        if res is None and label == "fp32":
            continue  # (not run on the lent machine)
        if res:
            s = res["settings"]
            lines.append(
                f"  bench {label}: {len(res['records'])}/{s['prompts']} prompts{'' if s.get('complete') else ' (CUT OFF)'}, "
                f"{s['max_new_tokens']} new tokens, budgets {s['budgets']}, static-cache generate "
                f"{'compiled' if s.get('static_compiled') else 'eager (not compiled)' if s.get('static_baseline') else 'not run'}, "
                f"attention {s.get('attn_implementation')}, eagle {'on' if s.get('eagle') else 'off'}"
            )
        else:
            lines.append(f"  bench {label}: no results")
    # tokens/s (bf16) and identity (bf16 share, fp32)
    head = (
        f"{'category':<14}{'n':>3}{'generate':>10}{'static':>9}{'hf-pld':>9}{'rs@8':>9}{'rs@32':>9}{'x@8':>7}{'x@32':>7}"
        f"  {'bf16 identical @8 | @32':<26}{'fp32 identical @8 | @32':<24}"
    )
    lines += [
        "tokens/s in bf16 (x: speedup over generate); identity against model.generate of the same dtype. Columns:",
        "  generate: transformers' model.generate, eager | static: its static-cache generate, torch.compile'd |",
        "  hf-pld: its prompt lookup | rs@8, rs@32: ragspec on its transformers backend (RAGSPEC_CUDA_BACKEND=0),",
        "  draft budget 8 / 32 (the CUDA backend, what `ragspec serve --device cuda` runs, is the next block)",
        head,
        "-" * len(head),
    ]

    gb, gf = _group_rows(bf16), _group_rows(fp32)
    budgets = (st.get("budgets") or [8, 32])[:2]
    for g in list(gb) or list(gf):
        rs = gb.get(g, [])
        base = _tps(sum(r["baseline_tokens"] for r in rs), sum(r["baseline_s"] for r in rs)) if rs else float("nan")
        stat = [r for r in rs if r.get("static_s")]
        static = _tps(sum(r["static_tokens"] for r in stat), sum(r["static_s"] for r in stat)) if stat else float("nan")
        pld = [r for r in rs if r.get("hf_pld_s")]
        pld_tps = _tps(sum(r["hf_pld_tokens"] for r in pld), sum(r["hf_pld_s"] for r in pld)) if pld else float("nan")
        t8 = _budget_tps(rs, budgets[0])
        t32 = _budget_tps(rs, budgets[-1])
        fr = gf.get(g, [])
        lines.append(
            f"{g:<14}{len(rs) or len(fr):>3}{_fmt(base, 10)}{_fmt(static, 9)}{_fmt(pld_tps, 9)}{_fmt(t8, 9)}{_fmt(t32, 9)}"
            f"{_fmt(t8 / base if base else float('nan'), 7, 2)}{_fmt(t32 / base if base else float('nan'), 7, 2)}"
            f"  {_ident(rs, budgets[0]) + ' | ' + _ident(rs, budgets[-1]):<26}{_ident(fr, budgets[0]) + ' | ' + _ident(fr, budgets[-1]):<24}"
        )
    lines += _cuda_lines(dirs, gb, _group_rows(fp32), st)
    lines += _test_and_stage_lines(dirs)
    lines.append("=" * 100)
    print("\n".join(lines))
    return 0


# ---------------------------------------------------------------------------- plan
FIRST_MAX_S, FINAL_MAX_S, KEEP_S, CALL_OVERHEAD_S, BACKSTOP_S = 200, 480, 30, 15, 10
"""The lent machine's calls: call 1 at most 200 s, call 2 at most 480 s; 30 s of device time
kept free; per call ~15 s of transfer and start, and the tool's timeout 10 s above the
script's own deadline (the script ends its stages before it)."""


def plan_calls(left_s: float) -> list[dict]:
    """The two calls for ``left_s`` seconds of device time left: each one's deadline (the
    script's DEADLINE_S) and the tool's timeout. Raises SystemExit when both do not fit."""
    per_call = CALL_OVERHEAD_S + BACKSTOP_S
    room = int(left_s) - KEEP_S - 2 * per_call
    first = min(FIRST_MAX_S, room - FINAL_MAX_S)
    first = max(first, min(FIRST_MAX_S, 120))  # the tests and step times need about two minutes
    final = min(FINAL_MAX_S, room - first)
    if final < 150:
        raise SystemExit(f"gpu_check plan: {left_s:.0f} s of device time left do not fit both calls "
                         f"(call 1 {first} s, call 2 {final} s of at least 150)")  # fmt: skip
    return [
        {"mode": "first", "deadline_s": first, "timeout_s": first + BACKSTOP_S, "part": "p1"},
        {"mode": "final", "deadline_s": final, "timeout_s": final + BACKSTOP_S, "part": "p2"},
    ]


def cmd_plan(args) -> int:
    """The lent machine's two calls, back to back: what each carries and its deadline."""
    calls = plan_calls(args.left)
    if args.shell:
        print(f"PLAN_FIRST_S={calls[0]['deadline_s']} PLAN_FINAL_S={calls[1]['deadline_s']}")
        return 0
    repo = Path(__file__).resolve().parents[1]
    mib = 1 << 20
    man_path = repo / ".gpu" / "c" / "manifest.json"
    man = json.loads(man_path.read_text()) if man_path.is_file() else {}
    tree, common = man.get("tree_bytes"), man.get("common_bytes", 0)
    print(f"plan for {args.left:.0f} s of device time left ({KEEP_S} s kept free, ~{CALL_OVERHEAD_S} s per call "
          f"for the transfer and start); make the calls one right after the other:")  # fmt: skip
    for k, call in enumerate(calls, 1):
        part = man.get("parts", {}).get(str(k), {}).get("bytes", 0)
        size = (f"{tree / mib:.1f} MiB tree + {common / mib:.1f} MiB .gpu/c + {part / mib:.1f} MiB .gpu/{call['part']} = "
                f"{(tree + common + part) / mib:.1f} MiB of 64" if tree is not None else "size: not prepared (gpu_prepare.sh)")  # fmt: skip
        print(f"  call {k} ({call['mode']}): deadline {call['deadline_s']} s, timeout_s {call['timeout_s']}; {size}")
    for call in calls:
        print(f'run(command="DEADLINE_S={call["deadline_s"]} bash scripts/gpu_check.sh {call["mode"]}", '
              f'carry=[".gpu/{call["part"]}", ".gpu/c"], timeout_s={call["timeout_s"]})')  # fmt: skip
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("random-model")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--config-tar")
    src.add_argument("--from-default", action="store_true", help="the fetched default model's config")
    r.add_argument("--out", required=True)
    r.add_argument("--layers", type=int, default=0)
    r.set_defaults(func=cmd_random_model)
    b = sub.add_parser("bench")
    b.add_argument("--model", default=None)
    b.add_argument("--random-weights", action="store_true")
    b.add_argument("--device", default="cuda")
    b.add_argument("--dtype", default="bf16")
    b.add_argument("--data", required=True)
    b.add_argument("--categories", default=",".join(CATEGORIES))
    b.add_argument("--limit", type=int, default=2)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--budgets", default="8,32")
    b.add_argument("--static", action="store_true")
    b.add_argument("--no-hf-pld", action="store_true")
    b.add_argument("--no-calibrate", action="store_true", help="keep the reference latency table (CPU rehearsal)")
    b.add_argument("--cuda-modes", default="", help="also the CUDA backend in these numerics modes (exact,fast)")
    b.add_argument("--cuda-budget", type=int, default=0,
                   help="the CUDA backend's draft budget (0: GPU-sized from its latency table)")  # fmt: skip
    b.add_argument("--cuda-drafting", default="auto",
                   help="the CUDA backend's drafting, comma-separated: auto (as load_engine picks), retrieval")  # fmt: skip
    b.add_argument("--out", required=True)
    b.set_defaults(func=cmd_bench)
    cm = sub.add_parser("cuda-micro")
    cm.add_argument("--model", required=True)
    cm.add_argument("--device", default="cuda")
    cm.add_argument("--dtype", default="bf16")
    cm.add_argument("--modes", default="exact,fast")
    cm.add_argument("--out", required=True)
    cm.add_argument("--smoke", action="store_true")
    cm.set_defaults(func=cmd_cuda_micro)
    cc = sub.add_parser("concurrent")
    cc.add_argument("--model", default=None)
    cc.add_argument("--device", default="cuda")
    cc.add_argument("--dtype", default="bf16")
    cc.add_argument("--data", required=True)
    cc.add_argument("--categories", default=",".join(CATEGORIES))
    cc.add_argument("--limit", type=int, default=2)
    cc.add_argument("--max-new-tokens", type=int, default=128)
    cc.add_argument("--modes", default="exact,fast")
    cc.add_argument("--in-flight", type=int, default=8)
    cc.add_argument("--budget", type=int, default=0, help="draft budget (0: from the latency table)")
    cc.add_argument("--no-calibrate", action="store_true")
    cc.add_argument("--out", required=True)
    cc.set_defaults(func=cmd_concurrent)
    pl = sub.add_parser("plan")
    pl.add_argument("--left", type=float, required=True, help="seconds of device time left (after the start)")
    pl.add_argument("--shell", action="store_true", help="print PLAN_FIRST_S=... PLAN_FINAL_S=... only")
    pl.set_defaults(func=cmd_plan)
    t = sub.add_parser("table")
    t.add_argument("--dir", action="append", required=True)
    t.set_defaults(func=cmd_table)
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
