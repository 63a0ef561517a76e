"""Does a datastore built from *other* prompts of the same category raise the accepted length?

For each category group (default: rag, summarization, mt_bench) of the Spec-Bench dev data:
the first ``--limit`` prompts are benchmarked; every other prompt of the group (all turns)
goes into a datastore (``ragspec.datastore.build_datastore``, the model's tokenizer). Each
benchmarked prompt then runs, in one process and alternating order:

* plain ``model.generate`` greedy (the baseline),
* ragspec with prompt lookup only,
* ragspec with prompt lookup + that datastore (longest suffix match wins per step).

Both ragspec runs are checked token for token against the baseline. Usage::

    python scripts/bench_datastore_categories.py --limit 6 --json docs/bench/datastore-categories.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ragspec.bench.runner import hf_generate
from ragspec.datastore import Datastore, build_datastore
from ragspec.loading import engine_over, load_engine
from ragspec.specbench import category_group, load_prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--data", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/specbench-dev.jsonl")
    )
    ap.add_argument("--categories", default="rag,summarization,mt_bench")
    ap.add_argument("--limit", type=int, default=6, help="benchmarked prompts per group")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    groups = [c.strip() for c in args.categories.split(",") if c.strip()]
    rows_all = load_prompts(args.data, groups)
    pld_only = load_engine(args.model, eagle=None)  # retrieval drafters only: prompt lookup
    base = pld_only
    eos = base.eos_token_ids
    records, stores = [], {}
    with tempfile.TemporaryDirectory() as work:
        for group in groups:
            rows = [r for r in rows_all if category_group(r["category"]) == group]
            bench_rows, others = rows[: args.limit], rows[args.limit :]
            corpus = Path(work) / f"{group}.jsonl"
            with corpus.open("w", encoding="utf-8") as f:
                for r in others:
                    for turn in r["turns"]:
                        f.write(json.dumps({"text": turn}) + "\n")
            info = build_datastore([corpus], Path(work) / group, base.tokenizer, progress=False)
            stores[group] = {"prompts": len(others), "documents": info.num_documents, "tokens": info.num_tokens}
            ds = Datastore.open(Path(work) / group, tokenizer=base.tokenizer, warm=True)
            with_ds = engine_over(base, {group: ds})  # prompt lookup, then the datastore
            for i, row in enumerate(bench_rows):
                ids = base.encode_prompt(row["turns"][0], chat=True)
                res = {}
                order = ["base", "pld", "ds"] if i % 2 == 0 else ["ds", "pld", "base"]
                for name in order:
                    if name == "base":
                        t0 = time.perf_counter()
                        toks = hf_generate(base.model, ids, args.max_new_tokens, eos, do_sample=False)
                        res[name] = (toks, time.perf_counter() - t0, None)
                    else:
                        eng = pld_only if name == "pld" else with_ds
                        out = eng.generate(ids, max_new_tokens=args.max_new_tokens, chat=False)
                        res[name] = (out.token_ids, out.stats.total_s, out.stats)
                btoks, bs, _ = res["base"]
                rec = {
                    "group": group,
                    "question_id": row.get("question_id"),
                    "prompt_tokens": len(ids),
                    "tokens": len(btoks),
                    "base_s": bs,
                }
                for name in ("pld", "ds"):
                    toks, s, st = res[name]
                    rec[name] = {
                        "s": s,
                        "identical": list(toks) == list(btoks),
                        "mean_accepted": st.mean_accepted_tokens,
                        "drafted": st.num_drafted_tokens,
                        "accepted": st.num_accepted_tokens,
                    }
                records.append(rec)
                print(
                    f"  {group:<14} q{rec['question_id']:<4} base {bs:6.2f}s  pld {rec['pld']['s']:6.2f}s "
                    f"({rec['pld']['mean_accepted']:.2f})  +datastore {rec['ds']['s']:6.2f}s "
                    f"({rec['ds']['mean_accepted']:.2f})",
                    file=sys.stderr,
                )
            ds.close()
    table = {}
    for group in groups:
        rs = [r for r in records if r["group"] == group]
        if not rs:
            continue
        base_tps = sum(r["tokens"] for r in rs) / sum(r["base_s"] for r in rs)
        row = {"n": len(rs), "datastore": stores[group], "base_tok_s": base_tps}
        for name in ("pld", "ds"):
            tps = sum(r["tokens"] for r in rs) / sum(r[name]["s"] for r in rs)
            row[name] = {
                "tok_s": tps,
                "speedup": tps / base_tps,
                "mean_accepted": statistics.mean(r[name]["mean_accepted"] for r in rs),
                "identical": sum(r[name]["identical"] for r in rs),
            }
        table[group] = row
    print(
        f"{'group':<15}{'n':>3}{'ds tokens':>10}{'base tok/s':>11}{'PLD':>8}{'acc':>6}{'PLD+ds':>8}{'acc':>6}{'identical':>11}"
    )
    for g, r in table.items():
        print(
            f"{g:<15}{r['n']:>3}{r['datastore']['tokens']:>10}{r['base_tok_s']:>11.1f}{r['pld']['speedup']:>7.2f}x"
            f"{r['pld']['mean_accepted']:>6.2f}{r['ds']['speedup']:>7.2f}x{r['ds']['mean_accepted']:>6.2f}"
            f"{r['pld']['identical'] + r['ds']['identical']:>8}/{2 * r['n']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "summary": table, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
