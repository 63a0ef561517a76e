"""A datastore grown by many small additions against one built at once.

Builds a datastore of the Spec-Bench dev data's rag passages and summarization articles
(``--seed-docs`` of them, the model's tokenizer), then adds ``--additions`` small documents
(chunks of the other texts, ``--docs-per-add`` each) through the writer a server uses
(:class:`ragspec.datastore.live.DatastoreWriter`, its background merging on), timing every
addition. Then, once the merging is done (the cascade's, then the merge a writer makes
when additions pause): a datastore built at once from the same documents,
and the lookup latency of both (``ragspec datastore bench``'s measure: 2000 contexts from
random positions of the corpus, warmed) and the files an open copy holds with every shard
mapped. Prints one table; ``--json`` writes the numbers.

What should hold: the grown datastore's lookup p99 within 1.5x of the fresh one's, and the
last additions costing no more than the first. Usage::

    python scripts/bench_datastore_growth.py --additions 1000 --json growth.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

DEV_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench-dev.jsonl"


def open_files_of(directory: Path) -> int:
    """Files a fresh process holds open for the datastore, every shard mapped."""
    import subprocess

    script = (
        "import os; from ragspec.datastore import Datastore, store; store.MAP_FROM_BYTES = 0; "
        "n = len(os.listdir('/proc/self/fd')); ds = Datastore.open(%r); "
        "print(len(os.listdir('/proc/self/fd')) - n)" % str(directory)
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEV_DATA, help="Spec-Bench dev JSONL (default: %(default)s)")
    ap.add_argument("--model", default=None, help="whose tokenizer (default: the default model)")
    ap.add_argument("--seed-docs", type=int, default=200, help="chunks in the datastore at the start")
    ap.add_argument("--additions", type=int, default=1000)
    ap.add_argument("--docs-per-add", type=int, default=1)
    ap.add_argument("--chunk-chars", type=int, default=400, help="characters per document")
    ap.add_argument("--contexts", type=int, default=2000, help="lookups timed per datastore")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args(argv)
    if not args.data.exists():
        ap.error(f"{args.data} not found: give --data")

    from ragspec.cli.datastore import _corpus_contexts, _load_tokenizer, bench_lookup
    from ragspec.datastore import Datastore, build_datastore
    from ragspec.datastore.live import DatastoreWriter
    from ragspec.errors import DatastoreBusyError

    tokenizer, _ = _load_tokenizer(args.model)
    from soak_server import load_add_texts  # the script beside this one: the same documents it adds

    texts = load_add_texts(args.data, args.chunk_chars)
    need = args.seed_docs + args.additions * args.docs_per_add
    if len(texts) < need:
        texts = (texts * (need // len(texts) + 1))[:need]  # repeated: lookups still see distinct shards
    seed, added = texts[: args.seed_docs], texts[args.seed_docs : need]
    with tempfile.TemporaryDirectory(prefix="ragspec-growth-") as work:
        w = Path(work)
        (w / "seed.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in seed))
        grown_dir = Path(build_datastore([w / "seed.jsonl"], w / "grown", tokenizer, progress=False).path)
        served = {"ds": Datastore.open(grown_dir, tokenizer=tokenizer)}
        writer = DatastoreWriter(served["ds"], tokenizer, lambda ds: served.__setitem__("ds", ds))
        costs, busy = [], 0
        try:
            for i in range(args.additions):
                docs = added[i * args.docs_per_add : (i + 1) * args.docs_per_add]
                t0 = time.perf_counter()
                while True:  # as a client told 503 + Retry-After: wait for the merging, add again
                    try:
                        writer.add(docs, idempotency_key=f"add-{i}")
                        break
                    except DatastoreBusyError:
                        busy += 1
                        time.sleep(0.05)
                costs.append(time.perf_counter() - t0)  # the wait counts: it is what the client sees
        finally:
            writer.close()
        shards_after_adds = served["ds"].num_shards
        # what the background thread had left, then what it does once additions pause
        # (the trailing shards merged: idle_merge_s after the last addition)
        while writer.merge_once(idle=True):
            pass
        grown = served["ds"]
        (w / "all.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in seed + added))
        fresh = Datastore.open(build_datastore([w / "all.jsonl"], w / "fresh", tokenizer, progress=False).path)
        contexts = _corpus_contexts(fresh, args.contexts, fresh.max_match, 0)
        grown.warm()
        fresh.warm()
        res_fresh = bench_lookup(fresh, contexts)
        res_grown = bench_lookup(grown, contexts)
        k = max(1, min(50, len(costs) // 4))
        res = {
            "additions": args.additions,
            "documents": grown.num_documents,
            "tokens": grown.num_tokens,
            "shards_after_adds": shards_after_adds,
            "grown_shards": grown.num_shards,
            "merges": writer.merges,
            "busy_retries": busy,
            "add_first_mean_s": statistics.mean(costs[:k]),
            "add_last_mean_s": statistics.mean(costs[-k:]),
            "add_p50_s": statistics.median(costs),
            "add_max_s": max(costs),
            "lookup_fresh": res_fresh,
            "lookup_grown": res_grown,
            "p99_ratio": res_grown["lookup_p99_s"] / res_fresh["lookup_p99_s"],
            "open_files_grown": open_files_of(grown_dir),
            "same_documents": grown.num_documents == fresh.num_documents and grown.num_tokens == fresh.num_tokens,
        }
    print(
        f"{res['additions']} additions -> {res['documents']:,} documents, {res['tokens']:,} tokens in "
        f"{res['grown_shards']} shards once idle ({shards_after_adds} right after the last addition; {res['merges']} merges, {busy} busy retries); same documents as the fresh build: "
        f"{res['same_documents']}"
    )
    print(
        f"addition: first {k} mean {res['add_first_mean_s'] * 1e3:.1f} ms, last {k} mean "
        f"{res['add_last_mean_s'] * 1e3:.1f} ms, p50 {res['add_p50_s'] * 1e3:.1f} ms, max {res['add_max_s'] * 1e3:.1f} ms"
    )
    for name, r in (("fresh", res_fresh), ("grown", res_grown)):
        print(f"lookup {name}: p50 {r['lookup_p50_s'] * 1e6:.1f} us, p99 {r['lookup_p99_s'] * 1e6:.1f} us")
    print(f"p99 grown/fresh {res['p99_ratio']:.2f}x (<= 1.5x: {res['p99_ratio'] <= 1.5}); open files, every shard mapped: "
          f"{res['open_files_grown']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
