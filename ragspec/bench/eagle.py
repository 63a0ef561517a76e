"""``ragspec eagle bench``: ``ragspec bench`` for several drafter sets at once (the EAGLE head
alone, prompt lookup alone, both, merged, longest match), interleaved prompt by prompt.

Its options are registered by :func:`ragspec.cli.eagle.add_eagle_commands`, which calls
:func:`run_eagle_bench`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

from ..errors import ConfigError
from ..specbench import load_prompts

__all__ = ["make_drafter", "run_eagle_bench"]


def make_drafter(kind: str, args, target, spec, pld):
    """The drafter set ``kind``, or ``kind=HEAD_DIR`` with another head than ``--eagle``'s."""
    from ..drafters import CompositeDrafter, MergedDrafter, SelectingDrafter
    from ..eagle.drafter import EagleTreeConfig
    from ..loading import load_eagle

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


def run_eagle_bench(args) -> int:
    """``ragspec bench`` for several drafter sets at once: the head alone, prompt lookup
    alone, both (retrieval first when its match is long, the head otherwise), merged (one
    tree from both, :class:`~ragspec.drafters.merged.MergedDrafter`), or the lead's
    ``longest_match`` composite. For each prompt, plain ``model.generate`` greedy
    runs once and every drafter set once, in rotating order, so that the load of a shared
    machine falls on all of them alike."""
    from .. import models
    from ..calibrate import measure_latency_model
    from ..config import PLDConfig, PolicyConfig
    from ..drafters import PromptLookupDrafter
    from ..loading import engine_with_drafter, load_target
    from . import runner

    kinds = [k.strip() for k in args.drafters.split(",") if k.strip()]
    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    rows = load_prompts(args.data, cats, args.limit, required=True)
    target, tok, spec = load_target(args.model, args.device, args.dtype)
    pld = PromptLookupDrafter(PLDConfig())
    # measuring on a loaded machine can give an absurd shape (q=2 six times q=1) that the
    # online refinement (one scale factor) never corrects; the reference table is the
    # default, and the refinement scales it to the machine
    latency = measure_latency_model(target) if args.measure_latency else None
    eos = models.eos_token_ids(target.model, tok)
    engines = {
        k: engine_with_drafter(
            target,
            tok,
            make_drafter(k, args, target, spec, pld),
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
                base = runner.hf_generate(target.model, ids, args.max_new_tokens, eos, do_sample=False)
                base_s = time.perf_counter() - t0
            else:
                results[name] = engines[name].generate(
                    ids, max_new_tokens=args.max_new_tokens, chat=False, return_steps=bool(args.json)
                )
        line = [f"  [{i + 1}/{len(rows)}] {row.get('category', ''):<14} base {len(base) / base_s:5.1f} tok/s"]
        for name in kinds:
            out = results[name]
            rec = runner.make_record(row, ids, base, base_s, out)
            records[name].append(rec)
            line.append(
                f"{name} {rec.ragspec_tokens / rec.ragspec_s:5.1f} tok/s acc {rec.mean_accepted:.2f}"
                f"{'' if rec.identical else ' DIFFERS@%d' % rec.first_diff}"
            )
        print("  ".join(line), file=sys.stderr, flush=True)
    tables = {}
    for name in kinds:
        tables[name] = runner.summarize(records[name])
        print(f"\n## {name}")
        print(runner.format_table(tables[name]))
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
