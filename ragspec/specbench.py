"""Spec-Bench data: reading its JSONL rows and grouping its categories.

Used by the benchmarks (:mod:`ragspec.bench`), ``ragspec summarize --specbench`` and the
EAGLE trainer's hold-out split (:mod:`ragspec.training`): the data's format, on the
house's lowest floor, so that none of them borrows it from another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from .errors import ConfigError
from .jsonl import iter_jsonl

__all__ = ["DEFAULT_DATA", "MT_BENCH_CATEGORIES", "load_prompts", "category_group"]

#: the Spec-Bench dev prompts, beside a checkout (``ragspec bench --data``'s default)
DEFAULT_DATA = "../shared/data/specbench-dev.jsonl"

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def load_prompts(
    path: str | Path, categories: Optional[Sequence[str]] = None, limit: Optional[int] = None, *, required: bool = False
) -> list[dict]:
    """Rows of a Spec-Bench JSONL file (``question_id``, ``category``, ``turns``).

    ``categories`` may name "mt_bench" for the eight MT-bench categories. ``limit`` is per
    category (in file order).

    Raises:
        ConfigError: the file is missing, not UTF-8 text, a line is not valid JSON or not a
            row with ``turns``; with ``required``, no row selected (the message names the
            file and the categories it has).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"benchmark data not found: {p}")
    wanted: Optional[set[str]] = None
    if categories:
        wanted = set()
        for c in categories:
            wanted.update(MT_BENCH_CATEGORIES if c == "mt_bench" else (c,))
    rows: list[dict] = []
    per_cat: dict[str, int] = {}
    seen: dict[str, int] = {}
    for i, row in iter_jsonl(p):
        if not isinstance(row, dict) or not isinstance(row.get("turns"), list) or not row["turns"]:
            raise ConfigError(f"{p}:{i}: not a Spec-Bench row (a JSON object with a non-empty list 'turns')")
        cat = str(row.get("category", ""))
        seen[cat] = seen.get(cat, 0) + 1
        if wanted is not None and cat not in wanted:
            continue
        group = "mt_bench" if cat in MT_BENCH_CATEGORIES else cat
        if limit is not None and per_cat.get(group, 0) >= limit:
            continue
        per_cat[group] = per_cat.get(group, 0) + 1
        rows.append(row)
    if required and not rows:
        if not seen:
            raise ConfigError(f"no prompts selected: {p} has no rows")
        have = ", ".join(sorted(c or "''" for c in seen))
        raise ConfigError(
            f"no prompts selected: {p} has no rows of {', '.join(sorted(wanted or ()))} (its categories: {have})"
        )
    return rows


def category_group(category: str) -> str:
    """The group a category is summarised in: the eight MT-bench categories are one group,
    ``"mt_bench"``; every other category is its own."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category
