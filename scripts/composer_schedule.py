"""Print the decode groups the step composer would choose for a queue of requests on
measured costs, beside one-after-another and all-at-once (each simulated on the same cost
model: completions, median, P95 as ``ragspec bench --serve`` computes them, wall), and,
with ``--best-median``, the cut of the queue with the lowest median among those within the
throughput bound (what a scheduler aimed at the median itself would pick).

Example (a 2-core CPU's measured table, ms per forward of q rows; 8 prompts of 700
tokens, 113 tokens each at 1.5 per step)::

    python scripts/composer_schedule.py --table 1:3.9,2:5.0,3:5.6,4:6.4,6:8.5,8:10.5,12:15.7,16:20.2 \\
        --prefill-ms-per-token 0.85 --per-request-ms 1.0 --requests 8 --prompt 700 --tokens 113

A mix of requests (each its prompt tokens and the tokens it generates), ordered least work
first, with the cut a median-aimed scheduler would pick::

    python scripts/composer_schedule.py --table ... --prefill-ms-per-token 0.85 --per-request-ms 1.0 \\
        --prompts 660,789,729,725,769,611,449,725 --outputs 128,128,43,97,124,128,128,128 --best-median
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Optional, Sequence

from ragspec.grouping import Schedule, StepCosts, Task, all_at_once, one_after_another, plan_groups, simulate
from ragspec.policy import LatencyModel
from ragspec.scheduling import ComposerConfig


def _table(text: str) -> dict[int, float]:
    """``q:ms,...`` -> {q: seconds}; ValueError on anything else."""
    table = {}
    for item in (i for i in text.split(",") if i):
        q, sep, ms = item.partition(":")
        if not sep:
            raise ValueError(f"{item!r} is not q:ms")
        table[int(q)] = float(ms) / 1e3
    if not table or any(q < 1 or not math.isfinite(s) or s <= 0 for q, s in table.items()):
        raise ValueError("needs q >= 1 and finite ms > 0")
    return table


def _ints(text: Optional[str]) -> Optional[list[int]]:
    return None if text is None else [int(v) for v in text.split(",") if v]


def _quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (as ``ragspec bench
    --serve`` reports P50 and P95); q in (0, 1) with two decimals."""
    if len(values) < 2:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _line(name: str, s: Schedule, ref: Optional[Schedule] = None) -> str:
    done = s.completion_s
    sizes = "+".join(map(str, s.sizes))
    med, p95 = _quantile(done, 0.5), _quantile(done, 0.95)
    text = (
        f"{name:<18} groups {sizes:<16} median {med:6.2f} s  P95 {p95:6.2f} s  mean {statistics.fmean(done):6.2f} s"
        f"  wall {s.makespan_s:6.2f} s"
    )
    if ref is not None:
        text += (
            f"  (x all at once: median {med / _quantile(ref.completion_s, 0.5):.3f},"
            f" P95 {p95 / _quantile(ref.completion_s, 0.95):.3f}, wall {s.makespan_s / ref.makespan_s:.3f})"
        )
    return text + f"  completions {' '.join(f'{c:.2f}' for c in sorted(done))}"


def _cuts(n: int):
    """Every cut of n queue positions into consecutive non-empty groups."""
    for mask in range(1 << (n - 1)):
        groups, current = [], [0]
        for i in range(1, n):
            if mask >> (i - 1) & 1:
                groups.append(tuple(current))
                current = [i]
            else:
                current.append(i)
        groups.append(tuple(current))
        yield groups


def best_median(costs: StepCosts, queue: Sequence[Task], bound_s: float) -> Optional[Schedule]:
    """The cut of ``queue`` of least median completion among those ending within
    ``bound_s`` seconds (exhaustive: 2^(n-1) cuts; None: none does)."""
    best: Optional[Schedule] = None
    for groups in _cuts(len(queue)):
        s = simulate(costs, [], queue, groups)
        if s.makespan_s <= bound_s and (
            best is None or _quantile(s.completion_s, 0.5) < _quantile(best.completion_s, 0.5)
        ):
            best = s
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", required=True, help="q:ms,... milliseconds of a forward of q rows (one request)")
    ap.add_argument("--prefill-ms-per-token", type=float, required=True, help="ms per prompt token of a prefill")
    ap.add_argument("--per-request-ms", type=float, default=0.0, help="ms a request adds to a step beyond its rows")
    ap.add_argument("--requests", type=int, default=8, help="waiting requests (equal; without --prompts)")
    ap.add_argument("--prompt", type=int, default=700, help="prompt tokens each (without --prompts)")
    ap.add_argument("--tokens", type=int, default=113, help="tokens each generates (without --outputs)")
    ap.add_argument("--prompts", default=None, help="comma-separated prompt tokens of each request (a mix)")
    ap.add_argument("--outputs", default=None, help="comma-separated tokens each request generates (with --prompts)")
    ap.add_argument("--tokens-per-step", type=float, default=1.5, help="tokens a decode step commits")
    ap.add_argument("--rows", type=int, default=2, help="verification rows per decode step")
    ap.add_argument("--chunk", type=int, default=256, help="prompt tokens per prefill chunk")
    ap.add_argument(
        "--slack",
        type=float,
        default=ComposerConfig.throughput_slack,
        help=f"throughput slack, as ragspec serve --throughput-slack (default {ComposerConfig.throughput_slack}; "
        "negative: no bound)",
    )
    ap.add_argument("--best-median", action="store_true", help="also the least-median cut within the bound")
    args = ap.parse_args()
    try:
        table = _table(args.table)
        prompts = _ints(args.prompts) or [args.prompt] * args.requests
        outputs = _ints(args.outputs) or [args.tokens] * len(prompts)
    except ValueError as e:
        ap.error(f"--table / --prompts / --outputs: {e}")
    if len(outputs) != len(prompts):
        ap.error(f"--outputs gives {len(outputs)} requests, --prompts {len(prompts)}")
    if not math.isfinite(args.slack):
        ap.error(f"--slack must be a finite number, got {args.slack}")
    if not prompts or min(prompts) < 1 or min(outputs) < 1 or args.tokens_per_step <= 0 or args.rows < 1:
        ap.error("requests need prompt and output tokens >= 1, --tokens-per-step > 0, --rows >= 1")
    latency = LatencyModel(table, ema=0.0)
    costs = StepCosts.linear(latency, args.prefill_ms_per_token / 1e3, args.per_request_ms / 1e3)
    spt, pt = args.tokens_per_step, args.prefill_ms_per_token / 1e3
    # least work first, as the composer orders its queue (here with the outputs known)
    order = sorted(range(len(prompts)), key=lambda i: prompts[i] * pt + outputs[i] / spt * latency(args.rows))
    queue = [Task(prompts[i], args.chunk, max(0, outputs[i] - 1) / spt, args.rows) for i in order]
    n = len(queue)
    slack = None if args.slack < 0 else args.slack
    print(f"{n} requests, least work first; throughput slack {'none' if slack is None else slack}")
    ref = simulate(costs, [], queue, all_at_once(n))
    print(_line("one after another", simulate(costs, [], queue, one_after_another(n)), ref))
    print(_line("all at once", ref))
    print(_line("chosen", plan_groups(costs, [], queue, slack=slack), ref))
    if args.best_median:
        bound = ref.makespan_s * (1 + slack) if slack is not None else float("inf")
        best = best_median(costs, queue, bound)
        print(_line("least median", best, ref) if best is not None else "least median       none within the bound")


if __name__ == "__main__":
    main()
