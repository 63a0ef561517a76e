"""Other decoders timed beside ragspec by ``ragspec bench --compare NAME``.

A comparison runner decodes greedily from the very token ids the bench gives ragspec and
the transformers baseline (the chat template applied by ragspec's tokenizer), on the same
model file and thread count, and says how long its prefill and its decode took. The bench
runs it interleaved with its other methods, prompt by prompt, and reports per category:
its tokens/s end to end, its prefill seconds, its decode-only tokens/s and milliseconds per
token, its first divergence from transformers greedy, ragspec's end-to-end ratio to it and
ragspec's own plain-step time per token beside its decode time per token.

Runners (``COMPARATORS``):

- ``llamacpp``: llama-cpp-python's plain greedy decoding on the model's GGUF
  (:class:`ragspec.bench.compare.llamacpp.LlamaCppRunner`; the ``ragspec[compare]`` extra).

The interface (:class:`PlainRunner`) is small so that tests can stand in a fake runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from ...errors import ConfigError
from ..records import BenchRecord, first_diff, format_identity
from .base import PlainRun, PlainRunner

__all__ = [
    "COMPARATORS",
    "PlainRun",
    "PlainRunner",
    "require",
    "open_runner",
    "compare_entry",
    "summarize_compare",
    "format_compare_table",
    "runner_settings",
]

COMPARATORS = ("llamacpp",)


def require(name: str) -> None:
    """Check, before any model is loaded, that runner ``name`` can be built.

    Raises:
        ConfigError: unknown name.
        MissingDependencyError: its package is not installed (the message names the extra).
    """
    if name not in COMPARATORS:
        raise ConfigError(f"unknown --compare {name!r}; choose from {', '.join(COMPARATORS)}")
    if name == "llamacpp":
        from .llamacpp import import_llama_cpp

        import_llama_cpp()


def open_runner(name: str, *, gguf: Optional[Path], threads: int, **options) -> PlainRunner:
    """The comparison runner ``name`` on the model file ``gguf`` with ``threads`` threads
    (options go to its constructor). Nothing is loaded until ``prepare``.

    Raises:
        ConfigError: unknown name; no GGUF file (a Hugging Face folder model); threads < 1.
        MissingDependencyError: its package is not installed.
    """
    require(name)
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    if gguf is None:
        raise ConfigError(f"--compare {name} needs a GGUF model (the same file for both); this model is a folder")
    from .llamacpp import LlamaCppRunner

    return LlamaCppRunner(gguf, threads=threads, **options)


def compare_entry(run: PlainRun, wall_s: float, baseline_tokens: Sequence[int]) -> dict:
    """One prompt's figures of a runner for ``BenchRecord.compare``: ``s`` (wall seconds of
    the call, timed as the bench times every method), ``tokens``, ``prefill_s``,
    ``decode_s``, ``identical`` (to transformers greedy) and ``first_diff`` (the first
    differing token index, -1 when identical)."""
    tokens = list(run.tokens)
    return {
        "s": wall_s,
        "tokens": len(tokens),
        "prefill_s": run.prefill_s,
        "decode_s": run.decode_s,
        "identical": tokens == list(baseline_tokens),
        "first_diff": first_diff(tokens, baseline_tokens),
        "token_ids": tokens,
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def summarize_compare(records: Sequence[BenchRecord]) -> dict:
    """Per runner, over ``records`` (one category group): runner name -> figures.

    Figures: ``prompts``; ``tok_s`` (total tokens / total wall seconds); ``prefill_s`` (mean
    per prompt); ``decode_tok_s`` and ``decode_ms_per_token`` (the steps after the prefill);
    ``identical`` (outputs equal to transformers greedy) and ``first_diffs``; ragspec's
    ``ragspec_tok_s``, ``ragspec_prefill_s`` (mean), ``ragspec_decode_tok_s`` (tokens after
    the first over the time after the prefill, drafted steps included) and
    ``ragspec_plain_step_ms`` (mean forward time of its steps that verified no draft; None
    when the records hold no step figures); ``ratio`` (ragspec_tok_s / tok_s) and
    ``decode_ratio`` (ragspec_decode_tok_s / decode_tok_s).
    """
    names = sorted({n for r in records for n in r.compare})
    out = {}
    for name in names:
        rs = [r for r in records if name in r.compare]
        es = [r.compare[name] for r in rs]
        tok_s = sum(e["tokens"] for e in es) / max(1e-9, sum(e["s"] for e in es))
        dec_tokens = sum(max(0, e["tokens"] - 1) for e in es)
        dec_s = sum(e["decode_s"] for e in es)
        rs_tok_s = sum(r.ragspec_tokens for r in rs) / max(1e-9, sum(r.ragspec_s for r in rs))
        rs_dec_tokens = sum(max(0, r.ragspec_tokens - 1) for r in rs)
        rs_dec_s = sum(max(0.0, r.ragspec_s - r.prefill_s) for r in rs)
        plain_steps = sum(r.plain_steps for r in rs)
        entry = {
            "prompts": len(rs),
            "tok_s": tok_s,
            "prefill_s": sum(e["prefill_s"] for e in es) / len(es),
            "decode_tok_s": dec_tokens / dec_s if dec_s > 0 else None,
            "decode_ms_per_token": 1e3 * dec_s / dec_tokens if dec_tokens else None,
            "identical": sum(bool(e["identical"]) for e in es),
            "first_diffs": sorted(e["first_diff"] for e in es if not e["identical"] and e["first_diff"] >= 0),
            "ragspec_tok_s": rs_tok_s,
            "ragspec_prefill_s": sum(r.prefill_s for r in rs) / len(rs),
            "ragspec_decode_tok_s": rs_dec_tokens / rs_dec_s if rs_dec_s > 0 else None,
            "ragspec_plain_step_ms": 1e3 * sum(r.plain_step_s for r in rs) / plain_steps if plain_steps else None,
        }
        entry["ratio"] = _ratio(rs_tok_s, tok_s)
        entry["decode_ratio"] = _ratio(entry["ragspec_decode_tok_s"], entry["decode_tok_s"])
        # the other ragspec engines of the run (--also-numerics, --also-drafting) against
        # the same runner: variant -> tok/s ratio
        variants = sorted({v for r in rs for v in r.variants})
        entry["variant_ratios"] = {
            v: _ratio(
                sum(r.variants[v]["tokens"] for r in rs if v in r.variants)
                / max(1e-9, sum(r.variants[v]["s"] for r in rs if v in r.variants)),
                tok_s,
            )
            for v in variants
        }
        out[name] = entry
    return out


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_compare_table(table: dict) -> str:
    """The comparison block of the bench's text table: per runner, one row per category
    group with the runner's tok/s, ragspec's tok/s, their ratio, both prefill seconds (mean
    per prompt), both decode-only tok/s, the runner's decode ms/token next to ragspec's
    plain-step ms/token, and the runner's identity to transformers greedy
    (``identical/prompts @first divergence``). Empty when no runner ran."""
    names = sorted({n for t in table.values() for n in t.get("compare", {})})
    blocks = []
    for name in names:
        cols = [
            ("category", 15, "<"),
            ("n", 4, ">"),
            (f"{name} tok/s", 0, ">"),
            ("ragspec tok/s", 0, ">"),
            (f"ragspec/{name}", 0, ">"),
            (f"{name} prefill s", 0, ">"),
            ("ragspec prefill s", 0, ">"),
            (f"{name} dec tok/s", 0, ">"),
            ("ragspec dec tok/s", 0, ">"),
            (f"{name} ms/tok", 0, ">"),
            ("ragspec plain ms/tok", 0, ">"),
            (f"{name} vs greedy", 0, ">"),
        ]
        widths = [w or len(h) + 2 for h, w, _ in cols]
        head = "".join(f"{h:{a}{w}}" for (h, _, a), w in zip(cols, widths))
        lines = [f"# {name}: plain greedy on the same GGUF, token ids and threads", head, "-" * len(head)]
        for g, t in table.items():
            c = t.get("compare", {}).get(name)
            if c is None:
                continue
            cells = [
                g,
                str(c["prompts"]),
                _num(c["tok_s"], ".1f"),
                _num(c["ragspec_tok_s"], ".1f"),
                _num(c["ratio"], ".2f") + ("x" if c["ratio"] is not None else ""),
                _num(c["prefill_s"], ".3f"),
                _num(c["ragspec_prefill_s"], ".3f"),
                _num(c["decode_tok_s"], ".1f"),
                _num(c["ragspec_decode_tok_s"], ".1f"),
                _num(c["decode_ms_per_token"], ".2f"),
                _num(c["ragspec_plain_step_ms"], ".2f"),
                format_identity(c["identical"], c["prompts"], c["first_diffs"]),
            ]
            lines.append("".join(f"{x:{a}{w}}" for x, (_, _, a), w in zip(cells, cols, widths)))
        ratios = [
            (g, t["compare"][name].get("variant_ratios") or {})
            for g, t in table.items()
            if name in t.get("compare", {})
        ]
        for v in sorted({v for _, r in ratios for v in r}):
            lines.append(
                f"ragspec:{v}/{name}: " + ", ".join(f"{g} {_num(r.get(v), '.2f')}x" for g, r in ratios if v in r)
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def runner_settings(runners: Sequence[PlainRunner]) -> dict:
    """``{name: runner.info()}`` for the bench's JSON settings."""
    return {r.name: dict(r.info()) for r in runners}
