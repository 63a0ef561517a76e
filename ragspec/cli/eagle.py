"""``ragspec eagle ...``: train, inspect and benchmark EAGLE draft heads.

Registered by :func:`ragspec.cli.build_parser` through :func:`add_eagle_commands`; the
training itself is :mod:`ragspec.training`.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from ..errors import ConfigError
from ..specbench import DEFAULT_DATA


def cmd_eagle_train(args) -> int:
    from ..training import DataConfig, TrainConfig, run_training

    if not args.data:
        raise ConfigError("give training data: --data JSONL [JSONL ...]")
    data = DataConfig(
        paths=tuple(args.data),
        holdout_per_category=args.holdout,
        num_responses=args.responses,
        num_samples=args.samples,
        sample_temperature=args.sample_temperature,
        response_tokens=args.response_tokens,
        generation_batch=args.generation_batch,
        max_tokens=args.max_tokens,
    )
    train = TrainConfig(
        epochs=args.epochs,
        max_steps=args.max_steps,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        draft_vocab_size=args.draft_vocab,
        save_every=args.save_every,
        seed=args.seed,
        bf16_autocast=args.bf16,
        ttt_steps=args.ttt_steps,
        ttt_decay=args.ttt_decay,
    )
    command = shlex.join(["ragspec"] + sys.argv[1:]) if sys.argv and sys.argv[0] else ""
    record = run_training(
        args.model,
        data,
        train,
        args.output,
        work_dir=args.work_dir,
        device=args.device,
        resume=args.resume,
        command=command,
        progress=not getattr(args, "quiet", False),
        init_head=args.init_head,
        generate_with=args.generate_with,
    )
    res = record["result"]
    print(
        f"wrote {args.output}: {res['steps']} steps ({res['epochs']:.1f} epochs) in {res['train_s']:.0f} s, "
        f"loss {res['first_loss']:.3f} -> {res['last_loss']:.3f}, validation top-1 "
        f"{res['val_start'].get('top1', float('nan')):.3f} -> {res['val_end'].get('top1', float('nan')):.3f} "
        f"(response tokens {res['val_end'].get('response_top1', float('nan')):.3f}); "
        f"{record['data']['num_tokens']} tokens of text, total {record['total_s']:.0f} s",
        file=sys.stderr,
    )
    return 0


def cmd_eagle_info(args) -> int:
    from ..eagle.head import read_head_config

    cfg = read_head_config(args.head)
    if args.json:
        print(json.dumps(cfg, indent=1))
        return 0
    t, a, tr = cfg["target"], cfg["architecture"], cfg.get("training", {})
    print(
        f"target: {t.get('name')} ({t.get('fingerprint')}), vocab {t.get('vocab_size')}, hidden {t.get('hidden_size')}"
    )
    print(
        f"head: one {a.get('layer_class')}, {a.get('num_parameters')} parameters, draft vocabulary {a.get('draft_vocab_size')}"
    )
    if tr:
        res = tr.get("result", {})
        print(f"trained by: {tr.get('command')}")
        print(
            f"data: {tr.get('data', {}).get('num_tokens')} tokens, {tr.get('data', {}).get('num_sequences')} sequences; "
            f"{res.get('steps')} steps; validation top-1 {res.get('val_end', {}).get('top1')}"
        )
    return 0


def cmd_eagle_bench(args) -> int:
    """``ragspec eagle bench``: :func:`ragspec.bench.eagle.run_eagle_bench`."""
    from ..bench.eagle import run_eagle_bench

    return run_eagle_bench(args)


def _add_train_command(sub) -> None:
    """``ragspec eagle train``: :func:`ragspec.training.run_training`'s options."""
    t = sub.add_parser("train", help="train a draft head by self-distillation (teacher-forced target features)")
    t.add_argument(
        "--model",
        default=os.environ.get("RAGSPEC_MODEL"),
        help="registry name, GGUF or HF folder (default model if omitted)",
    )
    t.add_argument("--data", nargs="+", default=None, help='JSONL files: Spec-Bench rows (turns) or {"text": ...} rows')
    t.add_argument("-o", "--output", required=True, help="output folder (head.safetensors + config.json)")
    t.add_argument("--work-dir", default=None, help="features cache and checkpoints (default OUTPUT/work)")
    t.add_argument("--epochs", type=int, default=8, help="passes over the training text (default 8)")
    t.add_argument("--max-steps", type=int, default=0, help="stop after this many optimiser steps (0 = no limit)")
    t.add_argument("--max-tokens", type=int, default=0, help="most tokens of text used (0 = all)")
    t.add_argument("--responses", type=int, default=64, help="prompts that get the target's greedy response appended")
    t.add_argument("--samples", type=int, default=0, help="extra sampled responses per such prompt")
    t.add_argument(
        "--sample-temperature", type=float, default=0.8, help="temperature of the sampled responses (default 0.8)"
    )
    t.add_argument("--response-tokens", type=int, default=128, help="longest generated response (default 128)")
    t.add_argument("--generation-batch", type=int, default=8, help="responses generated together (default 8)")
    t.add_argument("--holdout", type=int, default=5, help="first rows per category left out (the benchmark's)")
    t.add_argument("--batch-tokens", type=int, default=2048, help="tokens per optimiser step (default 2048)")
    t.add_argument("--lr", type=float, default=5e-4, help="learning rate (default 5e-4)")
    t.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head drafts from (0 = all)")
    t.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed of the training: initial weights, batch order, sampled responses (default 0)",
    )
    t.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the head's matmuls")
    t.add_argument(
        "--ttt-steps",
        type=int,
        default=1,
        help="EAGLE-3 training-time test: self-fed drafting steps unrolled per position (1 = EAGLE's one step)",
    )
    t.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight of unrolled step k: DECAY**k")
    t.add_argument(
        "--generate-with",
        choices=("engine", "hf"),
        default="engine",
        help="responses from ragspec's batched engine (default; --generation-batch requests per step) "
        "or from model.generate batches",
    )
    t.add_argument(
        "--init-head", default=None, help="head folder to start from (fine-tune; keeps its draft vocabulary)"
    )
    t.add_argument("--device", default=os.environ.get("RAGSPEC_DEVICE"), help="cpu or cuda")
    # -q/--quiet (no progress bars) is the global option (ragspec.cli.common.add_global_args)
    t.set_defaults(func=cmd_eagle_train)


def add_eagle_commands(subparsers) -> None:
    """Register ``ragspec eagle train|info|bench``."""
    e = subparsers.add_parser("eagle", help="train, inspect or benchmark an EAGLE draft head")
    esub = e.add_subparsers(dest="eagle_command", required=True)

    _add_train_command(esub)

    i = esub.add_parser("info", help="what a head was trained for, and how")
    i.add_argument("head", help="the head's folder")
    i.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    i.set_defaults(func=cmd_eagle_info)

    b = esub.add_parser("bench", help="ragspec bench for several drafter sets: head alone, prompt lookup, both")
    b.add_argument(
        "--drafters",
        default="pld,head,both",
        help="comma-separated drafter sets: pld, head, both (retrieval if its match >= --min-match, else the "
        "head), merged (one tree: retrieval, the head, retrieval's copies after the head's tokens), "
        "longest_match (CompositeDrafter's rule); SET=HEAD_DIR: that set with another head than --eagle's "
        "(e.g. head,head=my-head: two heads, interleaved)",
    )
    b.add_argument("--min-match", type=int, default=3, help="'both': retrieval wins from this match length")
    b.add_argument(
        "--eagle",
        default=os.environ.get("RAGSPEC_EAGLE") or "auto",
        help="EAGLE head directory, or 'auto' (default): the head shipped for the model",
    )
    b.add_argument("--depth", type=int, default=4, help="tokens the head drafts ahead per step (default 4)")
    b.add_argument("--top-k", type=int, default=3, help="tokens the head proposes at each position (default 3)")
    b.add_argument(
        "--model",
        default=os.environ.get("RAGSPEC_MODEL"),
        help="registry name, GGUF file or HF folder (default: smollm2-135m-instruct; RAGSPEC_MODEL)",
    )
    b.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present, else cpu)")
    b.add_argument("--dtype", default=None, help="fp32, bf16, fp16 (default: bf16 on cuda, fp32 on cpu)")
    b.add_argument("--data", default=DEFAULT_DATA, help=f"Spec-Bench prompts, a JSONL file (default {DEFAULT_DATA})")
    b.add_argument(
        "--categories",
        default=None,
        help="comma-separated categories (default: all); 'mt_bench' = the 8 MT-bench categories",
    )
    b.add_argument("--limit", type=int, default=5, help="prompts per category (default 5)")
    b.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    b.add_argument("--max-draft-tokens", type=int, default=8, help="most draft tokens verified per step (default 8)")
    b.add_argument("--fixed-draft", action="store_true", help="verify every proposed draft (no cost model)")
    b.add_argument(
        "--measure-latency",
        action="store_true",
        help="time the target at start-up (default: the engine's reference CPU table, refined online)",
    )
    b.add_argument("--no-hf-pld", action="store_true", help="accepted for symmetry with ragspec bench (never run here)")
    b.add_argument("--json", default=None, metavar="FILE", help="write every record and the tables to this JSON file")
    b.set_defaults(func=cmd_eagle_bench)
