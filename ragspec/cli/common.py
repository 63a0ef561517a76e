"""What the command groups share: the model options and the engine they describe.

Used by the main CLI (:mod:`ragspec.cli.commands`), the bench commands (:mod:`ragspec.bench.cli`) and
``ragspec serve`` (:mod:`ragspec.integrations.cli`); it imports none of them, so each may
import it without a cycle.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from ..config import AUTO_DRAFTING, DRAFTING_MODES
from ..progress import PROGRESS_LOGGER

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["add_global_args", "add_global_args_everywhere", "add_model_args", "engine_from_args", "show_progress"]


def add_global_args(p: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """Add the options every command takes, before or after its name: ``-v``/``--verbose``,
    ``-q``/``--quiet``, ``--threads``. ``suppress``: no defaults (for the subcommands'
    copies, so an option given before the subcommand is not reset by the subcommand's
    default; the main parser's defaults stand)."""
    group = p.add_argument_group("global options (before or after the command)") if suppress else p
    group.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="log more: every module's INFO lines and, on an internal error, its traceback",
    )
    group.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="no progress lines on stderr (model loading, kernel compilation, latency calibration, "
        "progress bars); warnings and errors still show",
    )
    group.add_argument(
        "--threads",
        type=int,
        default=argparse.SUPPRESS if suppress else None,
        metavar="N",
        help="CPU threads torch computes with (default: torch's choice, one per core)",
    )


def add_global_args_everywhere(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand of ``parser`` (at every depth) :func:`add_global_args`'
    options without defaults, so ``ragspec generate --threads 2 ...`` means what
    ``ragspec --threads 2 generate ...`` means."""
    seen: set[int] = set()

    def walk(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    if id(sub) in seen:
                        continue
                    seen.add(id(sub))
                    add_global_args(sub, suppress=True)
                    walk(sub)

    walk(parser)


class _StderrHandler(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment (not the one at creation: tests and
    wrappers replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def show_progress(enabled: bool = True) -> None:
    """Print the progress lines (:mod:`ragspec.progress`) to stderr as ``ragspec: <line>``,
    or (``enabled`` False: ``-q``) silence them. Replaces what an earlier call installed;
    the lines then do not also reach the root logger (no duplicates under ``-v``)."""
    logger = logging.getLogger(PROGRESS_LOGGER)
    for old in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(old)
    if not enabled:
        logger.setLevel(logging.WARNING)
        logger.propagate = True
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("ragspec: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def add_model_args(p: argparse.ArgumentParser, datastore: bool = True) -> None:
    """Add the options that choose the model and its engine: ``--model``, ``--device``,
    ``--dtype``, ``--max-draft-tokens``, ``--numerics``, ``--fixed-draft``, ``--drafting``
    and, with ``datastore``, ``--datastore`` and ``--eagle`` (defaults from the
    ``RAGSPEC_*`` environment variables)."""
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
    p.add_argument(
        "--max-draft-tokens",
        type=int,
        default=8,
        help="most draft tokens verified per step (default 8; on CUDA, unless given, sized from the measured "
        "forward latency)",
    )
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
        "--recalibrate",
        action="store_true",
        help="measure the forward latency even where a table measured on this machine, model, dtype, threads and "
        "kernel build is cached (RAGSPEC_RECALIBRATE)",
    )
    p.add_argument(
        "--drafting",
        choices=(AUTO_DRAFTING, *DRAFTING_MODES),
        default=os.environ.get("RAGSPEC_DRAFTING") or "auto",
        help="how an EAGLE head and retrieval share a step: 'merged' one draft tree from retrieval, the head "
        "and retrieval's copies after the head's tokens; 'select' the better of the two each step, never both; "
        "'retrieval' retrieval's drafts only (the head unused); 'auto' (default) merged on CUDA, retrieval on a "
        "CPU, where the head's proposals cost more than they add (RAGSPEC_DRAFTING)",
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


def engine_from_args(args: argparse.Namespace, calibrate: bool = True) -> "Engine":
    """The engine :func:`add_model_args`' options describe, through
    :func:`ragspec.loading.load_engine` (``--prefix-cache-tokens`` too where the command has
    it), after :func:`ragspec.serving.check_config` checked them (a bad path fails before
    the model loads); ``calibrate`` times the target's forwards at start-up.

    Raises:
        RagspecError: the model, datastore or head cannot be loaded (typed subclasses).
    """
    from ..config import PolicyConfig
    from ..loading import load_engine
    from ..serving import ServingConfig, check_config

    datastore = getattr(args, "datastore", None)
    # every path and option checked in seconds, before the model loads
    check_config(
        ServingConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            eagle=getattr(args, "eagle", None),
            numerics=getattr(args, "numerics", None) or "exact",
            datastores=((datastore, datastore),) if datastore else (),
        )
    )
    return load_engine(
        args.model,
        device=args.device,
        dtype=args.dtype,
        datastore=datastore,
        eagle=getattr(args, "eagle", None),
        policy=PolicyConfig(
            max_draft_tokens=args.max_draft_tokens,
            adaptive=not args.fixed_draft,
            prefix_cache_tokens=getattr(args, "prefix_cache_tokens", PolicyConfig.prefix_cache_tokens),
        ),
        calibrate=calibrate,
        recalibrate=True if getattr(args, "recalibrate", False) else None,
        drafting=getattr(args, "drafting", None) or "auto",
        numerics=getattr(args, "numerics", None) or "exact",
    )
