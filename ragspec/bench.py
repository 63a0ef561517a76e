"""``ragspec bench``: ragspec against plain transformers decoding on Spec-Bench prompts.

For each prompt, in the same process and in alternating order, it times plain
``model.generate`` greedy (the baseline), transformers' own prompt lookup
(``prompt_lookup_num_tokens=10``) and ragspec, and checks ragspec's tokens against the
baseline. Every later speed claim of the project is made with this.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from .errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["load_prompts", "run_bench", "make_record", "MT_BENCH_CATEGORIES", "BenchRecord"]

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def load_prompts(
    path: str | Path, categories: Optional[Sequence[str]] = None, limit: Optional[int] = None
) -> list[dict]:
    """Rows of a Spec-Bench JSONL file (``question_id``, ``category``, ``turns``).

    ``categories`` may name "mt_bench" for the eight MT-bench categories. ``limit`` is per
    category (in file order).

    Raises:
        ConfigError: the file is missing or a line is not valid JSON.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"benchmark data not found: {p}")
    wanted: Optional[set[str]] = None
    if categories:
        wanted = set()
        for c in categories:
            wanted.update(MT_BENCH_CATEGORIES if c == "mt_bench" else (c,))
    rows, per_cat = [], {}
    with p.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}:{i}: not valid JSON ({e})") from e
            cat = row.get("category", "")
            if wanted is not None and cat not in wanted:
                continue
            group = "mt_bench" if cat in MT_BENCH_CATEGORIES else cat
            if limit is not None and per_cat.get(group, 0) >= limit:
                continue
            per_cat[group] = per_cat.get(group, 0) + 1
            rows.append(row)
    return rows


def category_group(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


@dataclass
class BenchRecord:
    question_id: object
    category: str
    prompt_tokens: int
    baseline_tokens: int
    baseline_s: float
    ragspec_s: float
    ragspec_tokens: int
    identical: bool
    first_diff: int
    mean_accepted: float
    acceptance_rate: float
    drafted: int
    accepted: int
    forward_passes: int
    hf_pld_s: Optional[float] = None
    hf_pld_tokens: Optional[int] = None
    hf_pld_identical: Optional[bool] = None
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    accepted_histogram: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def _hf_generate(model, ids: list[int], max_new_tokens: int, eos: Sequence[int], **kw) -> list[int]:
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
    return BenchRecord(
        question_id=row.get("question_id"),
        category=row.get("category", ""),
        prompt_tokens=len(prompt_ids),
        baseline_tokens=len(baseline_tokens),
        baseline_s=baseline_s,
        ragspec_s=st.total_s,
        ragspec_tokens=len(out.token_ids),
        identical=(out.token_ids == baseline_tokens) if not sampling else False,
        first_diff=_first_diff(out.token_ids, baseline_tokens) if not sampling else -1,
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
    )


def run_bench(
    engine,
    rows: Iterable[dict],
    *,
    max_new_tokens: int = 128,
    hf_pld: bool = True,
    temperature: float = 0.0,
    seed: int = 0,
    progress=None,
    keep_steps: bool = False,
    documents_for=None,
) -> list[BenchRecord]:
    """Run the benchmark over ``rows``; see the module docstring.

    With ``temperature > 0`` the baseline samples (``do_sample=True``) and identity is not
    checked (it cannot hold sample by sample); only speed and acceptance are compared.

    Returns:
        one BenchRecord per prompt (times in seconds).
    """
    model = engine.model
    eos = engine.eos_token_ids
    records = []
    sampling = temperature > 0
    for i, row in enumerate(rows):
        ids = engine.encode_prompt(row["turns"][0], chat=True)
        docs = documents_for(row) if documents_for else None
        gen_kw = (
            dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if sampling else dict(do_sample=False)
        )

        def run_baseline():
            t0 = time.perf_counter()
            toks = _hf_generate(model, ids, max_new_tokens, eos, **gen_kw)
            return toks, time.perf_counter() - t0

        def run_pld():
            t0 = time.perf_counter()
            toks = _hf_generate(model, ids, max_new_tokens, eos, prompt_lookup_num_tokens=10, **gen_kw)
            return toks, time.perf_counter() - t0

        def run_ragspec():
            out = engine.generate(
                ids,
                max_new_tokens=max_new_tokens,
                chat=False,
                temperature=temperature,
                seed=seed + i,
                return_steps=keep_steps,
                documents=docs,
            )
            return out, out.stats.total_s

        # alternate the order so that neither side always runs on a warm cache
        results = {}
        order = ["baseline", "hf_pld", "ragspec"] if i % 2 == 0 else ["ragspec", "hf_pld", "baseline"]
        for name in order:
            if name == "baseline":
                results[name] = run_baseline()
            elif name == "hf_pld" and hf_pld:
                results[name] = run_pld()
            elif name == "ragspec":
                results[name] = run_ragspec()
        base_toks, base_s = results["baseline"]
        out, _ = results["ragspec"]
        rec = make_record(row, ids, base_toks, base_s, out, sampling=sampling, keep_steps=keep_steps)
        if "hf_pld" in results:
            pld_toks, pld_s = results["hf_pld"]
            rec.hf_pld_s, rec.hf_pld_tokens = pld_s, len(pld_toks)
            rec.hf_pld_identical = (pld_toks == base_toks) if not sampling else None
        if not rec.identical and not sampling:
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


def summarize(records: Sequence[BenchRecord]) -> dict:
    """Per category group: tokens/s of each method (total tokens / total seconds), speedup,
    mean accepted tokens, identity."""
    groups: dict[str, list[BenchRecord]] = {}
    for r in records:
        groups.setdefault(category_group(r.category), []).append(r)
    groups["all"] = list(records)
    table = {}
    for g, rs in groups.items():
        if not rs:
            continue
        base_tps = sum(r.baseline_tokens for r in rs) / max(1e-9, sum(r.baseline_s for r in rs))
        rs_tps = sum(r.ragspec_tokens for r in rs) / max(1e-9, sum(r.ragspec_s for r in rs))
        pld = [r for r in rs if r.hf_pld_s is not None]
        pld_tps = sum(r.hf_pld_tokens for r in pld) / max(1e-9, sum(r.hf_pld_s for r in pld)) if pld else None
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
        }
    return table


def format_table(table: dict, sampling: bool = False) -> str:
    head = f"{'category':<15}{'n':>4}{'base tok/s':>12}{'hf-pld tok/s':>14}{'ragspec tok/s':>15}{'speedup':>9}{'accepted':>10}{'acc.rate':>10}{'identical':>11}"
    lines = [head, "-" * len(head)]
    for g, t in table.items():
        pld = f"{t['hf_pld_tok_s']:.1f}" if t["hf_pld_tok_s"] else "-"
        ident = "n/a" if sampling else f"{t['identical']}/{t['prompts']}"
        lines.append(
            f"{g:<15}{t['prompts']:>4}{t['baseline_tok_s']:>12.1f}{pld:>14}{t['ragspec_tok_s']:>15.1f}"
            f"{t['speedup']:>8.2f}x{t['mean_accepted']:>10.2f}{t['acceptance_rate']:>10.2f}{ident:>11}"
        )
    return "\n".join(lines)


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
