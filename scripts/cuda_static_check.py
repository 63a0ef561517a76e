"""The CUDA backend's step, checked without a GPU: kernels per decoder layer of one step,
every Triton kernel compiled for Hopper (sm_90), and the host packing time of a step's rows.

    python scripts/cuda_static_check.py            # one line per figure
    python scripts/cuda_static_check.py --json     # {"kernels_per_layer": {"1": n, "17": n},
                                                   #  "sm90": {"compiled": n, "failed": n, "spilled": n},
                                                   #  "host_pack_ms": {"17": x, "65": y}}

Kernels are counted for one step of the default model's shapes (a dispatch-mode log of the
torch operators plus the Triton launches, on the ``meta`` device); the compile goes through
Triton's NVIDIA backend with a faked sm_90 target and ``ptxas -v`` (no GPU needed); host
packing is timed on this CPU (a quiet machine gives the meaningful figure). Needs torch,
transformers and triton (with its NVIDIA backend: the Linux wheels). Exit 1 when a kernel
fails to compile, spills registers, or compiles differently for another row count.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cuda_static_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--repeats", type=int, default=500, help="host packing: timed repeats (median)")
    args = p.parse_args(argv)

    from ragspec.bench.cuda_static import compile_for_hopper, count_step_kernels, host_pack_ms

    kernels = {str(rows): count_step_kernels(rows) for rows in (1, 17)}
    sm90 = compile_for_hopper()
    pack = {str(rows): round(host_pack_ms(rows, args.repeats), 4) for rows in (17, 65)}
    report = {
        "kernels_per_layer": {rows: k["per_layer"] for rows, k in kernels.items()},
        "sm90": {key: sm90[key] for key in ("compiled", "failed", "spilled")},
        "host_pack_ms": pack,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for rows, k in kernels.items():
            glue = ", ".join(k["torch_per_layer"]) or "no torch glue"
            print(f"kernels per layer at {rows} row(s): {k['per_layer']} ({k['triton_per_layer']} Triton, {glue}); "
                  f"{k['per_step']} per step of {k['layers']} layers")  # fmt: skip
        print(f"sm_90: {sm90['compiled']} kernels compiled, {sm90['failed']} failed, {sm90['spilled']} spilled")
        for k in sm90["kernels"]:
            detail = k["error"] or f"{k['registers']} registers, spills {k['spill_stores']}/{k['spill_loads']} bytes"
            print(f"  {k['name']:<24} {k['dtype']:<9} {detail}")
        if sm90["row_dependent"]:
            print(f"  compiled differently for another row count: {', '.join(sm90['row_dependent'])}")
        print(f"host packing: {pack['17']:.3f} ms for 17 rows, {pack['65']:.3f} ms for 65 rows (median, this CPU)")
    bad = sm90["failed"] or sm90["spilled"] or sm90["row_dependent"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
