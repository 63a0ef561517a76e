"""Does the server's response cache pay? Repeated, reworded and follow-up questions built
from the Spec-Bench dev data.

The response cache (``ragspec.drafters.response_cache``; ``ragspec serve`` keeps one by
default) drafts from the answers the service has already produced. This script builds three
workloads from the dev data and measures, in one process, each workload's *second* request
under three engines over the same model: drafts off (plain decoding), ragspec's default
drafting without a cache, and the same with the response cache after the first request
filled it. The engines share one prefix cache (``--prefix-cache-tokens``, on as in ``ragspec
serve``), restored before each method to its state after the first request: every method's
second request skips the prefill of the prompt chunks the first request stored, none of those
another method's run stored (0: each prefills its whole prompt). Orders alternate per prompt; all outputs are checked token for token against
drafts off.

How the workloads are built (``--categories``, default rag, qa, summarization, and the first
``--limit`` prompts of each):

* ``repeated``: the same first turn asked twice (a second user asks the same question over
  the same documents); the first ask fills the cache.
* ``reworded``: the first turn is asked, then the same turn after a different instruction
  line (``"Please answer the following request.\\n\\n" + turn``): another prompt, often
  much the same answer.
* ``follow_up``: MT-bench rows' second turns (``mt_bench`` rows have two): the first turn is
  answered, then the chat ``[turn 1, answer 1, turn 2]`` (turn 2 typically reworks answer 1,
  which prompt lookup already sees in the chat history: where the cache should add little).

Usage::

    python scripts/bench_response_cache.py --limit 3 --json docs/bench/response-cache.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from ragspec.config import PolicyConfig
from ragspec.drafters.response_cache import ResponseCache
from ragspec.loading import engine_over, load_engine
from ragspec.specbench import category_group, load_prompts

REWORD = "Please answer the following request.\n\n"


def _workload_pairs(rows: list[dict], kind: str) -> list[tuple[str, list, list]]:
    """(category, first request's messages, second request's messages) per row."""
    out = []
    for r in rows:
        first = [{"role": "user", "content": r["turns"][0]}]
        if kind == "repeated":
            out.append((r["category"], first, first))
        elif kind == "reworded":
            out.append((r["category"], first, [{"role": "user", "content": REWORD + r["turns"][0]}]))
        elif len(r["turns"]) > 1:
            out.append((r["category"], first, None))  # follow-up: the second needs answer 1
    return out


def _second_request(engine, engines: dict, order: list[str], ids: list[int], n: int) -> dict[str, dict]:
    """The second request ``ids`` under each engine, in ``order``, each from the prefix
    cache the first request left: per method, its tokens and speeds."""
    res = {}
    prefixes = engine.prefix_cache.snapshot() if engine.prefix_cache is not None else None
    for name in order:
        eng = engines[name]
        if prefixes is not None:
            engine.prefix_cache.restore(prefixes)  # every method from the first request's cache
        out = eng.generate(ids, max_new_tokens=n, chat=False, speculative=name != "off")
        s = out.stats
        decode_s = max(s.total_s - s.prefill_s, 1e-9)
        res[name] = {
            "tokens": out.token_ids,
            "tok_s": len(out.token_ids) / s.total_s,
            "decode_tok_s": max(len(out.token_ids) - 1, 0) / decode_s,
            "mean_accepted": s.mean_accepted_tokens,
            "prefill_s": s.prefill_s,
            "cached_prompt_tokens": s.num_cached_prompt_tokens,
        }
    return res


def _record(kind: str, cat: str, ids: list[int], res: dict[str, dict]) -> dict:
    """One prompt's record: its workload and category, whether every method's tokens are
    drafts-off's, and each method's figures."""
    rec = {
        "workload": kind,
        "category": category_group(cat),
        "prompt_tokens": len(ids),
        "identical": all(res[m]["tokens"] == res["off"]["tokens"] for m in res),
    }
    for m, v in res.items():
        rec.update(
            {f"{m}_{k}": v[k] for k in ("tok_s", "decode_tok_s", "mean_accepted", "prefill_s", "cached_prompt_tokens")}
        )
    return rec


def _summary(records: list[dict], methods: list[str]) -> dict[str, dict]:
    """Per workload: prompts, identical outputs, each method's mean speeds and acceptance,
    and its speedups over drafts off."""
    table = {}
    for kind in ("repeated", "reworded", "follow_up"):
        rs = [r for r in records if r["workload"] == kind]
        if not rs:
            continue
        row = {"prompts": len(rs), "identical": sum(r["identical"] for r in rs)}
        for m in methods:
            row[f"{m}_tok_s"] = statistics.mean(r[f"{m}_tok_s"] for r in rs)
            row[f"{m}_decode_tok_s"] = statistics.mean(r[f"{m}_decode_tok_s"] for r in rs)
            row[f"{m}_mean_accepted"] = statistics.mean(r[f"{m}_mean_accepted"] for r in rs)
        for m in methods[1:]:
            row[f"{m}_speedup"] = row[f"{m}_tok_s"] / row["off_tok_s"]
            row[f"{m}_decode_speedup"] = row[f"{m}_decode_tok_s"] / row["off_decode_tok_s"]
        table[kind] = row
    return table


def _print_summary(table: dict[str, dict], methods: list[str]) -> None:
    """The summary table, and a line per extra draft budget."""
    print(
        f"\n{'workload':<10} {'n':>3} {'off tok/s':>9} {'ragspec':>8} {'cached':>8} {'e2e gain':>17} "
        f"{'decode gain':>17} {'accepted':>13} identical"
    )
    for kind, r in table.items():
        print(
            f"{kind:<10} {r['prompts']:>3} {r['off_tok_s']:>9.1f} {r['ragspec_tok_s']:>8.1f} {r['cached_tok_s']:>8.1f} "
            f"{r['ragspec_speedup']:>7.2f}x -> {r['cached_speedup']:.2f}x {r['ragspec_decode_speedup']:>7.2f}x -> "
            f"{r['cached_decode_speedup']:.2f}x {r['ragspec_mean_accepted']:>5.2f} -> {r['cached_mean_accepted']:.2f} "
            f"{r['identical']}/{r['prompts']}"
        )
    for m in methods[3:]:
        print(
            "# "
            + ", ".join(
                f"{kind} {m} e2e {r[f'{m}_speedup']:.2f}x decode {r[f'{m}_decode_speedup']:.2f}x "
                f"accepted {r[f'{m}_mean_accepted']:.2f}"
                for kind, r in table.items()
            )
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--data", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/specbench-dev.jsonl")
    )
    ap.add_argument("--categories", default="rag,qa,summarization")
    ap.add_argument("--limit", type=int, default=3, help="prompts per category (and MT-bench rows for follow-ups)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=PolicyConfig.prefix_cache_tokens,
        help="the engines' prefix cache (shared: every method's second request finds the first request's "
        "prompt chunks; 0 = off, every method prefills its prompts itself)",
    )
    ap.add_argument(
        "--cached-budgets",
        default="",
        help="comma-separated more draft budgets for the cached engine, e.g. 16,32: one more column each",
    )
    args = ap.parse_args(argv)
    try:
        extra_budgets = [int(x) for x in args.cached_budgets.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--cached-budgets takes comma-separated integers, got {args.cached_budgets!r}")
    if any(b < 1 for b in extra_budgets):
        ap.error(f"--cached-budgets must be >= 1, got {args.cached_budgets!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    groups = [c.strip() for c in args.categories.split(",") if c.strip()]
    rows = load_prompts(args.data, groups, limit=args.limit)
    mt_rows = load_prompts(args.data, ["mt_bench"], limit=args.limit)
    if args.prefix_cache_tokens < 0:
        ap.error(f"--prefix-cache-tokens must be >= 0, got {args.prefix_cache_tokens}")
    engine = load_engine(args.model, policy=PolicyConfig(prefix_cache_tokens=args.prefix_cache_tokens))
    cache = ResponseCache(model=engine.model_name or "")
    cached = engine_over(engine, engine.datastores, cache)
    engines = {"off": engine, "ragspec": engine, "cached": cached}
    for b in extra_budgets:
        # the same model, drafters and cache; only the most draft nodes per step differ
        engines[f"cached@{b}"] = cached.with_drafter(
            cached.drafter, policy=dataclasses.replace(cached.policy, max_draft_tokens=b)
        )
    methods = list(engines)
    n = args.max_new_tokens
    records = []
    for kind in ("repeated", "reworded", "follow_up"):
        pairs = _workload_pairs(mt_rows if kind == "follow_up" else rows, kind)
        for i, (cat, first, second) in enumerate(pairs):
            warm = cached.generate(cached.encode_messages(first), max_new_tokens=n, chat=False)  # fills the cache
            if second is None:
                second = first + [
                    {"role": "assistant", "content": warm.text},
                    {"role": "user", "content": mt_rows[i]["turns"][1]},
                ]
            ids = engine.encode_messages(second)
            order = methods if i % 2 == 0 else methods[::-1]
            rec = _record(kind, cat, ids, _second_request(engine, engines, order, ids, n))
            records.append(rec)
            print(
                f"{kind:<10} {rec['category']:<14} off {rec['off_tok_s']:6.1f}  ragspec {rec['ragspec_tok_s']:6.1f}  "
                f"cached {rec['cached_tok_s']:6.1f} tok/s  accepted {rec['ragspec_mean_accepted']:.2f} -> "
                f"{rec['cached_mean_accepted']:.2f}  {'identical' if rec['identical'] else 'DIFFERENT'}",
                flush=True,
            )
    table = _summary(records, methods)
    _print_summary(table, methods)
    print(f"# response cache: {len(cache)} responses, {cache.num_tokens} tokens, {cache.hits} draft lookups hit")
    if engine.prefix_cache is not None:
        pc = engine.prefix_cache.stats
        print(f"# prefix cache: {pc.hit_tokens} of {pc.queried_tokens} prompt tokens served from it")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": table, "records": records}, indent=1))
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
