"""``ragspec bench``: ragspec against plain transformers decoding on Spec-Bench prompts.

For each prompt, in the same process and in alternating order, it times plain
``model.generate`` greedy (the baseline), optionally transformers' static-cache
``generate`` (compiled by transformers on CUDA: the fastest plain decoding it offers),
transformers' own prompt lookup (``prompt_lookup_num_tokens=10``) and ragspec (at one or
more draft budgets), and checks ragspec's tokens against the baseline. Every later speed
claim of the project is made with this.

Timings are wall time between two device synchronisations (``torch.cuda.synchronize`` on
CUDA; a no-op on CPU), so queued GPU work is never left out. With ``warmup`` each method
runs once on the first prompt before anything is timed (CUDA context and kernel caches,
``torch.compile`` of the static-cache baseline, cuBLAS handles).

With ``compare`` (``ragspec bench --compare llamacpp``) another decoder's plain greedy
(:mod:`ragspec.bench.compare`: llama-cpp-python on the same GGUF, the same token ids and thread
count) runs as one more interleaved method; the summary gains its tokens/s, prefill
seconds, decode-only tokens/s, first divergence from the baseline and ragspec's ratio to it.

Identity: in float32 (TF32 off) ragspec's greedy output should equal ``model.generate``'s
token for token. In bfloat16 it cannot be promised (a multi-row verification forward
rounds differently from a one-row step, which flips near-tied argmaxes), so the summary
reports the share of identical outputs and where the others first diverge.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from ..errors import ConfigError
from ..specbench import category_group
from .compare import compare_entry, format_compare_table, summarize_compare
from .records import BenchRecord, first_diff, format_identity

logger = logging.getLogger(__name__)

__all__ = [
    "run_bench",
    "make_record",
    "hf_generate",
    "static_generate_kwargs",
    "static_compiled",
    "summarize",
    "format_table",
    "profile_attention",
    "plot",
]


def sync_device(device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(device, fn):
    """(fn(), seconds) measured between two device synchronisations."""
    sync_device(device)
    t0 = time.perf_counter()
    result = fn()
    sync_device(device)
    return result, time.perf_counter() - t0


def static_generate_kwargs(max_cache_len: Optional[int] = None) -> dict:
    """``model.generate`` keywords for transformers' static-cache decoding. On CUDA
    transformers compiles the decoding step (``torch.compile``, mode "reduce-overhead": CUDA
    graphs) on the first call; ``max_cache_len`` sizes the cache for the longest request,
    so later calls of other lengths reuse the compiled step instead of recompiling."""
    kw: dict = {"cache_implementation": "static"}
    if max_cache_len:
        kw["max_cache_len"] = int(max_cache_len)
    return kw


def hf_generate(model, ids: list[int], max_new_tokens: int, eos: Sequence[int], **kw) -> list[int]:
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos) or None,
            pad_token_id=(list(eos) or [0])[0],
            **kw,
        )
    return out[0, len(ids) :].tolist()


def make_record(
    row: dict,
    prompt_ids: Sequence[int],
    baseline_tokens: Sequence[int],
    baseline_s: float,
    out,
    *,
    sampling: bool = False,
    keep_steps: bool = True,
) -> BenchRecord:
    """One prompt's record: ragspec's ``GenerationOutput`` ``out`` against the baseline's
    tokens and seconds (identity is not checked when ``sampling``)."""
    st = out.stats
    plain = [s for s in st.steps if s.num_drafted == 0]
    return BenchRecord(
        question_id=row.get("question_id"),
        category=row.get("category", ""),
        prompt_tokens=len(prompt_ids),
        baseline_tokens=len(baseline_tokens),
        baseline_s=baseline_s,
        ragspec_s=st.total_s,
        ragspec_tokens=len(out.token_ids),
        identical=(out.token_ids == baseline_tokens) if not sampling else False,
        first_diff=first_diff(out.token_ids, baseline_tokens) if not sampling else -1,
        mean_accepted=st.mean_accepted_tokens,
        acceptance_rate=st.acceptance_rate,
        drafted=st.num_drafted_tokens,
        accepted=st.num_accepted_tokens,
        forward_passes=st.num_forward_passes,
        draft_s=st.draft_s,
        verify_s=st.verify_s,
        prefill_s=st.prefill_s,
        accepted_histogram={int(k): v for k, v in st.accepted_histogram.items()},
        steps=[x.to_dict() for x in st.steps] if keep_steps else [],
        plain_step_s=sum(s.verify_s for s in plain),
        plain_steps=len(plain),
    )


def run_bench(
    engine,
    rows: Iterable[dict],
    *,
    max_new_tokens: int = 128,
    hf_pld: bool = True,
    static_baseline: bool = False,
    draft_budgets: Sequence[int] = (),
    warmup: bool = False,
    temperature: float = 0.0,
    seed: int = 0,
    progress=None,
    keep_steps: bool = False,
    documents_for=None,
    compare: Sequence = (),
    variants: Optional[dict] = None,
) -> list[BenchRecord]:
    """Run the benchmark over ``rows``; see the module docstring.

    Args:
        engine: the :class:`ragspec.Engine` under test (its model is the baselines' model).
        rows: Spec-Bench rows (``turns[0]`` is the prompt).
        max_new_tokens: tokens generated per prompt by every method.
        hf_pld: also time transformers' prompt lookup.
        static_baseline: also time transformers' static-cache ``generate`` (compiled on
            CUDA; see :func:`static_generate_kwargs`).
        draft_budgets: ragspec runs once per budget (most draft nodes per step), the first
            one being the record's main ragspec run; empty: once, at the engine's own.
        warmup: run every method once on the first prompt (16 tokens) before timing; a
            static-cache baseline that fails there (its compilation) is dropped with a
            warning instead of ending the run.
        temperature: with ``temperature > 0`` the baselines sample (``do_sample=True``) and
            identity is not checked (it cannot hold sample by sample); only speed and
            acceptance are compared.
        seed: ragspec's seed for prompt i is ``seed + i`` (sampling only).
        progress: called as ``progress(i, record)`` after each prompt.
        keep_steps: keep ragspec's per-step stats in the records.
        documents_for: ``row -> list[str]`` documents handed to ragspec's drafter.
        compare: :class:`ragspec.bench.compare.PlainRunner` s (``--compare``), greedy only: each
            is prepared (loaded) once before timing and runs every prompt interleaved with
            the other methods; ragspec's per-step figures are then recorded for its
            plain-step time.
        variants: other engines over the same model (name -> :class:`ragspec.Engine`, e.g.
            another drafting mode, :func:`ragspec.loading.with_drafting`), each run as one
            more interleaved method at the engine's own budget (``rec.variants``).

    Returns:
        one BenchRecord per prompt (times in seconds).
    """

    model = engine.model
    device = engine.target.device
    eos = engine.eos_token_ids
    records = []
    sampling = temperature > 0
    rows = list(rows)
    encoded = [engine.encode_prompt(row["turns"][0], chat=True) for row in rows]
    gen_kw = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if sampling else dict(do_sample=False)
    static_kw = (
        static_generate_kwargs(max((len(ids) for ids in encoded), default=0) + max_new_tokens)
        if static_baseline
        else {}
    )
    runners = {f"compare:{r.name}": r for r in compare}
    if runners and sampling:
        raise ConfigError("--compare times plain greedy decoding; use --temperature 0")
    for r in runners.values():
        r.prepare(max((len(ids) for ids in encoded), default=0) + max_new_tokens)
    budgets = [int(b) for b in draft_budgets] or [engine.policy.max_draft_tokens]
    engines = {}
    for b in budgets:
        if b == engine.policy.max_draft_tokens:
            engines[b] = engine
        else:
            # the same model, drafter and latency model; only the budget differs
            engines[b] = engine.with_drafter(
                engine.drafter, policy=dataclasses.replace(engine.policy, max_draft_tokens=b)
            )

    def run(name: str, i: int, ids: list[int], docs, new_tokens: int):
        if name == "baseline":
            return timed_call(device, lambda: hf_generate(model, ids, new_tokens, eos, **gen_kw))
        if name == "static":
            return timed_call(device, lambda: hf_generate(model, ids, new_tokens, eos, **static_kw, **gen_kw))
        if name == "hf_pld":
            return timed_call(
                device, lambda: hf_generate(model, ids, new_tokens, eos, prompt_lookup_num_tokens=10, **gen_kw)
            )
        if name in runners:
            return timed_call(device, lambda: runners[name].generate(ids, new_tokens, eos))
        eng = others[name] if name in others else engines[int(name.split("@")[1])]
        return timed_call(
            device,
            lambda: eng.generate(
                ids,
                max_new_tokens=new_tokens,
                chat=False,
                temperature=temperature,
                seed=seed + i,
                return_steps=keep_steps or bool(runners),
                draft_documents=docs,
            ),
        )

    methods = ["baseline"] + (["static"] if static_baseline else []) + (["hf_pld"] if hf_pld else [])
    others = {f"ragspec:{n}": e for n, e in (variants or {}).items()}
    methods += [f"ragspec@{b}" for b in budgets] + list(others) + list(runners)
    if warmup and rows:
        docs = documents_for(rows[0]) if documents_for else None
        for name in list(methods):
            try:
                _, s = run(name, 0, encoded[0], docs, min(16, max_new_tokens))
            except Exception as e:  # torch.compile raises many types; the other methods still run
                if name != "static":
                    raise
                logger.warning(
                    "static-cache generate failed in its warm-up (%s: %s); timing without it", type(e).__name__, e
                )
                methods.remove(name)
                continue
            logger.info("warm-up of %s: %.2f s", name, s)
    for i, (row, ids) in enumerate(zip(rows, encoded)):
        docs = documents_for(row) if documents_for else None
        # alternate the order so that neither side always runs on a warm cache
        order = methods if i % 2 == 0 else methods[::-1]
        results = {name: run(name, i, ids, docs, max_new_tokens) for name in order}
        base_toks, base_s = results["baseline"]
        out, rs_s = results[f"ragspec@{budgets[0]}"]
        rec = make_record(row, ids, base_toks, base_s, out, sampling=sampling, keep_steps=keep_steps)
        rec.ragspec_s = rs_s
        rec.max_draft_tokens = budgets[0]
        if "hf_pld" in results:
            pld_toks, pld_s = results["hf_pld"]
            rec.hf_pld_s, rec.hf_pld_tokens = pld_s, len(pld_toks)
            rec.hf_pld_identical = (pld_toks == base_toks) if not sampling else None
        if "static" in results:
            st_toks, st_s = results["static"]
            rec.static_s, rec.static_tokens = st_s, len(st_toks)
            rec.static_identical = (st_toks == base_toks) if not sampling else None
        for key, r in runners.items():
            run_, run_s = results[key]
            rec.compare[r.name] = compare_entry(run_, run_s, base_toks)
        for b in budgets[1:]:
            o, o_s = results[f"ragspec@{b}"]
            rec.more_budgets[str(b)] = _other_run(o, o_s, base_toks, sampling)
        for key in others:
            o, o_s = results[key]
            rec.variants[key.split(":", 1)[1]] = _other_run(o, o_s, base_toks, sampling)
        for key in others:
            # a variant "X@0" is X's engine with drafting off: X's speculative output
            # against its own plain decoding (the property of --numerics fast)
            name = key.split(":", 1)[1]
            if name.endswith("@0") and name[:-2] in rec.variants:
                rec.variants[name[:-2]]["plain_identical"] = (
                    results[f"ragspec:{name[:-2]}"][0].token_ids == results[key][0].token_ids
                )
        if not rec.identical and not sampling:
            if engine.target.numerics == "fast":
                logger.info(
                    "question %s: --numerics fast differs from transformers greedy at token %d (its int8 "
                    "activations round differently; expected)",
                    rec.question_id,
                    rec.first_diff,
                )
            else:
                logger.warning(
                    "question %s: ragspec differs from greedy at token %d (a float tie between near-equal logits "
                    "can flip one argmax when a step verifies several tokens at once)",
                    rec.question_id,
                    rec.first_diff,
                )
        records.append(rec)
        if progress:
            progress(i, rec)
    return records


def _other_run(out, seconds: float, base_toks: Sequence[int], sampling: bool) -> dict:
    """One more ragspec run of a prompt (another budget, another engine) against the
    baseline's tokens."""
    return {
        "s": seconds,
        "tokens": len(out.token_ids),
        "identical": (out.token_ids == base_toks) if not sampling else False,
        "first_diff": first_diff(out.token_ids, base_toks) if not sampling else -1,
        "mean_accepted": out.stats.mean_accepted_tokens,
        "forward_passes": out.stats.num_forward_passes,
        "draft_s": out.stats.draft_s,
    }


def _summarize_runs(runs: Sequence[dict], base_tps: float) -> dict:
    """tok/s, speedup, mean accepted tokens per step and identity of ``_other_run`` s."""
    tps = sum(m["tokens"] for m in runs) / max(1e-9, sum(m["s"] for m in runs))
    steps = sum(m["forward_passes"] - 1 for m in runs)
    out = {
        "tok_s": tps,
        "speedup": tps / base_tps if base_tps else 0.0,
        "mean_accepted": sum(m["tokens"] - 1 for m in runs) / max(1, steps),
        "identical": sum(bool(m["identical"]) for m in runs),
        "first_diffs": sorted(m["first_diff"] for m in runs if not m["identical"] and m["first_diff"] >= 0),
    }
    if any("plain_identical" in m for m in runs):
        # speculative output equal to the same engine's plain decoding (variant "X@0")
        out["plain_identical"] = sum(bool(m.get("plain_identical")) for m in runs)
    return out


def static_compiled(model) -> bool:
    """Whether transformers compiled ``model``'s decoding step for static-cache
    ``generate`` (it does on CUDA, not on CPU)."""
    return getattr(model, "_compiled_call", None) is not None


def summarize(records: Sequence[BenchRecord]) -> dict:
    """Per category group: tokens/s of each method (total tokens / total seconds), speedup,
    mean accepted tokens, identity."""
    groups: dict[str, list[BenchRecord]] = {}
    for r in records:
        groups.setdefault(category_group(r.category), []).append(r)
    groups["all"] = list(records)
    table: dict[str, dict[str, Any]] = {}
    for g, rs in groups.items():
        if not rs:
            continue
        base_tps = sum(r.baseline_tokens for r in rs) / max(1e-9, sum(r.baseline_s for r in rs))
        rs_tps = sum(r.ragspec_tokens for r in rs) / max(1e-9, sum(r.ragspec_s for r in rs))
        # (seconds and tokens are set together: `or 0` only narrows their Optional types)
        pld = [r for r in rs if r.hf_pld_s is not None]
        pld_tps = (
            sum(r.hf_pld_tokens or 0 for r in pld) / max(1e-9, sum(r.hf_pld_s or 0.0 for r in pld)) if pld else None
        )
        steps = sum(r.forward_passes - 1 for r in rs)
        table[g] = {
            "prompts": len(rs),
            "baseline_tok_s": base_tps,
            "hf_pld_tok_s": pld_tps,
            "ragspec_tok_s": rs_tps,
            "speedup": rs_tps / base_tps if base_tps else 0.0,
            "hf_pld_speedup": (pld_tps / base_tps) if (pld_tps and base_tps) else None,
            "mean_accepted": sum(r.ragspec_tokens - 1 for r in rs) / max(1, steps),
            "acceptance_rate": sum(r.accepted for r in rs) / max(1, sum(r.drafted for r in rs)),
            "identical": sum(r.identical for r in rs),
            "speedup_median": statistics.median(
                (r.ragspec_tokens / r.ragspec_s) / (r.baseline_tokens / r.baseline_s) for r in rs
            ),
            "draft_s": sum(r.draft_s for r in rs),
            "verify_s": sum(r.verify_s for r in rs),
            "prefill_s": sum(r.prefill_s for r in rs),
            "identical_share": sum(r.identical for r in rs) / len(rs),
            # index of the first token that differs from the baseline, per differing output
            "first_diffs": sorted(r.first_diff for r in rs if not r.identical and r.first_diff >= 0),
            "max_draft_tokens": rs[0].max_draft_tokens,
        }
        static = [r for r in rs if r.static_s is not None]
        if static:
            st_tps = sum(r.static_tokens or 0 for r in static) / max(1e-9, sum(r.static_s or 0.0 for r in static))
            table[g]["static_tok_s"] = st_tps
            table[g]["static_speedup"] = st_tps / base_tps if base_tps else None
            table[g]["static_identical"] = sum(bool(r.static_identical) for r in static)
        budgets = sorted({b for r in rs for b in r.more_budgets}, key=int)
        for b in budgets:
            table[g][f"ragspec@{b}"] = _summarize_runs([r.more_budgets[b] for r in rs if b in r.more_budgets], base_tps)
        for name in dict.fromkeys(n for r in rs for n in r.variants):
            table[g][f"ragspec:{name}"] = _summarize_runs(
                [r.variants[name] for r in rs if name in r.variants], base_tps
            )
        if any(r.compare for r in rs):
            table[g]["compare"] = summarize_compare(rs)
    return table


def format_table(table: dict, sampling: bool = False) -> str:
    """The summary as a text table: one row per category group; a ``static tok/s``
    column when the static-cache baseline ran, one ``ragspec@B`` column per extra draft
    budget; identity as ``identical/prompts`` and the earliest first divergence."""
    any_row: dict[str, Any] = next(iter(table.values()), {})
    static = "static_tok_s" in any_row
    budgets = [k for k in any_row if k.startswith("ragspec@")]
    variants = [k for k in any_row if k.startswith("ragspec:")]
    main = f"ragspec@{any_row.get('max_draft_tokens')}" if budgets and any_row.get("max_draft_tokens") else "ragspec"
    head = f"{'category':<15}{'n':>4}{'base tok/s':>12}"
    if static:
        head += f"{'static tok/s':>14}"
    head += f"{'hf-pld tok/s':>14}{main + ' tok/s':>{max(15, len(main) + 7)}}{'speedup':>9}"
    for b in budgets:
        head += f"{b + ' tok/s':>{len(b) + 7}}"
    head += f"{'accepted':>10}{'acc.rate':>10}{'identical':>14}"
    for v in variants:
        head += f"{v + ' tok/s':>{len(v) + 7}}{'accepted':>10}{'identical':>14}"
    lines = [head, "-" * len(head)]
    for g, t in table.items():
        pld = f"{t['hf_pld_tok_s']:.1f}" if t["hf_pld_tok_s"] else "-"
        ident = "n/a" if sampling else format_identity(t["identical"], t["prompts"], t.get("first_diffs", ()))
        line = f"{g:<15}{t['prompts']:>4}{t['baseline_tok_s']:>12.1f}"
        if static:
            line += f"{t.get('static_tok_s') or 0.0:>14.1f}"
        line += f"{pld:>14}{t['ragspec_tok_s']:>{max(15, len(main) + 7)}.1f}{t['speedup']:>8.2f}x"
        for b in budgets:
            line += f"{t[b]['tok_s'] if b in t else 0.0:>{len(b) + 7}.1f}"
        line += f"{t['mean_accepted']:>10.2f}{t['acceptance_rate']:>10.2f}{ident:>14}"
        for v in variants:
            m = t.get(v)
            if m is None:
                line += f"{'-':>{len(v) + 7}}{'-':>10}{'-':>14}"
                continue
            v_ident = "n/a" if sampling else format_identity(m["identical"], t["prompts"], m["first_diffs"])
            line += f"{m['tok_s']:>{len(v) + 7}.1f}{m['mean_accepted']:>10.2f}{v_ident:>14}"
        lines.append(line)
    for v in variants:
        checked = [(g, t[v]) for g, t in table.items() if g != "all" and "plain_identical" in t.get(v, {})]
        if checked:
            ok = sum(m["plain_identical"] for _, m in checked)
            n = sum(table[g]["prompts"] for g, _ in checked)
            lines.append(f"{v}: speculative output == its own plain decoding ({v}@0) on {ok}/{n} prompts")
    more = format_compare_table(table)
    return "\n".join(lines) + (f"\n\n{more}" if more else "")


def profile_attention(fn) -> dict:
    """Which attention kernels ``fn()`` runs, from torch's profiler.

    Returns:
        ``{"ops": {name: calls}, "device_kernels": n}``: the scaled-dot-product / flex
        attention operators called (``aten::_scaled_dot_product_efficient_attention``,
        ``..._flash_attention``, ``..._cudnn_attention``, ``..._attention_math`` (PyTorch's
        unfused fallback), ``..._flash_attention_for_cpu``, flex attention), and how many
        device (CUDA) kernels ran in all (0 on CPU): at batch 1 a small model's step is
        bound by these launches.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    ops: dict[str, int] = {}
    kernels = 0
    for evt in prof.events():
        name = evt.name
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kernels += 1
            continue
        if (
            name.startswith("aten::_scaled_dot_product")
            or name.startswith("aten::_flash_attention")
            or name.startswith("aten::_efficient_attention")
            or "flex_attention" in name
        ):
            ops[name] = ops.get(name, 0) + 1
    return {"ops": dict(sorted(ops.items())), "device_kernels": kernels}


def plot(table: dict, records: Sequence[BenchRecord], path: str | Path) -> None:
    """Speedup per category and the accepted-length histogram, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - optional dependency
        raise ConfigError("--plot needs matplotlib: pip install 'ragspec[plot]'") from e
    cats = [c for c in table if c != "all"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.bar(cats, [table[c]["speedup"] for c in cats], color="tab:blue")
    a.axhline(1.0, color="k", lw=0.8)
    a.set_ylabel("speedup vs model.generate greedy")
    a.set_title("ragspec speedup per category")
    a.tick_params(axis="x", rotation=30)
    hist: dict[int, int] = {}
    for r in records:
        for k, v in r.accepted_histogram.items():
            hist[int(k)] = hist.get(int(k), 0) + v
    ks = sorted(hist)
    b.bar(ks, [hist[k] for k in ks], color="tab:green")
    b.set_xlabel("accepted draft tokens per step")
    b.set_ylabel("steps")
    b.set_yscale("log")
    b.set_title("accepted-length histogram")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
