"""v-auto at every cap level: is a larger budget ever slower?  One plan per level (the smallest
budget that gives each cap from V-Min's to --high of 1F1B's), each in a fresh cache, so its
CPU time is what one call costs; a "slower step" is a level whose plan is longer than the one
below it (there must be none).

Default scan: pp 4, 6, 8, 12, 16; microbatches p, 2p and 4p (at most --max-m); the three cost
sets of schedules.py.

    python scripts/bench/budget_steps.py [--pp 4,8] [--factors 1,2,4] [--max-m 64] [--high 1.0]
                                         [--costs '2,2.2,1.6,0.05'] [--csv out/budget_steps.csv]
                                         [--ends 1.2x1.25,1.6x1.5] [--jobs 2]

--ends EMB,LOSS gives the first stage (the embedding's) and the last (the output layer's and
the loss's) unequal costs and activation sizes, as FACTORxSIZE: their F, B and W the per-stage
costs times FACTOR, their activations SIZE plain ones (both stages sit on rank 0 of the V).
Caps are then not whole numbers of activations, so the budgets go in quarters of one.
--jobs N scans N (costs, pp, m) at a time in as many processes: the same rows (each plan's CPU
time is still its own process's).

--auto scans what `--pipeline-schedule auto` and `compare --memory-budget` pick at each level
instead (choose.fastest_within: every schedule, v-auto at each budget step up to the level): one
plan cache per (costs, pp, m), so a level's CPU time is only the plans it adds.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from typing import List, Optional, Tuple

from megatron_vshape.cli import format_table
from megatron_vshape.planner import search
from megatron_vshape.planner.choose import fastest_within
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Costs, StageCost
from megatron_vshape.schedule.simulate import one_f_one_b_peak
from megatron_vshape.schedule.simulate import simulate
from parallel import check_jobs, in_processes  # scripts/bench/parallel.py, beside this script

COST_SETS = ("1,1,1,0", "2,2.2,1.6,0.05", "2,2,2,0.25")
FIELDS = ("pp", "microbatches", "costs", "cap", "budget", "makespan", "peak", "cpu_s")


def heavy_ends(pp: int, costs: Costs, ends: str) -> Optional[List[StageCost]]:
    """The V's 2p stage costs with --ends' first and last stage (None without --ends)."""
    if not ends:
        return None
    (f0, s0), (f1, s1) = [(float(a), float(b)) for a, b in (e.split("x") for e in ends.split(","))]
    plain = costs.per_stage(2)
    scale = [(f0, s0)] + [(1.0, 1.0)] * (2 * pp - 2) + [(f1, s1)]
    return [StageCost(plain.F * f, plain.B * f, plain.W * f, size) for f, size in scale]


def levels(pp: int, m: int, high: float, fractional: bool) -> List[Tuple[float, float]]:
    """(cap, budget) from V-Min's budget to `high`: every whole cap, or every quarter of a
    stage-activation where the sizes make caps fractional."""
    if not fractional:
        return search.budget_steps(pp, m, high=high)
    unit = 2 * one_f_one_b_peak(pp, m)
    low = search.min_budget(pp)
    return [(low * unit + k / 4, low + k / (4 * unit)) for k in range(int((high - low) * unit * 4 + 1e-9) + 1)]


def scan(pp: int, m: int, costs_text: str, high: float, ends: str = "", auto: bool = False):
    """One row per cap level: the plan at the smallest budget giving it, built cold (with `auto`,
    what fastest_within picks there, the cache kept across the scan's levels)."""
    costs = Costs.parse(costs_text)
    stage_costs = heavy_ends(pp, costs, ends)
    search._plan.cache_clear()
    for cap, budget in levels(pp, m, high, stage_costs is not None):
        if not auto:
            search._plan.cache_clear()
        t = time.process_time()
        try:
            if auto:
                s, _ = fastest_within(pp, m, costs, budget, stage_costs)
            else:
                s = registry.build("v-auto", pp, m, costs, memory_budget=budget, stage_costs=stage_costs)
        except ConfigError:
            continue  # too few microbatches for this cap
        took = time.process_time() - t
        sim = simulate(s)
        yield {"pp": pp, "microbatches": m, "costs": costs_text, "cap": cap, "budget": round(budget, 6),
               "makespan": round(sim.makespan, 6), "peak": max(sim.peak_activations), "cpu_s": round(took, 2)}


def _scanned(point) -> list:
    """scan() of one (costs, pp, m, high, ends, auto), whole: the unit --jobs hands a process."""
    costs, pp, m, high, ends, auto = point
    return list(scan(pp, m, costs, high, ends, auto))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="4,6,8,12,16")
    ap.add_argument("--factors", default="1,2,4", help="microbatches = factor * pp")
    ap.add_argument("--max-m", type=int, default=64)
    ap.add_argument("--high", type=float, default=1.0, help="the largest budget scanned (up to 2.0)")
    ap.add_argument("--costs", default=";".join(COST_SETS))
    ap.add_argument("--csv", default="out/budget_steps.csv")
    ap.add_argument("--ends", default="", help="the first and last stage as FACTORxSIZE,FACTORxSIZE (e.g. 1.2x1.25,1.6x1.5)")
    ap.add_argument("--jobs", type=int, default=1, help="scans run at a time, one process each (the same rows)")
    ap.add_argument("--auto", action="store_true", help="scan what --pipeline-schedule auto picks, not v-auto alone")
    args = ap.parse_args(argv)
    check_jobs(ap, args.jobs)
    if not 0 < args.high <= search.MAX_BUDGET:
        ap.error(f"--high {args.high:g} is outside (0, {search.MAX_BUDGET:g}]; give a budget v-auto serves, e.g. 1.0")
    try:
        heavy_ends(4, Costs(), args.ends)
    except (ValueError, ConfigError):
        ap.error(f"--ends {args.ends!r}: give the first and last stage as FACTORxSIZE,FACTORxSIZE, e.g. 1.2x1.25,1.6x1.5")
    ints = lambda t: [int(x) for x in t.split(",") if x]  # noqa: E731
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    table, steps, slower, times = [], 0, [], []
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        points = [(costs, pp, m, args.high, args.ends, args.auto) for costs in [c for c in args.costs.split(";") if c]
                  for pp in ints(args.pp) for m in sorted({min(k * pp, args.max_m) for k in ints(args.factors)})]
        for (costs, pp, m, _, _, _), rows in zip(points, in_processes(_scanned, points, args.jobs)):
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
