"""``ragspec datastore ...``: build, extend, compact, describe, query and benchmark datastores.

:func:`ragspec.cli.build_parser` calls :func:`add_datastore_commands` with its sub-parsers;
each command sets ``func`` and returns an exit status. Errors print one line on stderr and
exit 2. ``python -m ragspec.cli.datastore datastore ...`` runs the group on its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ragspec.errors import ConfigError, RagspecError

logger = logging.getLogger(__name__)

__all__ = ["add_datastore_commands", "main", "bench_lookup"]


def _load_tokenizer(model: Optional[str]) -> tuple[Any, str]:
    """(tokenizer, name to record) for ``--model`` (None = the default model)."""
    from ragspec.models import load_tokenizer, resolve_model

    spec = resolve_model(model)
    name = spec.name if model is None or spec.name == model else str(spec.path)
    return load_tokenizer(spec), name


def _tokenizer_for(directory: str, model: Optional[str]) -> Any:
    """The tokenizer of ``--model``, else the one named in the datastore's manifest."""
    if model is not None:
        return _load_tokenizer(model)[0]
    from ..datastore.format import read_manifest

    name = read_manifest(directory).tokenizer.name
    try:
        return _load_tokenizer(name)[0]
    except RagspecError as e:
        raise RagspecError(f"cannot load the datastore's tokenizer {name!r} ({e}); pass --model") from e


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run a command; typed and I/O errors become a one-line message and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (RagspecError, OSError, ValueError) as e:
            print(f"ragspec datastore: error: {e}", file=sys.stderr)
            return 2

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


_BUILD_TIME = "tokenizing, indexing and writing"
"""What a datastore's recorded build time measures (``DatastoreInfo.build_s``)."""


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _verified(ds: Any) -> dict[str, Any]:
    """What ``Datastore.open(..., verify=True)`` checked of ``ds``: every shard file's sha256
    against the manifest, every token id against the vocabulary."""
    shards = ds.manifest.shards
    return {
        "files": sum(len(entry.files) for entry in shards),
        "shards": len(shards),
        "token_ids": sum(entry.num_tokens for entry in shards),
        "vocab_size": ds.manifest.tokenizer.vocab_size,
    }


def _print_info(info: Any, as_json: bool, verified: Optional[dict[str, Any]] = None) -> None:
    """``verified``: what ``--verify`` checked (:func:`_verified`), None without it."""
    if as_json:
        print(json.dumps({**info.to_dict(), "verified": verified or False}, indent=2))
        return
    rows = [
        ("path", info.path),
        ("format version", info.format_version),
        ("tokenizer", info.tokenizer_name),
        ("tokenizer fingerprint", info.tokenizer_fingerprint),
        ("vocab size", info.vocab_size),
        ("documents", f"{info.num_documents:,}"),
        ("tokens", f"{info.num_tokens:,}"),
        ("shards", info.num_shards),
        ("bytes on disk", f"{_fmt_bytes(info.bytes_on_disk)} ({info.bytes_per_token:.2f} bytes/token)"),
        ("created", info.created),
        ("updated", info.updated),
        ("build time", f"{info.build_s:.1f} s ({_BUILD_TIME}; loading the tokenizer not counted)"),
        ("skipped inputs", f"{info.skipped_files} binary file(s), {info.skipped_lines} malformed JSONL line(s)"),
    ]
    if info.leftovers:
        rows.append(
            (
                "leftovers",
                f"{len(info.leftovers)} from interrupted builds/adds (removed by the next build of "
                f"this directory or add to it): " + ", ".join(info.leftovers),
            )
        )
    if verified is not None:
        rows.append(
            (
                "verified",
                f"ok: the sha256 of {verified['files']} files in {verified['shards']} shard(s) as the manifest "
                f"records them, {verified['token_ids']:,} token ids all below the vocabulary size "
                f"{verified['vocab_size']:,}",
            )
        )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _load_engine(model: Optional[str]) -> tuple[Any, str]:
    """(engine, tokenizer name to record) for ``build --responses``."""
    from ragspec.loading import load_engine
    from ragspec.models import resolve_model

    spec = resolve_model(model)
    name = spec.name if model is None or spec.name == model else str(spec.path)
    return load_engine(model), name


@_guard
def cmd_build(args: argparse.Namespace) -> int:
    from ..datastore.builder import build_datastore
    from ..datastore.format import check_output

    t0 = time.perf_counter()
    check_output(Path(args.output), args.overwrite, option="--overwrite")  # before loading the model
    if args.responses:
        from ..datastore.responses import build_response_datastore, read_prompts

        if "-" in args.inputs:
            raise ConfigError("--responses reads prompt files, not stdin")
        prompts = read_prompts(args.inputs, args.field, args.limit)
        engine, name = _load_engine(args.model)
        print(
            f"generating the target's answers to {len(prompts)} prompts (greedy + {args.samples} sampled each, "
            f"{args.max_new_tokens} tokens at most)",
            file=sys.stderr,
        )
        info = build_response_datastore(
            engine,
            prompts,
            args.output,
            max_new_tokens=args.max_new_tokens,
            samples=args.samples,
            temperature=args.temperature,
            seed=args.seed,
            tokenizer_name=name,
            overwrite=args.overwrite,
            progress=_progress(args),
        )
    else:
        tokenizer, name = _load_tokenizer(args.model)
        info = build_datastore(
            args.inputs,
            args.output,
            tokenizer,
            field=args.field,
            tokenizer_name=name,
            progress=_progress(args),
            overwrite=args.overwrite,
            strict=args.strict,
        )
    dt = time.perf_counter() - t0
    before = "loading the model and generating the answers" if args.responses else "loading the tokenizer"
    print(
        f"built {info.path}: {info.num_documents:,} documents, {info.num_tokens:,} tokens in {dt:.1f} s "
        f"({info.build_s:.1f} s {_BUILD_TIME}, {info.num_tokens / max(info.build_s, 1e-9):,.0f} tokens/s: the "
        f"build time 'datastore info' shows; {max(dt - info.build_s, 0.0):.1f} s {before}), "
        f"{_fmt_bytes(info.bytes_on_disk)} ({info.bytes_per_token:.2f} bytes/token){_skips(info)}"
    )
    return 0


def _skips(info: Any) -> str:
    if not (info.skipped_files or info.skipped_lines):
        return ""
    return (
        f"; skipped {info.skipped_files} binary file(s) and {info.skipped_lines} malformed JSONL line(s) "
        "(--strict fails instead)"
    )


def _progress(args: argparse.Namespace) -> bool:
    """Whether to show progress bars: not with ``--no-progress`` nor ``-q``."""
    return not (args.no_progress or getattr(args, "quiet", False))


def _log_texts(logs: Sequence[str], partition: str, folder: str) -> list[str]:
    """The texts of the response logs' records in ``partition`` ("" = the unsalted ones),
    written as JSONL files in ``folder`` (one per log, named after it), line by line; what
    was left out is reported on stderr."""
    from ragspec.drafters.response_journal import LogSelection, iter_log_texts

    out = []
    for i, log in enumerate(logs):
        sel = LogSelection()
        path = os.path.join(folder, f"{i:03d}-{os.path.basename(log)}")
        with open(path, "w", encoding="utf-8") as f:
            for text in iter_log_texts(log, partition, sel):
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        other = sum(sel.other_partitions.values())
        if other:
            keyed = len([p for p in sel.other_partitions if p])
            what = f"{keyed} tenant partition(s)" + (" and unsalted records" if "" in sel.other_partitions else "")
            print(
                f"{log}: {other} record(s) of {what} left out (--partition DIGEST takes one tenant's: the "
                'digest in its records\' "partition" field)',
                file=sys.stderr,
            )
        if sel.oversized or sel.bad:
            print(f"{log}: {len(sel.oversized) + len(sel.bad)} line(s) skipped (see the warnings)", file=sys.stderr)
        out.append(path)
    return out


@_guard
def cmd_add(args: argparse.Namespace) -> int:
    import tempfile

    from ..datastore.builder import add_to_datastore

    inputs, field = list(args.inputs), args.field
    if args.partition is not None and not args.from_log:
        raise ConfigError("--partition selects the records of --from-log logs: give --from-log LOG")
    if args.from_log and inputs and field != "text":
        raise ConfigError("--from-log reads the logs' 'text' field: give other inputs with --field text, or apart")
    if not inputs and not args.from_log:
        raise ConfigError("nothing to add: give INPUT files or --from-log LOG")
    tokenizer = _tokenizer_for(args.directory, args.model)
    with tempfile.TemporaryDirectory(prefix="ragspec-log-") as work:
        if args.from_log:
            # a response log of `ragspec serve --response-log`: JSON lines, the response in "text";
            # a tenant's answers only when asked for (--partition)
            inputs, field = inputs + _log_texts(args.from_log, args.partition or "", work), "text"
        info = add_to_datastore(
            args.directory, inputs, tokenizer, field=field, progress=_progress(args), strict=args.strict
        )
    print(
        f"added to {info.path}: now {info.num_shards} shards, {info.num_documents:,} documents, "
        f"{info.num_tokens:,} tokens{_skips(info).replace('; skipped', '; skipped in all')}"
    )
    return 0


@_guard
def cmd_compact(args: argparse.Namespace) -> int:
    from ..datastore.shards import compact_datastore
    from ..datastore.store import Datastore

    with Datastore.open(args.directory) as ds:
        before = ds.num_shards
    t0 = time.perf_counter()
    info = compact_datastore(args.directory, progress=_progress(args))
    print(
        f"compacted {info.path}: {before} shards -> {info.num_shards}, {info.num_documents:,} documents, "
        f"{info.num_tokens:,} tokens in {time.perf_counter() - t0:.1f} s"
    )
    return 0


@_guard
def cmd_info(args: argparse.Namespace) -> int:
    from ..datastore.store import Datastore

    with Datastore.open(args.directory, verify=args.verify) as ds:
        _print_info(ds.info(), args.json, _verified(ds) if args.verify else None)
    return 0


@_guard
def cmd_query(args: argparse.Namespace) -> int:
    from ..datastore.store import Datastore

    tokenizer = _tokenizer_for(args.directory, args.model)
    with Datastore.open(args.directory, tokenizer=tokenizer) as ds:
        ids = tokenizer(args.text, add_special_tokens=False)["input_ids"]
        t0 = time.perf_counter()
        conts = ds.continuations(ids, max_len=args.max_len, max_candidates=args.max_candidates)
        lookup_s = time.perf_counter() - t0
    if args.json:
        print(
            json.dumps(
                {
                    "context_tokens": len(ids),
                    "match_len": conts[0].match_len if conts else 0,
                    "lookup_s": lookup_s,
                    "continuations": [
                        {"tokens": list(c.tokens), "text": tokenizer.decode(list(c.tokens)), "count": c.count}
                        for c in conts
                    ],
                },
                indent=2,
                ensure_ascii=False,
            )
        )
        return 0
    if not conts:
        print(f"no match (context of {len(ids)} tokens; shortest suffix searched: {ds.min_match} tokens)")
        return 0
    print(f"matched the last {conts[0].match_len} tokens; {len(conts)} continuation(s) in {lookup_s * 1e3:.2f} ms")
    for c in conts:
        print(f"{c.count:>8}  {tokenizer.decode(list(c.tokens))!r}")
    return 0


def bench_lookup(
    ds: Any,
    contexts: Sequence[Sequence[int]],
    *,
    max_len: int = 10,
    max_candidates: int = 64,
    max_nodes: int = 32,
    warmup: int = 50,
) -> dict[str, Any]:
    """Latency of one drafting step per context: the lookup alone, and lookup + draft tree.

    Returns:
        A dict of p50/p99/mean in seconds for ``lookup_*`` (wall clock), ``lookup_cpu_*``
        (this thread's CPU time) and ``propose_*`` (lookup + tree), the hit rate and the
        mean match length.
    """
    from ragspec.tree import tree_from_candidates

    for ctx in contexts[:warmup]:
        ds.continuations(ctx, max_len=max_len, max_candidates=max_candidates)
    lookup, lookup_cpu, propose, match = [], [], [], []
    for ctx in contexts:
        c0 = time.thread_time()
        t0 = time.perf_counter()
        conts = ds.continuations(ctx, max_len=max_len, max_candidates=max_candidates)
        t1 = time.perf_counter()
        lookup_cpu.append(time.thread_time() - c0)
        if conts:
            tree_from_candidates(
                [c.tokens for c in conts],
                counts=[c.count for c in conts],
                max_nodes=max_nodes,
                source="datastore",
                match_len=conts[0].match_len,
            )
        t2 = time.perf_counter()
        lookup.append(t1 - t0)
        propose.append(t2 - t0)
        match.append(conts[0].match_len if conts else 0)
    lk, pr, m = np.array(lookup), np.array(propose), np.array(match)
    cpu = np.array(lookup_cpu)
    return {
        "num_contexts": len(contexts),
        "lookup_p50_s": float(np.percentile(lk, 50)),
        "lookup_p99_s": float(np.percentile(lk, 99)),
        "lookup_mean_s": float(lk.mean()),
        "lookup_cpu_p50_s": float(np.percentile(cpu, 50)),
        "lookup_cpu_p99_s": float(np.percentile(cpu, 99)),
        "propose_p50_s": float(np.percentile(pr, 50)),
        "propose_p99_s": float(np.percentile(pr, 99)),
        "hit_rate": float((m > 0).mean()),
        "mean_match_len": float(m[m > 0].mean()) if (m > 0).any() else 0.0,
    }


def _corpus_contexts(ds: Any, num: int, length: int, seed: int) -> list[list[int]]:
    """``num`` contexts of up to ``length`` tokens (at least 2) ending at random positions
    inside the corpus's documents (never across a document start)."""
    rng = np.random.default_rng(seed)
    sizes = np.array([ds.shard_documents(s)[-1] for s in range(ds.num_shards)], dtype=np.float64)
    out: list[list[int]] = []
    for s in rng.choice(ds.num_shards, size=num, p=sizes / sizes.sum()).tolist():
        toks, docs = ds.shard_tokens(s), ds.shard_documents(s)
        end = int(rng.integers(0, len(toks)))  # a token (or separator) position
        d = int(np.searchsorted(docs, end, side="right")) - 1
        start, stop = int(docs[d]), int(docs[d + 1]) - 1  # the document, separator excluded
        end = min(max(end, start + 2), stop)
        if end - start < 2:
            continue
        out.append(toks[max(start, end - length) : end].astype(np.int64).tolist())
    return out


def _text_contexts(tokenizer: Any, inputs: Sequence[str], num: int, length: int, seed: int) -> list[list[int]]:
    """Contexts from held-out text: every position of the inputs' token streams, sampled."""
    from ..datastore.builder import iter_documents

    rng = np.random.default_rng(seed)
    texts = [t for _, docs in iter_documents(inputs) for t in docs if t.strip()]
    out: list[list[int]] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        out.extend(ids[max(0, e - length) : e] for e in range(2, len(ids)))
    if len(out) > num:
        pick = rng.choice(len(out), size=num, replace=False)
        out = [out[i] for i in sorted(pick)]
    return out


@_guard
def cmd_bench(args: argparse.Namespace) -> int:
    from ..datastore.store import Datastore

    with Datastore.open(args.directory, max_samples=args.max_samples) as ds:
        warm_s = None if args.cold else ds.warm()
        if args.input:
            tokenizer = _tokenizer_for(args.directory, args.model)
            contexts = _text_contexts(tokenizer, args.input, args.num, ds.max_match, args.seed)
            kind = "held-out text"
        else:
            contexts = _corpus_contexts(ds, args.num, ds.max_match, args.seed)
            kind = "corpus positions"
        if not contexts:
            raise ValueError("no contexts to benchmark (inputs too short?)")
        res = bench_lookup(ds, contexts, max_len=args.max_len, max_candidates=args.max_candidates)
        res.update(
            {
                "contexts": kind,
                "num_tokens": ds.num_tokens,
                "num_shards": ds.num_shards,
                "warm_s": warm_s,
                "max_samples": ds.max_samples,
            }
        )
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    state = "cold (pages faulted in on first use)" if warm_s is None else f"warmed in {warm_s:.2f} s"
    print(
        f"{res['num_contexts']} contexts from {kind}; datastore of {res['num_tokens']:,} tokens in "
        f"{res['num_shards']} shard(s), {state}"
    )
    print(
        f"lookup   p50 {res['lookup_p50_s'] * 1e6:8.1f} us   p99 {res['lookup_p99_s'] * 1e6:8.1f} us   "
        f"mean {res['lookup_mean_s'] * 1e6:8.1f} us"
    )
    print(
        f"  (cpu)  p50 {res['lookup_cpu_p50_s'] * 1e6:8.1f} us   p99 {res['lookup_cpu_p99_s'] * 1e6:8.1f} us   "
        "(this thread's CPU time: without the time other processes took the core)"
    )
    print(f"+ tree   p50 {res['propose_p50_s'] * 1e6:8.1f} us   p99 {res['propose_p99_s'] * 1e6:8.1f} us")
    print(f"hit rate {res['hit_rate']:.3f}, mean match length {res['mean_match_len']:.2f} tokens")
    return 0


def _add_build_command(sub: Any, model_default: Optional[str]) -> None:
    """``ragspec datastore build``: a datastore from texts, or from the target's answers."""
    b = sub.add_parser("build", help="build a datastore from text files, directories or JSONL")
    b.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="directory (recursive: .txt .md .rst .py .html .jsonl), file, or - for JSONL on stdin",
    )
    b.add_argument("-o", "--output", required=True, metavar="DIR", help="datastore directory to create")
    b.add_argument("--model", default=model_default, help="model whose tokenizer is used (default: the default model)")
    b.add_argument("--field", default="text", help="JSONL field holding the text (default: text)")
    b.add_argument(
        "--overwrite", action="store_true", help="replace DIR if it is a datastore or a folder (never a file)"
    )
    b.add_argument(
        "--strict",
        action="store_true",
        help="fail on a binary input file or a malformed JSONL line (default: skip it with a warning)",
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    r = b.add_argument_group("a datastore of the target's own answers (see ragspec/datastore/responses.py)")
    r.add_argument(
        "--responses",
        action="store_true",
        help="the inputs are prompts (JSONL: Spec-Bench 'turns' or --field): build from the model's answers to them",
    )
    r.add_argument("--max-new-tokens", type=int, default=256, help="longest answer (default 256)")
    r.add_argument("--samples", type=int, default=0, help="sampled answers per prompt besides the greedy one")
    r.add_argument("--temperature", type=float, default=0.8, help="of the sampled answers (default 0.8)")
    r.add_argument("--seed", type=int, default=0, help="seed of the first sampled answer (then +1, ...)")
    r.add_argument("--limit", type=int, default=None, help="first N prompts only")
    b.set_defaults(func=cmd_build)


def _add_add_command(sub: Any, model_default: Optional[str]) -> None:
    """``ragspec datastore add``: texts or a server's response log as a new shard."""
    a = sub.add_parser("add", help="append inputs to a datastore as a new shard")
    a.add_argument("directory", metavar="DIR", help="the datastore to add to")
    a.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="directory (recursive: .txt .md .rst .py .html .jsonl), file, or - for JSONL on stdin",
    )
    a.add_argument(
        "--from-log",
        action="append",
        default=[],
        metavar="LOG",
        help="a response log of 'ragspec serve --response-log' (JSON lines; its responses' text), repeatable",
    )
    a.add_argument(
        "--partition",
        default=None,
        metavar="DIGEST",
        help='take the --from-log records of this tenant\'s partition (the digest in their "partition" field) '
        "instead of the unsalted ones: a tenant's answers go only where that tenant alone drafts",
    )
    a.add_argument("--model", default=model_default, help="tokenizer's model (default: the datastore's)")
    a.add_argument("--field", default="text", help="JSONL field holding the text (default: text)")
    a.add_argument("--strict", action="store_true", help="fail on binary input or a malformed JSONL line")
    a.add_argument("--no-progress", action="store_true", help="no progress bar")
    a.set_defaults(func=cmd_add)


def add_datastore_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``datastore`` command group (build, add, compact, info, query, bench) to ``subparsers``."""
    model_default = os.environ.get("RAGSPEC_MODEL")
    p = subparsers.add_parser(
        "datastore",
        help="build and inspect retrieval datastores",
        description="Build, extend, compact, describe, query and benchmark datastores.",
    )
    sub = p.add_subparsers(dest="datastore_command", required=True)

    _add_build_command(sub, model_default)
    _add_add_command(sub, model_default)

    c = sub.add_parser(
        "compact",
        help="merge every shard into one (lookups search one index, as after a build)",
        description="Merge every shard of a datastore into one. Safe while servers serve it and add to it.",
    )
    c.add_argument("directory", metavar="DIR", help="the datastore")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_compact)

    i = sub.add_parser("info", help="format, tokenizer, counts and size of a datastore")
    i.add_argument("directory", metavar="DIR", help="the datastore")
    i.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    i.add_argument(
        "--verify",
        action="store_true",
        help="also check every file's sha256 and every token id against the vocabulary, and say what was checked "
        "(--json: a 'verified' field)",
    )
    i.set_defaults(func=cmd_info)

    q = sub.add_parser("query", help="show the continuations a context gets")
    q.add_argument("directory", metavar="DIR", help="the datastore")
    q.add_argument("--text", required=True, help="the context")
    q.add_argument("--model", default=model_default, help="tokenizer's model (default: the datastore's)")
    q.add_argument("--max-len", type=int, default=10, help="longest continuation shown, in tokens (default 10)")
    q.add_argument("--max-candidates", type=int, default=16, help="most different continuations shown (default 16)")
    q.add_argument("--json", action="store_true", help="print the continuations as JSON")
    q.set_defaults(func=cmd_query)

    be = sub.add_parser("bench", help="lookup latency (p50/p99) over real contexts")
    be.add_argument("directory", metavar="DIR", help="the datastore")
    be.add_argument(
        "--input",
        nargs="*",
        help="held-out text (files/directories) to take contexts from; default: random positions of the corpus itself",
    )
    be.add_argument("--model", default=model_default, help="tokenizer for --input (default: the datastore's)")
    be.add_argument("--num", type=int, default=2000, help="contexts (default 2000)")
    be.add_argument("--max-len", type=int, default=10, help="longest continuation per lookup, in tokens (default 10)")
    be.add_argument(
        "--max-candidates", type=int, default=64, help="most different continuations per lookup (default 64)"
    )
    be.add_argument("--max-samples", type=int, default=64, help="occurrences read per lookup (default 64)")
    be.add_argument("--cold", action="store_true", help="do not fault the datastore's pages in first")
    be.add_argument("--seed", type=int, default=0, help="random seed choosing the contexts (default 0)")
    be.add_argument("--json", action="store_true", help="print the timings as JSON")
    be.set_defaults(func=cmd_bench)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the datastore commands on their own: ``python -m ragspec.cli.datastore datastore info DIR``."""
    parser = argparse.ArgumentParser(prog="ragspec")
    add_datastore_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
