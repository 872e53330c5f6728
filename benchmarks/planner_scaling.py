"""Planning time of the budget planner for chains of 10 to 1000 stages.

Random but reproducible stage costs (a transformer-like mix of wide and narrow stages),
budgets between the smallest feasible peak and the unwrapped peak.

    python benchmarks/planner_scaling.py [--sizes 10 100 300 1000]
"""

from __future__ import annotations

import argparse
import random
import time

from autockpt.plan import Segment
from autockpt.planners import PlanRequest, StageCost, get_planner, run_planner
from autockpt.planners.budget import min_feasible_budget
from autockpt.planners.cost_model import predict


def costs(n: int, seed: int = 0) -> tuple[StageCost, ...]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        width = rng.choice([1, 1, 4])
        out.append(
            StageCost(
                fwd_ms=rng.uniform(0.5, 2.0) * width,
                bwd_ms=rng.uniform(1.0, 4.0) * width,
                in_bytes=2**20,
                out_bytes=2**20,
                kept_bytes=width * 2**20,
                keeps_input=True,
                keeps_output=rng.random() < 0.3,
                fwd_peak_bytes=(width + 1) * 2**20,
                bwd_peak_bytes=2 * width * 2**20,
                grad_bytes=2**16,
            )
        )
    return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 30, 100, 300, 1000])
    args = parser.parse_args()
    planner = get_planner("budget", where="benchmark")
    print(
        "| stages | budget: floor + f x (unwrapped - floor), f | plan seconds | checkpointed segments "
        "| predicted recompute ms |"
    )
    print("|---|---|---|---|---|")
    for n in args.sizes:
        c = costs(n)
        unwrapped = predict((Segment(0, n, False),), c).peak_bytes
        floor = min_feasible_budget(c)
        for fraction in (0.5, 0.1):
            budget = int(floor + fraction * (unwrapped - floor))
            request = PlanRequest(stage_names=tuple(map(str, range(n))), costs=c, budget_bytes=budget)
            t0 = time.perf_counter()
            segments = run_planner(planner, request, where="benchmark")
            seconds = time.perf_counter() - t0
            ck = sum(s.checkpoint for s in segments)
            print(
                f"| {n} | {fraction} | {seconds:.3f} | {ck} | {predict(segments, c).recompute_ms:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
