"""``ragspec bench``: its options and its commands (the bench itself, ``--replay``,
``--profile-step``, ``--concurrency``, ``--processors``, ``--serve``, ``--structured``).

Registered by :func:`ragspec.cli.build_parser` through :func:`add_bench_command`. The
measuring lives in the modules beside this one (:mod:`~ragspec.bench.runner`,
:mod:`~ragspec.bench.replay`, :mod:`~ragspec.bench.profile`,
:mod:`~ragspec.bench.concurrency`, :mod:`~ragspec.bench.compare`, :mod:`~ragspec.bench.serve`); this module parses the
options, builds the engine (:func:`ragspec.cli.common.engine_from_args`) and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Optional

from ..backend.base import Capability, SpeedUps
from ..cli.common import add_model_args, engine_from_args
from ..config import check_drafting
from ..errors import ConfigError
from ..specbench import DEFAULT_DATA, category_group, load_prompts
from .serve import SERVE_PHASES

__all__ = [
    "add_bench_command",
    "cmd_bench",
    "cmd_replay",
    "cmd_profile_step",
    "cmd_concurrency",
    "cmd_processors",
    "cmd_serve_bench",
]


def add_bench_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ragspec bench`` on the main parser's sub-parsers; returns its parser."""
    b = subparsers.add_parser("bench", help="ragspec vs plain transformers decoding on Spec-Bench")
    b.add_argument("--data", default=DEFAULT_DATA, help=f"Spec-Bench prompts, a JSONL file (default {DEFAULT_DATA})")
    b.add_argument("--categories", default=None, help="comma-separated; 'mt_bench' = the 8 MT-bench categories")
    b.add_argument("--limit", type=int, default=None, help="prompts per category")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    b.add_argument("--json", default=None, help="write all records and the summary here")
    b.add_argument("--plot", default=None, help="PNG: speedup per category and accepted-length histogram")
    b.add_argument("--no-hf-pld", action="store_true", help="skip transformers' prompt lookup")
    b.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature of every run (default 0: greedy)"
    )
    b.add_argument(
        "--static-baseline",
        action="store_true",
        help="also time transformers' static-cache generate (compiled on CUDA)",
    )
    b.add_argument(
        "--draft-budgets",
        default=None,
        help="comma-separated draft budgets to run ragspec at, e.g. 8,32 (default: --max-draft-tokens)",
    )
    b.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip the start-up latency measurement: the cost model uses the reference CPU's table (refined "
        "online by one scale factor, which cancels in its choice), so draft sizes do not follow this "
        "machine's load",
    )
    b.add_argument(
        "--also-drafting",
        default=None,
        help="comma-separated drafting modes (merged, select, retrieval) to run beside --drafting's, interleaved, as more "
        "ragspec columns: tokens/s, accepted tokens per step, identity",
    )
    b.add_argument(
        "--also-numerics",
        default=None,
        help="comma-separated target numerics (fast) to run beside --numerics', interleaved: one more ragspec "
        "column per mode and one with its drafting off (MODE@0), so the table shows the mode's speed, its "
        "identity to transformers greedy and its speculative output against its own plain decoding",
    )
    b.add_argument(
        "--warmup", action="store_true", help="run every method once before timing (CUDA: kernels, compilation)"
    )
    b.add_argument(
        "--replay",
        metavar="FILE",
        default=None,
        help="offline replay: where drafting steps lose against the context oracle (records greedy "
        "generations into FILE first when it does not exist; see ragspec/bench/replay.py)",
    )
    b.add_argument(
        "--ceiling",
        action="store_true",
        help="with --replay: also the speed ceiling of drafting from the context on this machine: the fastest "
        "schedule of an oracle that knows the output, under the target's forward latency measured here "
        "(loads the model; decode-phase gain over plain decoding, see ragspec/bench/replay.py); with --concurrency: "
        "each level's ceilings from the batched forward's cost measured here (plain batching, the context "
        "oracle; see ragspec/bench/concurrency.py)",
    )
    b.add_argument(
        "--compare",
        action="append",
        choices=("llamacpp",),
        default=None,
        help="also time another decoder's plain greedy on the same GGUF, token ids and threads "
        "(llamacpp: llama-cpp-python, pip install 'ragspec[compare]'); with --concurrency, the same "
        "levels through llama.cpp's continuous batching (llama-server -np N); repeatable",
    )
    b.add_argument(
        "--profile-step",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead of the bench: where the milliseconds of a plain decoding step go, STEPS steps "
        "on the first prompt of each category (ragspec/bench/profile.py); 0 (default): the bench itself",
    )
    add_model_args(b)
    # --concurrency: ragspec.bench.concurrency (N requests through the batched engine step)
    b.add_argument(
        "--concurrency",
        default=None,
        help="e.g. 1,4,8: clients in flight through the batched engine step, per level (in process); "
        "default categories summarization,rag",
    )
    b.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help="prefix caching across the bench's requests (default 0 = off: every method and level prefills its "
        "prompts itself, so their times compare); with --concurrency the cache is emptied before each level; "
        "with --serve the server's and the in-process engine's (default: the server's, 4096)",
    )
    b.add_argument(
        "--stall-tokens",
        type=int,
        default=0,
        help="with --concurrency: also time running streams while a prompt of this many tokens arrives",
    )
    # --processors: ragspec.bench.processors (logprobs and a penalty against neither, drafts on)
    b.add_argument(
        "--processors",
        action="store_true",
        help="what logprobs and penalties cost a drafting request: each prompt greedy with no processing, "
        "top_logprobs=5 and frequency_penalty=0.5, interleaved; tokens/s and accepted tokens per step of each "
        "(ragspec/bench/processors.py); default categories rag,summarization",
    )
    # --serve: ragspec.bench.serve (ragspec serve against llama-server, and against its engine)
    b.add_argument(
        "--serve",
        action="store_true",
        help="time the HTTP service: ragspec serve against llama-server (same GGUF and threads), solo, "
        "--serve-clients at once, and those with short qa questions arriving among them (mixed), each phase on "
        "a fresh server; then the server against its engine in process, prompt by prompt "
        "(ragspec/bench/serve.py); default categories rag,summarization, --limit 4 (also of the qa questions)",
    )
    b.add_argument(
        "--serve-clients", type=int, default=8, help="with --serve: clients in the concurrent phase (default 8)"
    )
    b.add_argument(
        "--serve-phases",
        default=",".join(SERVE_PHASES),
        help=f"with --serve: which of {','.join(SERVE_PHASES)} to run (default all)",
    )
    b.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="with --serve or --structured: the llama-server binary (default: llama-server on PATH; none: "
        "ragspec only)",
    )
    b.add_argument(
        "--serve-timeout",
        type=float,
        default=600.0,
        help="with --serve or --structured: seconds a server may take to be ready, and each request (default 600)",
    )
    # --structured: ragspec.bench.structured (a JSON extraction: constrained, plain, free; llama-server)
    b.add_argument(
        "--structured",
        action="store_true",
        help="time structured outputs on a RAG extraction (each rag prompt's answer as JSON with quotes, greedy): "
        "constrained with drafts, constrained plain, unconstrained with drafts, and llama-server with the same "
        "json_schema (--llama-server PATH) (ragspec/bench/structured.py); default categories rag, --limit 8",
    )
    b.add_argument(
        "--serve-source",
        default=None,
        metavar="DIR",
        help="with --serve: time the ragspec serve of this ragspec source tree (another checkout), run there "
        "with it first on PYTHONPATH (default: this ragspec)",
    )
    b.set_defaults(func=cmd_bench)
    return b


def cmd_replay(args, rows) -> int:
    """``bench --replay FILE``: record greedy generations into FILE when it does not exist
    (the engine of the other options), then replay drafters over them offline."""
    from . import replay

    path = Path(args.replay)
    budget = 8 if args.max_draft_tokens is None else args.max_draft_tokens
    if budget < 1:
        raise ConfigError(f"--replay needs a draft budget of at least 1 token (--max-draft-tokens), got {budget}")
    engine = None
    if path.is_dir():
        raise ConfigError(f"--replay {path}: a directory; give a file to record the generations into or read them from")
    if path.exists():
        records = replay.load_generations(path)
        if not records:
            raise ConfigError(f"--replay {path}: no recorded generations in it (delete it to record anew)")
        print(
            f"# {len(records)} recorded generations from {path} (as recorded: --categories, --limit and "
            "--max-new-tokens apply when recording)",
            file=sys.stderr,
        )
    else:
        if not path.parent.is_dir():
            raise ConfigError(f"--replay {path}: its folder {path.parent} does not exist")
        engine = engine_from_args(args)
        print(f"# recording {len(rows)} greedy generations into {path}", file=sys.stderr)
        records = replay.record_generations(engine, rows, args.max_new_tokens, path)
    drafters = replay.default_drafters()
    table = replay.replay_table(records, drafters, budget, group=category_group)
    print(replay.format_replay_table(table, list(drafters)))
    ceiling = None
    if args.ceiling:
        from ..calibrate import measure_latency

        engine = engine or engine_from_args(args, calibrate=False)
        vocab = engine.target.vocab_size
        if any(t >= vocab for r in records for k in ("prompt_ids", "output_ids") for t in r[k]):
            raise ConfigError(
                f"--ceiling: {path} holds token ids past this model's vocabulary ({vocab}): recorded with another "
                "tokenizer (--model)"
            )
        recorded = {r.get("model") for r in records} - {None}
        if recorded - {engine.model_name}:
            print(
                f"# note: {path} names {', '.join(sorted(map(str, recorded)))} as its model, this run {engine.model_name}: "
                "the ceiling prices those token ids with this model's latency",
                file=sys.stderr,
            )
        # each generation's steps at its cache length midway through decoding, interpolated
        # between the shortest, the median and the longest of them
        mids = sorted(max(1, replay.decode_context(r)) for r in records)
        contexts = sorted({mids[0], mids[len(mids) // 2], mids[-1]})
        latency = measure_latency(
            engine.target,
            qs=range(1, budget + 2),
            contexts=contexts,
            repeats=5,
            model_name=engine.model_name,
        )
        ceiling = replay.replay_ceiling(records, latency, budget, group=category_group, drafters=drafters)
        print()
        print(replay.format_ceiling_table(ceiling, latency, budget))
        print(f"# latency measured on {engine.target.device}, {engine.target.dtype}")
    if args.json:
        out = {
            g: {
                "prompts": row["prompts"],
                **{
                    n: {
                        "tokens_per_step": st.tokens_per_step,
                        "steps": st.steps,
                        "losses": st.losses,
                        "lost_tokens": st.lost_tokens,
                    }
                    for n, st in row.items()
                    if n != "prompts"
                },
            }
            for g, row in table.items()
        }
        doc: dict = {"budget": budget, "table": out}
        if ceiling is not None:
            doc["ceiling"] = {
                "latency": latency.to_dict(),
                "never_wrong_gain": {str(c): replay.never_wrong_gain(latency.at(c)) for c in latency.contexts},
                "table": {g: st.to_dict() for g, st in ceiling.items()},
            }
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"# wrote {args.json}", file=sys.stderr)
    return 0


def _speed_ups(engine: Any) -> SpeedUps:
    """What the engine's target was built with (none declared: none)."""
    return engine.target.capability(Capability.SPEED_UPS) or SpeedUps()


def cmd_profile_step(args, rows) -> int:
    from .profile import format_step_profile, profile_plain_step

    engine = engine_from_args(args, calibrate=False)
    seen: dict[str, dict] = {}
    for row in rows:
        seen.setdefault(row["category"], row)
    for cat, row in seen.items():
        prof = profile_plain_step(engine, engine.encode_prompt(row["turns"][0], chat=True), steps=args.profile_step)
        print(format_step_profile(f"{cat} #{row.get('question_id', '?')}", prof))
    return 0


# the most draft tokens --ceiling times forwards for (budget + 1 rows per request)
CEILING_MAX_DRAFT_TOKENS = 64


def _check_bench_outputs(args) -> None:
    """Bad output paths and option mixes are found before any work (a finished run used to
    be lost to the write)."""
    for opt in ("json", "plot"):
        value = getattr(args, opt, None)
        if not value:
            continue
        out = Path(value)
        if out.is_dir():
            raise ConfigError(f"--{opt} {out}: a directory; give a file name")
        if not out.parent.is_dir():
            raise ConfigError(f"--{opt} {out}: its folder {out.parent} does not exist")
    if getattr(args, "concurrency", None) and getattr(args, "replay", None):
        raise ConfigError("--concurrency and --replay are separate benchmarks: give one of them")
    if getattr(args, "structured", False) and (getattr(args, "serve", False) or getattr(args, "concurrency", None)):
        raise ConfigError("--structured is a benchmark of its own: not with --serve or --concurrency")
    if getattr(args, "structured", False) and getattr(args, "temperature", 0.0) != 0:
        raise ConfigError("--structured times greedy extractions: use --temperature 0")
    if getattr(args, "serve", False):
        other = [
            f"--{o.replace('_', '-')}"
            for o in ("concurrency", "replay", "compare", "profile_step")
            if getattr(args, o, None)
        ]
        if other:
            raise ConfigError(f"--serve is a benchmark of its own: not with {', '.join(other)}")
        if getattr(args, "temperature", 0.0) != 0:
            raise ConfigError("--serve times greedy answers (their identity is checked): use --temperature 0")
    if getattr(args, "ceiling", False):
        if not getattr(args, "replay", None) and not getattr(args, "concurrency", None):
            raise ConfigError("--ceiling needs --replay FILE (the recorded generations it schedules) or --concurrency")
        budget = getattr(args, "max_draft_tokens", None)
        if budget is not None and not 1 <= budget <= CEILING_MAX_DRAFT_TOKENS:
            raise ConfigError(
                f"--ceiling prices drafts of 1 to {CEILING_MAX_DRAFT_TOKENS} tokens (--max-draft-tokens), got {budget}"
            )


def cmd_bench(args) -> int:
    _check_bench_outputs(args)
    if getattr(args, "serve", False):
        return cmd_serve_bench(args)
    if getattr(args, "prefix_cache_tokens", None) is None:
        args.prefix_cache_tokens = 0  # off: every method prefills its prompts itself
    if getattr(args, "structured", False):
        from .structured import cmd_structured_bench

        return cmd_structured_bench(args)
    if getattr(args, "concurrency", None):
        return cmd_concurrency(args)
    if getattr(args, "processors", False):
        return cmd_processors(args)
    from . import compare, runner

    if getattr(args, "profile_step", 0) < 0:
        raise ConfigError(f"--profile-step must be a number of steps >= 1 (0: no profile), got {args.profile_step}")
    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    rows = load_prompts(args.data, cats, args.limit, required=True)
    if args.replay:
        return cmd_replay(args, rows)
    if args.profile_step:
        return cmd_profile_step(args, rows)
    runners = []
    if args.compare:
        # before the model loads: a missing package or a non-GGUF model fails at once
        from ..models import resolve_model

        if args.temperature > 0:
            raise ConfigError("--compare times plain greedy decoding; use --temperature 0")
        for name in args.compare:
            compare.require(name)
        gguf = resolve_model(args.model).gguf_file
        threads = args.threads or __import__("torch").get_num_threads()
        runners = [compare.open_runner(n, gguf=gguf, threads=threads) for n in dict.fromkeys(args.compare)]
    also_modes = list(dict.fromkeys(m.strip() for m in (args.also_drafting or "").split(",") if m.strip()))
    for mode in also_modes:
        check_drafting(mode)  # an unknown mode fails before the model loads
    engine = engine_from_args(args, calibrate=not args.no_calibrate)
    print(
        f"# {len(rows)} prompts, max_new_tokens {args.max_new_tokens}, model {engine.model_name}, "
        f"device {engine.target.device}, dtype {engine.target.dtype}, temperature {args.temperature}, "
        f"torch threads {__import__('torch').get_num_threads()}, drafting {engine.drafting}",
        file=sys.stderr,
    )
    print(
        "# latency model (ms per forward of q tokens): "
        + ", ".join(f"{q}:{v * 1e3:.1f}" for q, v in engine.latency.table.items()),
        file=sys.stderr,
    )

    def progress(i, r):
        others = "".join(f"{n} {c['tokens'] / c['s']:6.1f} tok/s  " for n, c in r.compare.items())
        others += "".join(
            f"{n} {v['tokens'] / v['s']:6.1f} tok/s accepted {v['mean_accepted']:.2f}"
            f"{'' if v['identical'] or args.temperature > 0 else ' DIFFERS'}  "
            for n, v in r.variants.items()
        )
        print(
            f"  [{i + 1}/{len(rows)}] {r.category:<14} base {r.baseline_tokens / r.baseline_s:6.1f} tok/s  "
            f"ragspec {r.ragspec_tokens / r.ragspec_s:6.1f} tok/s accepted {r.mean_accepted:.2f}  {others}"
            f"{'identical' if r.identical else ('sampled' if args.temperature > 0 else 'DIFFERS at %d' % r.first_diff)}",
            file=sys.stderr,
        )

    budgets = [int(b) for b in args.draft_budgets.split(",") if b.strip()] if args.draft_budgets else []
    variants = {}
    if also_modes:
        from ..loading import resolve_drafting, with_drafting

        for mode in also_modes:
            mode = resolve_drafting(mode, engine.target.device)  # "auto" -> the mode it is here
            if mode == engine.parts.drafting:
                print(
                    f"--also-drafting {mode}: already the main column's drafting (--drafting {args.drafting})",
                    file=sys.stderr,
                )
                continue
            variants[mode] = with_drafting(engine, mode)
    also_drafting = list(variants)
    if args.also_numerics:
        for mode in dict.fromkeys(m.strip() for m in args.also_numerics.split(",") if m.strip()):
            if mode == args.numerics:
                print(
                    f"--also-numerics {mode}: already the main column's numerics (--numerics {mode})", file=sys.stderr
                )
                continue
            # the same options, another target arithmetic (a second copy of the model)
            other = engine_from_args(
                argparse.Namespace(**{**vars(args), "numerics": mode}), calibrate=not args.no_calibrate
            )
            variants[mode] = other
            # the same engine with drafting off: its speculative output against its own plain decoding
            variants[f"{mode}@0"] = other.with_drafter(
                other.drafter, policy=dataclasses.replace(other.policy, max_draft_tokens=0)
            )
    try:
        records = runner.run_bench(
            engine,
            rows,
            max_new_tokens=args.max_new_tokens,
            hf_pld=not args.no_hf_pld,
            static_baseline=args.static_baseline,
            draft_budgets=budgets,
            warmup=args.warmup,
            temperature=args.temperature,
            progress=progress,
            keep_steps=bool(args.json),
            compare=runners,
            variants=variants,
        )
        compare_settings = compare.runner_settings(runners) if runners else {}
    finally:
        for r in runners:
            r.close()
    table = runner.summarize(records)
    print(runner.format_table(table, sampling=args.temperature > 0))
    if engine.target.numerics == "fast" and args.temperature <= 0:
        print(
            "# --numerics fast: 'identical' compares with transformers' float32 greedy, which int8 activations "
            "need not match; --also-numerics fast beside --numerics exact reports speculative == the mode's "
            "own plain decoding"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "settings": {
                        "data": args.data,
                        "categories": cats,
                        "limit": args.limit,
                        "max_new_tokens": args.max_new_tokens,
                        "model": engine.model_name,
                        "device": str(engine.target.device),
                        "dtype": str(engine.target.dtype),
                        "temperature": args.temperature,
                        "datastore": args.datastore,
                        "eagle": engine.eagle_path,
                        "drafting": engine.drafting,
                        "also_drafting": also_drafting,
                        "numerics": engine.target.numerics,
                        "also_numerics": args.also_numerics,
                        "cpu_kernel": _speed_ups(engine).compiled_kernel,
                        "gguf_weights": _speed_ups(engine).gguf_weights,
                        "threads": __import__("torch").get_num_threads(),
                        "latency_ms": {q: v * 1e3 for q, v in engine.latency.table.items()},
                        "draft_budgets": budgets or [engine.policy.max_draft_tokens],
                        "static_baseline": args.static_baseline,
                        "static_compiled": runner.static_compiled(engine.model),
                        "warmup": args.warmup,
                        "latency_calibrated": not args.no_calibrate,
                        "compare": compare_settings,
                        "torch": __import__("torch").__version__,
                        "transformers": __import__("transformers").__version__,
                    },
                    "summary": table,
                    "records": [dataclasses.asdict(r) for r in records],
                },
                indent=1,
                default=str,
            )
        )
        print(f"# wrote {args.json}", file=sys.stderr)
    if args.plot:
        runner.plot(table, records, args.plot)
        print(f"# wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_processors(args) -> int:
    """``bench --processors``: no processing, ``top_logprobs=5`` and ``frequency_penalty=0.5``
    on the same prompts, drafts on (:mod:`ragspec.bench.processors`)."""
    from .processors import format_processors_table, run_processors_bench, summarize_processors

    cats = [c.strip() for c in args.categories.split(",")] if args.categories else ["rag", "summarization"]
    rows = load_prompts(args.data, cats, args.limit, required=True)
    engine = engine_from_args(args, calibrate=not args.no_calibrate)
    print(
        f"# {len(rows)} prompts, max_new_tokens {args.max_new_tokens}, model {engine.model_name}, drafting "
        f"{engine.drafting}, greedy, torch threads {__import__('torch').get_num_threads()}",
        file=sys.stderr,
    )

    def progress(i, r) -> None:
        parts = "  ".join(f"{n} {r.tokens[n] / r.seconds[n]:6.1f} tok/s" for n in r.tokens if r.seconds[n] > 0)
        print(f"  [{i + 1}/{len(rows)}] {r.category:<14} {parts}", file=sys.stderr)

    records = run_processors_bench(engine, rows, args.max_new_tokens, progress=progress)
    table = summarize_processors(records)
    print(format_processors_table(table))
    if args.json:
        doc = {"records": [r.to_dict() for r in records], "summary": table}
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"# wrote {args.json}", file=sys.stderr)
    return 0


def cmd_concurrency(args) -> int:
    """The ``ragspec bench --concurrency`` command (``args`` from ``ragspec bench``)."""
    from .concurrency import (
        LevelCeiling,
        LevelResult,
        arrival_stall,
        format_ceilings,
        format_levels,
        long_prompt_ids,
        measure_ceilings,
        parse_levels,
        run_concurrency,
        run_level_llamacpp,
    )

    levels = parse_levels(args.concurrency)
    cats = [c.strip() for c in args.categories.split(",")] if args.categories else ["summarization", "rag"]
    rows = load_prompts(args.data, cats, args.limit, required=True)
    runner = None
    if getattr(args, "compare", None):
        from ..models import resolve_model
        from . import compare

        if args.temperature > 0:
            raise ConfigError("--compare times plain greedy decoding; use --temperature 0")
        for name in args.compare:
            compare.require(name)
        threads = args.threads or __import__("torch").get_num_threads()
        runner = compare.open_runner("llamacpp", gguf=resolve_model(args.model).gguf_file, threads=threads)
    engine = engine_from_args(args)
    # the ceilings price drafts up to the engine's own budget (the oracle at a budget of 0
    # drafts nothing: the ceiling is then plain decoding's)
    budget = engine.policy.max_draft_tokens
    prompts = [engine.encode_prompt(r["turns"][0], chat=True) for r in rows]
    print(
        f"# concurrency {levels}: {len(prompts)} prompts ({', '.join(cats)}), max_new_tokens {args.max_new_tokens}, "
        f"model {engine.model_name}, prefill chunk {engine.policy.prefill_chunk_tokens}, "
        f"temperature {args.temperature}",
        file=sys.stderr,
    )
    if args.warmup:
        engine.generate(prompts[0], max_new_tokens=16, chat=False)

    def progress(r: LevelResult) -> None:
        print(
            f"  [{r.concurrency} clients] {r.aggregate_tok_s:.1f} tok/s, decode {r.decode_tok_s:.1f} tok/s, "
            f"P50 {r.latency_p50_s:.2f} s, identical {r.identical}/{r.requests}",
            file=sys.stderr,
        )

    results = run_concurrency(
        engine, prompts, levels, max_new_tokens=args.max_new_tokens, temperature=args.temperature, progress=progress
    )
    print(format_levels(results))
    llamacpp: list[LevelResult] = []
    agree: list[int] = []
    if runner is not None:
        # the same levels through llama.cpp's continuous batching, after ragspec's (one run,
        # the same prompt ids, threads and GGUF); identical = equal to llama.cpp's own solo
        own: Optional[list[list[int]]] = None
        for n in ([1] if 1 in levels else []) + [n for n in levels if n != 1]:
            res = run_level_llamacpp(runner, prompts, n, max_new_tokens=args.max_new_tokens, eos=engine.eos_token_ids)
            if own is None:
                own = (
                    res.tokens[: len(prompts)]
                    if n == 1
                    else [runner.generate(p, args.max_new_tokens, engine.eos_token_ids).tokens for p in prompts]
                )
            res.identical = sum(res.tokens[k] == own[k % len(prompts)] for k in range(res.requests))
            llamacpp.append(res)
        llamacpp.sort(key=lambda r: levels.index(r.concurrency))
        solo = results[0].tokens if results and results[0].concurrency == 1 else None
        for r in llamacpp:
            agree.append(
                sum(r.tokens[k] == solo[k % len(prompts)] for k in range(r.requests)) if solo is not None else -1
            )
        print("# llama.cpp, continuous batching (llama-server -np N), same GGUF and threads:")
        print(format_levels(llamacpp))
        for r, ours in zip(llamacpp, results):
            print(
                f"# {r.concurrency} clients: ragspec / llama.cpp aggregate x{ours.aggregate_tok_s / max(1e-9, r.aggregate_tok_s):.2f}, "
                f"P50 latency x{ours.latency_p50_s / max(1e-9, r.latency_p50_s):.2f} (below 1: ragspec answers sooner); "
                f"llama.cpp equal to its own solo {r.identical}/{r.requests}, to ragspec's greedy "
                f"{agree[llamacpp.index(r)]}/{r.requests}"
            )
    ceilings: list[LevelCeiling] = []
    if getattr(args, "ceiling", False) and results:
        ceilings = measure_ceilings(engine, prompts, results, budget)
        print(format_ceilings(ceilings, results))
    stall = None
    if args.stall_tokens:
        long_ids = long_prompt_ids(engine, rows, args.stall_tokens)
        stall = arrival_stall(engine, prompts[: max(1, min(4, len(prompts)))], long_ids)
        print(
            f"# a {stall['prompt_tokens']}-token prompt arriving: running streams' longest step "
            f"{stall['chunked']['max_step_s'] * 1e3:.0f} ms chunked ({stall['chunk_tokens']} tokens/step, "
            f"{stall['chunked']['steps']} steps) vs {stall['unchunked']['max_step_s'] * 1e3:.0f} ms unchunked; "
            f"plain step {stall['chunked']['mean_plain_step_s'] * 1e3:.0f} ms"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "settings": {
                        "data": args.data,
                        "categories": cats,
                        "limit": args.limit,
                        "max_new_tokens": args.max_new_tokens,
                        "concurrency": levels,
                        "model": engine.model_name,
                        "device": str(engine.target.device),
                        "dtype": str(engine.target.dtype),
                        "temperature": args.temperature,
                        "prefill_chunk_tokens": engine.policy.prefill_chunk_tokens,
                        "batched_verify": _speed_ups(engine).batched_verify,
                        "threads": __import__("torch").get_num_threads(),
                        "torch": __import__("torch").__version__,
                        "transformers": __import__("transformers").__version__,
                    },
                    "levels": [dataclasses.asdict(r) for r in results],
                    "llamacpp": {
                        "levels": [dataclasses.asdict(r) for r in llamacpp],
                        "agrees_with_ragspec": agree,
                        "info": runner.info() if runner is not None else None,
                    }
                    if runner is not None
                    else None,
                    "arrival_stall": stall,
                    "ceilings": [dataclasses.asdict(c) for c in ceilings],
                },
                indent=1,
                default=str,
            )
        )
        print(f"# wrote {args.json}", file=sys.stderr)
    if args.temperature == 0 and any(r.identical != r.requests for r in results):
        print("# WARNING: some batched outputs differ from their solo outputs", file=sys.stderr)
    return 0


def cmd_serve_bench(args) -> int:
    """The ``ragspec bench --serve`` command (``args`` from ``ragspec bench``)."""
    from ..models import resolve_model
    from .serve import MixedLoad, ServeBenchConfig, find_llama_server, format_report, run_serve_bench

    cats = [c.strip() for c in args.categories.split(",")] if args.categories else ["rag", "summarization"]
    limit = 4 if args.limit is None else args.limit
    rows = load_prompts(args.data, cats, limit, required=True)
    phases = tuple(p.strip() for p in args.serve_phases.split(",") if p.strip())
    short_rows = load_prompts(args.data, ["qa"], limit, required=True) if "mixed" in phases else []
    server_phases = any(p != "engine" for p in phases)
    binary = find_llama_server(args.llama_server) if server_phases else None
    gguf = resolve_model(args.model).gguf_file
    skipped = None
    if not server_phases:
        skipped = "no solo, clients or mixed phase (--serve-phases)"
    elif binary is None:
        skipped = "llama-server not found (--llama-server PATH, or llama-server on PATH)"
    elif gguf is None:
        skipped = f"the model {args.model} has no GGUF file"
    config = ServeBenchConfig(
        clients=args.serve_clients,
        max_tokens=args.max_new_tokens,
        threads=args.threads or __import__("torch").get_num_threads(),
        phases=phases,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        eagle=args.eagle,
        numerics=args.numerics,
        drafting=args.drafting,
        max_draft_tokens=args.max_draft_tokens,
        fixed_draft=args.fixed_draft,
        calibrate=not args.no_calibrate,
        prefix_cache_tokens=args.prefix_cache_tokens,
        datastore=args.datastore,
        llama_server=binary,
        gguf=str(gguf) if gguf is not None else None,
        timeout_s=args.serve_timeout,
        server_source=args.serve_source,
        mixed=MixedLoad(max_tokens=min(MixedLoad.max_tokens, args.max_new_tokens)),  # short: never the longer
    )
    print(
        f"# --serve: {len(rows)} prompts ({', '.join(cats)}), max_tokens {config.max_tokens}, {config.clients} clients, "
        f"threads {config.threads}, phases {','.join(phases)}"
        + (f"; llama-server: {binary}" if skipped is None else f"; {skipped}"),
        file=sys.stderr,
    )

    def on_phase(p) -> None:
        print(
            f"  [{p.server} {p.phase}] {p.tok_s:.1f} tok/s, P50 {p.latency_p50_s:.2f} s, ready in {p.ready_s:.1f} s"
            + ("" if p.identical is None else f", identical {p.identical}/{p.requests}")
            + (f", short questions P50 {p.short_latency_p50_s:.2f} s" if p.short_requests else ""),
            file=sys.stderr,
        )

    def on_prompt(e) -> None:
        print(
            f"  [engine vs server] {e.category} #{e.question_id}: {e.engine_s:.2f} s / {e.server_s:.2f} s",
            file=sys.stderr,
        )

    report = run_serve_bench(
        config, rows, llama_skipped=skipped, on_phase=on_phase, on_prompt=on_prompt, short_rows=short_rows
    )
    print(format_report(report))
    if args.json:
        report.settings.update(data=args.data, torch=__import__("torch").__version__)
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1, default=str))
        print(f"# wrote {args.json}", file=sys.stderr)
    clients = [p for p in report.phases if p.server == "ragspec" and p.identical is not None]
    shorts = [p for p in report.phases if p.server == "ragspec" and p.short_identical is not None]
    if any(p.identical != p.requests for p in clients) or any(p.short_identical != p.short_requests for p in shorts):
        print("# WARNING: some concurrent ragspec answers differ from their solo answers", file=sys.stderr)
    return 0
