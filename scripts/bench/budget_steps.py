"""v-auto at every cap level: is a larger budget ever slower?  One plan per level (the smallest
budget that gives each cap from V-Min's to --high of 1F1B's), each in a fresh cache, so its
CPU time is what one call costs; a "slower step" is a level whose plan is longer than the one
below it (there must be none).

Default scan: pp 4, 6, 8, 12, 16; microbatches p, 2p and 4p (at most --max-m); the three cost
sets of schedules.py.

    python scripts/bench/budget_steps.py [--pp 4,8] [--factors 1,2,4] [--max-m 64] [--high 1.0]
                                         [--costs '2,2.2,1.6,0.05'] [--csv out/budget_steps.csv]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

from megatron_vshape.cli import format_table
from megatron_vshape.planner import search
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Costs
from megatron_vshape.schedule.simulate import simulate

COST_SETS = ("1,1,1,0", "2,2.2,1.6,0.05", "2,2,2,0.25")
FIELDS = ("pp", "microbatches", "costs", "cap", "budget", "makespan", "peak", "cpu_s")


def scan(pp: int, m: int, costs_text: str, high: float):
    """One row per cap level: the plan at the smallest budget giving it, built cold."""
    for cap, budget in search.budget_steps(pp, m, high=high):
        search._plan.cache_clear()
        t = time.process_time()
        try:
            s = registry.build("v-auto", pp, m, Costs.parse(costs_text), memory_budget=budget)
        except ConfigError:
            continue  # too few microbatches for this cap
        took = time.process_time() - t
        sim = simulate(s)
        yield {"pp": pp, "microbatches": m, "costs": costs_text, "cap": cap, "budget": round(budget, 6),
               "makespan": round(sim.makespan, 6), "peak": max(sim.peak_activations), "cpu_s": round(took, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="4,6,8,12,16")
    ap.add_argument("--factors", default="1,2,4", help="microbatches = factor * pp")
    ap.add_argument("--max-m", type=int, default=64)
    ap.add_argument("--high", type=float, default=1.0, help="the largest budget scanned (up to 2.0)")
    ap.add_argument("--costs", default=";".join(COST_SETS))
    ap.add_argument("--csv", default="out/budget_steps.csv")
    args = ap.parse_args(argv)
    if not 0 < args.high <= search.MAX_BUDGET:
        ap.error(f"--high {args.high:g} is outside (0, {search.MAX_BUDGET:g}]; give a budget v-auto serves, e.g. 1.0")
    ints = lambda t: [int(x) for x in t.split(",") if x]  # noqa: E731
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    table, steps, slower, times = [], 0, [], []
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for costs in [c for c in args.costs.split(";") if c]:
            for pp in ints(args.pp):
                for m in sorted({min(k * pp, args.max_m) for k in ints(args.factors)}):
                    rows = list(scan(pp, m, costs, args.high))
                    writer.writerows(rows)
                    f.flush()
                    worse = [(a, b) for a, b in zip(rows, rows[1:]) if b["makespan"] > a["makespan"] + 1e-9]
                    steps += max(0, len(rows) - 1)
                    slower += worse
                    times += [r["cpu_s"] for r in rows]
                    table.append([costs, pp, m, len(rows), " ".join(f"{r['makespan']:g}" for r in rows), len(worse),
                                  f"{max((r['cpu_s'] for r in rows), default=0):.2f}"])
                    print(*table[-1], sep="  ", file=sys.stderr, flush=True)
    print(format_table(["costs", "pp", "m", "levels", "makespan at each cap, smallest first", "slower", "max cpu s"], table))
    for a, b in slower:
        print(f"slower: pp={a['pp']} m={a['microbatches']} {a['costs']}: cap {a['cap']} -> {b['cap']}: "
              f"{a['makespan']:g} -> {b['makespan']:g}")
    print(f"\n{steps} steps, {len(slower)} slower; planning time per call: max {max(times, default=0):.2f} s, "
          f"mean {sum(times) / max(1, len(times)):.2f} s (CPU); CSV: {args.csv}")
    return 0 if not slower else 1


if __name__ == "__main__":
    sys.exit(main())
