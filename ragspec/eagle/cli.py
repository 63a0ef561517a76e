"""``ragspec eagle ...``: train, inspect and benchmark EAGLE draft heads.

Registered by :func:`ragspec.cli.build_parser` through :func:`add_eagle_commands`.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from ..errors import ConfigError

DEFAULT_DATA = "../shared/data/specbench-dev.jsonl"


def cmd_eagle_train(args) -> int:
    from .train import DataConfig, TrainConfig, run_training

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
        progress=not args.quiet,
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
    from .head import read_head_config

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


def _make_drafter(kind: str, args, target, spec, pld):
    """The drafter set ``kind``, or ``kind=HEAD_DIR`` with another head than ``--eagle``'s."""
    from ..drafters import CompositeDrafter, MergedDrafter, SelectingDrafter
    from ..loading import load_eagle
    from .drafter import EagleTreeConfig

    kind, _, head_dir = kind.partition("=")
    if kind == "pld":
        return pld
    eagle, _ = load_eagle(
        head_dir or args.eagle or "auto", target, spec, EagleTreeConfig(depth=args.depth, top_k=args.top_k)
    )
    if eagle is None:
        raise ConfigError(f"--drafters {kind} needs an EAGLE head: --eagle DIR (none ships for this model)")
    if kind == "head":
        return eagle
    if kind == "both":
        return SelectingDrafter(pld, eagle, min_match=args.min_match)
    if kind == "merged":
        return MergedDrafter(pld, eagle)
    if kind == "longest_match":
        return CompositeDrafter([pld, eagle], mode="longest_match")
    raise ConfigError(f"unknown drafter set {kind!r} (head, pld, both, merged, longest_match)")


def cmd_eagle_bench(args) -> int:
    """``ragspec bench`` for several drafter sets at once: the head alone, prompt lookup
    alone, both (retrieval first when its match is long, the head otherwise), merged (one
    tree from both, :class:`~ragspec.drafters.merged.MergedDrafter`), or the lead's
    ``longest_match`` composite. For each prompt, plain ``model.generate`` greedy
    runs once and every drafter set once, in rotating order, so that the load of a shared
    machine falls on all of them alike."""
    import copy
    import dataclasses
    import time

    from .. import bench, models
    from ..config import PLDConfig, PolicyConfig
    from ..drafters import PromptLookupDrafter
    from ..loading import engine_with_drafter, load_target
    from ..policy import LatencyModel

    kinds = [k.strip() for k in args.drafters.split(",") if k.strip()]
    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    rows = bench.load_prompts(args.data, cats, args.limit, required=True)
    target, tok, spec = load_target(args.model, args.device, args.dtype)
    pld = PromptLookupDrafter(PLDConfig())
    # measuring on a loaded machine can give an absurd shape (q=2 six times q=1) that the
    # online refinement (one scale factor) never corrects; the reference table is the
    # default, and the refinement scales it to the machine
    latency = LatencyModel.measure(target) if args.measure_latency else None
    eos = models.eos_token_ids(target.model, tok)
    engines = {
        k: engine_with_drafter(
            target,
            tok,
            _make_drafter(k, args, target, spec, pld),
            policy=PolicyConfig(max_draft_tokens=args.max_draft_tokens, adaptive=not args.fixed_draft),
            latency=copy.deepcopy(latency) if latency is not None else None,
            eos_token_ids=eos,
            model_name=spec.name,
        )
        for k in kinds
    }
    print(
        f"# {len(rows)} prompts, drafter sets {kinds}, max_new_tokens {args.max_new_tokens}, eagle {args.eagle}, "
        f"depth {args.depth} top-k {args.top_k} min-match {args.min_match}",
        file=sys.stderr,
    )
    records: dict[str, list] = {k: [] for k in kinds}
    for i, row in enumerate(rows):
        ids = engines[kinds[0]].encode_prompt(row["turns"][0], chat=True)
        order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
        results = {}
        steps = ["baseline"] + order if i % 2 == 0 else order + ["baseline"]
        for name in steps:
            if name == "baseline":
                t0 = time.perf_counter()
                base = bench._hf_generate(target.model, ids, args.max_new_tokens, eos, do_sample=False)
                base_s = time.perf_counter() - t0
            else:
                results[name] = engines[name].generate(
                    ids, max_new_tokens=args.max_new_tokens, chat=False, return_steps=bool(args.json)
                )
        line = [f"  [{i + 1}/{len(rows)}] {row.get('category', ''):<14} base {len(base) / base_s:5.1f} tok/s"]
        for name in kinds:
            out = results[name]
            rec = bench.make_record(row, ids, base, base_s, out)
            records[name].append(rec)
            line.append(
                f"{name} {rec.ragspec_tokens / rec.ragspec_s:5.1f} tok/s acc {rec.mean_accepted:.2f}"
                f"{'' if rec.identical else ' DIFFERS@%d' % rec.first_diff}"
            )
        print("  ".join(line), file=sys.stderr, flush=True)
    tables = {}
    for name in kinds:
        tables[name] = bench.summarize(records[name])
        print(f"\n## {name}")
        print(bench.format_table(tables[name]))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "settings": {k: v for k, v in vars(args).items() if k != "func"},
                    "latency_ms": {q: v * 1e3 for q, v in engines[kinds[0]].latency.table.items()},
                    "summary": tables,
                    "records": {k: [dataclasses.asdict(r) for r in v] for k, v in records.items()},
                },
                indent=1,
                default=str,
            )
        )
        print(f"# wrote {args.json}", file=sys.stderr)
    return 0


def add_eagle_commands(subparsers) -> None:
    """Register ``ragspec eagle train|info|bench``."""
    e = subparsers.add_parser("eagle", help="train, inspect or benchmark an EAGLE draft head")
    esub = e.add_subparsers(dest="eagle_command", required=True)

    t = esub.add_parser("train", help="train a draft head by self-distillation (teacher-forced target features)")
    t.add_argument(
        "--model",
        default=os.environ.get("RAGSPEC_MODEL"),
        help="registry name, GGUF or HF folder (default model if omitted)",
    )
    t.add_argument("--data", nargs="+", default=None, help='JSONL files: Spec-Bench rows (turns) or {"text": ...} rows')
    t.add_argument("-o", "--output", required=True, help="output folder (head.safetensors + config.json)")
    t.add_argument("--work-dir", default=None, help="features cache and checkpoints (default OUTPUT/work)")
    t.add_argument("--epochs", type=int, default=8)
    t.add_argument("--max-steps", type=int, default=0, help="stop after this many optimiser steps (0 = no limit)")
    t.add_argument("--max-tokens", type=int, default=0, help="most tokens of text used (0 = all)")
    t.add_argument("--responses", type=int, default=64, help="prompts that get the target's greedy response appended")
    t.add_argument("--samples", type=int, default=0, help="extra sampled responses per such prompt")
    t.add_argument("--sample-temperature", type=float, default=0.8)
    t.add_argument("--response-tokens", type=int, default=128)
    t.add_argument("--generation-batch", type=int, default=8)
    t.add_argument("--holdout", type=int, default=5, help="first rows per category left out (the benchmark's)")
    t.add_argument("--batch-tokens", type=int, default=2048)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head drafts from (0 = all)")
    t.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument("--seed", type=int, default=0)
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
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_eagle_train)

    i = esub.add_parser("info", help="what a head was trained for, and how")
    i.add_argument("head")
    i.add_argument("--json", action="store_true")
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
    b.add_argument("--depth", type=int, default=4)
    b.add_argument("--top-k", type=int, default=3)
    b.add_argument("--model", default=os.environ.get("RAGSPEC_MODEL"))
    b.add_argument("--device", default=None)
    b.add_argument("--dtype", default=None)
    b.add_argument("--data", default=DEFAULT_DATA)
    b.add_argument("--categories", default=None)
    b.add_argument("--limit", type=int, default=5)
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--max-draft-tokens", type=int, default=8)
    b.add_argument("--fixed-draft", action="store_true")
    b.add_argument(
        "--measure-latency",
        action="store_true",
        help="time the target at start-up (default: the engine's reference CPU table, refined online)",
    )
    b.add_argument("--no-hf-pld", action="store_true", help="accepted for symmetry with ragspec bench (never run here)")
    b.add_argument("--json", default=None)
    b.set_defaults(func=cmd_eagle_bench)
