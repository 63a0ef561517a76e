"""``ragspec bench --processors``: what logprobs and penalties cost a drafting request.

Each prompt is generated greedily, drafts on, with each variant of :data:`VARIANTS` in
turn (the order rotating from prompt to prompt, so drift in the machine's speed spreads
evenly): no processing, ``top_logprobs=5`` (log-probabilities of the verify pass), and
``frequency_penalty=0.5`` (a penalty applied to each verification row on its own path).
Per category: tokens per second of each variant (generated tokens over the request's wall
time, prefill included) and its ratio to no processing, and accepted tokens per step
(committed per decode step, the bonus included) with its ratio: a penalty must not make
drafting stop paying. Logprobs never change the output: their variant's tokens are
checked equal to the unprocessed ones (``identical``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..engine import Engine
from ..specbench import category_group

__all__ = ["VARIANTS", "ProcessorsRecord", "run_processors_bench", "summarize_processors", "format_processors_table"]

VARIANTS: dict[str, dict[str, Any]] = {
    "none": {},
    "top_logprobs=5": {"logprobs": True, "top_logprobs": 5},
    "frequency_penalty=0.5": {"frequency_penalty": 0.5},
}
"""Each variant's request parameters (greedy, drafts on)."""


@dataclass
class ProcessorsRecord:
    """One prompt's runs: per variant, generated tokens, seconds, decode steps, and whether
    its tokens equal the unprocessed run's."""

    category: str
    tokens: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    identical: dict[str, bool] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "steps": self.steps,
            "identical": self.identical,
        }


def run_processors_bench(
    engine: Engine,
    rows: Sequence[dict],
    max_new_tokens: int,
    variants: Optional[dict[str, dict[str, Any]]] = None,
    progress: Optional[Callable[[int, ProcessorsRecord], None]] = None,
) -> list[ProcessorsRecord]:
    """Every prompt of ``rows`` (Spec-Bench rows: their first turn, chat-templated)
    generated with each variant (default :data:`VARIANTS`; the first is the reference),
    greedy, drafts on; ``progress(i, record)`` after each prompt."""
    variants = variants if variants is not None else VARIANTS
    names = list(variants)
    records = []
    for i, row in enumerate(rows):
        prompt = engine.encode_prompt(row["turns"][0], chat=True)
        record = ProcessorsRecord(category=str(row.get("category", "")))
        outputs: dict[str, list[int]] = {}
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            out = engine.generate(prompt, max_new_tokens=max_new_tokens, chat=False, **variants[name])
            outputs[name] = out.token_ids
            record.tokens[name] = out.stats.num_generated_tokens
            record.seconds[name] = out.stats.total_s
            record.steps[name] = out.stats.num_steps
        reference = outputs[names[0]]
        record.identical = {n: outputs[n] == reference for n in names}
        # the variants' order, whatever the run order
        record.tokens = {n: record.tokens[n] for n in names}
        record.seconds = {n: record.seconds[n] for n in names}
        record.steps = {n: record.steps[n] for n in names}
        records.append(record)
        if progress is not None:
            progress(i, record)
    return records


def summarize_processors(records: Sequence[ProcessorsRecord]) -> dict[str, dict[str, dict[str, float]]]:
    """Per category group and overall (``"all"``), per variant: ``tokens_per_s``,
    ``speed_ratio`` (to the first variant), ``accepted_per_step`` (generated tokens after
    the first, per decode step), ``accepted_ratio``, ``identical`` (share of prompts
    whose tokens equal the first variant's), ``prompts``."""
    groups: dict[str, list[ProcessorsRecord]] = {}
    for r in records:
        groups.setdefault(category_group(r.category), []).append(r)
    if records:
        groups["all"] = list(records)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for group, rs in groups.items():
        names = list(rs[0].tokens)
        row: dict[str, dict[str, float]] = {}
        for name in names:
            tokens = sum(r.tokens[name] for r in rs)
            seconds = sum(r.seconds[name] for r in rs)
            steps = sum(r.steps[name] for r in rs)
            decoded = sum(max(0, r.tokens[name] - 1) for r in rs)
            row[name] = {
                "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                "accepted_per_step": decoded / steps if steps else 0.0,
                "identical": sum(r.identical[name] for r in rs) / len(rs),
                "prompts": float(len(rs)),
            }
        base = row[names[0]]
        for name in names:
            v = row[name]
            v["speed_ratio"] = v["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
            v["accepted_ratio"] = (
                v["accepted_per_step"] / base["accepted_per_step"] if base["accepted_per_step"] else 0.0
            )
        table[group] = row
    return table


def format_processors_table(table: dict[str, dict[str, dict[str, float]]]) -> str:
    """The summary as text: one line per category group and variant."""
    lines = [
        f"{'category':<14} {'variant':<22} {'tok/s':>7} {'x none':>7} {'acc/step':>8} {'x none':>7} {'identical':>9}"
    ]
    for group, row in table.items():
        for name, v in row.items():
            lines.append(
                f"{group:<14} {name:<22} {v['tokens_per_s']:7.1f} {v['speed_ratio']:7.2f} "
                f"{v['accepted_per_step']:8.2f} {v['accepted_ratio']:7.2f} {v['identical']:9.0%}"
            )
    lines.append(
        "# x none: the variant over no processing (below 1: slower, or fewer accepted tokens per step); "
        "identical: prompts whose tokens equal no processing's (logprobs must be 100%; a penalty changes the text)"
    )
    return "\n".join(lines)
