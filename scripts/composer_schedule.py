"""Print the decode groups the step composer would choose for a queue of equal requests on
measured costs, beside one-after-another and all-at-once (each simulated on the same cost
model: completions, median, wall).

Example (a 2-core CPU's measured table, ms per forward of q rows; 8 prompts of 700
tokens, 113 tokens each at 1.5 per step)::

    python scripts/composer_schedule.py --table 1:3.9,2:5.0,3:5.6,4:6.4,6:8.5,8:10.5,12:15.7,16:20.2 \\
        --prefill-ms-per-token 0.85 --per-request-ms 1.0 --requests 8 --prompt 700 --tokens 113
"""

from __future__ import annotations

import argparse
import statistics

from ragspec.grouping import Schedule, StepCosts, Task, all_at_once, one_after_another, plan_groups, simulate
from ragspec.policy import LatencyModel


def _table(text: str) -> dict[int, float]:
    pairs = (item.split(":") for item in text.split(",") if item)
    return {int(q): float(ms) / 1e3 for q, ms in pairs}


def _line(name: str, s: Schedule) -> str:
    done = sorted(s.completion_s)
    sizes = "+".join(map(str, s.sizes))
    return (
        f"{name:<18} groups {sizes:<16} median {statistics.median(done):6.2f} s  mean {statistics.fmean(done):6.2f} s"
        f"  wall {s.makespan_s:6.2f} s  completions {' '.join(f'{c:.2f}' for c in done)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", required=True, help="q:ms,... seconds of a forward of q rows (one request), in ms")
    ap.add_argument("--prefill-ms-per-token", type=float, required=True, help="ms per prompt token of a prefill")
    ap.add_argument("--per-request-ms", type=float, default=0.0, help="ms a request adds to a step beyond its rows")
    ap.add_argument("--requests", type=int, default=8, help="waiting requests (equal)")
    ap.add_argument("--prompt", type=int, default=700, help="prompt tokens each")
    ap.add_argument("--tokens", type=int, default=113, help="tokens each generates")
    ap.add_argument("--tokens-per-step", type=float, default=1.5, help="tokens a decode step commits")
    ap.add_argument("--rows", type=int, default=2, help="verification rows per decode step")
    ap.add_argument("--chunk", type=int, default=256, help="prompt tokens per prefill chunk")
    ap.add_argument("--slack", type=float, default=0.05, help="throughput slack (negative: no bound)")
    args = ap.parse_args()
    latency = LatencyModel(_table(args.table), ema=0.0)
    costs = StepCosts.linear(latency, args.prefill_ms_per_token / 1e3, args.per_request_ms / 1e3)
    steps = max(0, args.tokens - 1) / args.tokens_per_step
    queue = [Task(args.prompt, args.chunk, steps, args.rows) for _ in range(args.requests)]
    n = len(queue)
    print(_line("one after another", simulate(costs, [], queue, one_after_another(n))))
    print(_line("all at once", simulate(costs, [], queue, all_at_once(n))))
    print(_line("chosen", plan_groups(costs, [], queue, slack=None if args.slack < 0 else args.slack)))


if __name__ == "__main__":
    main()
