"""The planner against the exact reference on small instances: how far v-auto's plan is above
the optimum that OR-Tools CP-SAT proves (pip install '.[optimal]'), at every cap on the V from
V-Min's to 1F1B's.

Default grid: pp 2, 3, 4; microbatches p, 2p and 3p (at most 8); the three cost sets of
schedules.py.  Each budget is the smallest that gives its cap (one stage-activation per step);
--budgets plans at the given ones only.  Where the solver proves no optimum in the time limit,
its best schedule still bounds the optimum from above, so the gap against it is a lower bound on
the planner's true gap: the summary counts those instances too.

    python scripts/bench/optimality.py [--pp 2,3,4] [--microbatches 4,5,6,7,8] [--time-limit 40] [--work-limit 5]
                                       [--costs '1,2,1,0.1;3,2,2,1'] [--budgets 0.625]
                                       [--csv out/bench_optimality.csv]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

from megatron_vshape.cli import format_table
from megatron_vshape.planner import optimal, search
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Costs, stage_table
from megatron_vshape.schedule.simulate import simulate

COST_SETS = ("1,1,1,0", "2,2,2,0.25", "2,2.2,1.6,0.05")
FIELDS = ("pp", "microbatches", "costs", "budget", "cap", "planner", "optimum", "status", "gap", "plan_s")


def budgets(pp: int, m: int):
    """(budget, cap): for every cap from V-Min's to 1F1B's, the smallest budget giving it.
    Exact: a budget rounded for display (5/6 to 0.833333) falls below its step's cap."""
    return [(b, cap) for cap, b in search.budget_steps(pp, m, high=1.0)]


def rows(pps, limit: float, microbatches=(), cost_sets=COST_SETS, chosen=(), work_limit=None):
    for pp in pps:
        for m in microbatches or sorted({pp, 2 * pp, min(8, 3 * pp)}):
            for costs in cost_sets:
                steps = [(b, search.cap_of(pp, m, b)) for b in chosen] if chosen else budgets(pp, m)
                for budget, cap in steps:
                    search._plan.cache_clear()
                    t = time.process_time()
                    plan = registry.build("v-auto", pp, m, Costs.parse(costs), memory_budget=budget)
                    took = time.process_time() - t
                    result = optimal.solve(optimal.problem_of(plan), limit, hint=plan, work_limit=work_limit)
                    ms = simulate(plan).makespan
                    # No schedule within the limits ("unknown"): the best known is the planner's own.
                    best = ms if result.makespan is None else result.makespan
                    yield {"pp": pp, "microbatches": m, "costs": costs, "budget": round(budget, 6), "cap": cap,
                           "planner": round(ms, 6), "optimum": round(best, 6), "status": result.status,
                           "gap": ms / best - 1, "plan_s": round(took, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="2,3,4", help="comma-separated pipeline sizes (default 2,3,4)")
    ap.add_argument("--microbatches", default="", help="comma-separated microbatch counts for every pp "
                    "(default p, 2p and 3p up to 8)")
    ap.add_argument("--time-limit", type=float, default=40.0, help="solver seconds per instance (default 40)")
    ap.add_argument("--work-limit", type=float, default=None,
                    help="stop each solve after this much of CP-SAT's deterministic time, on one worker, so the "
                         "rows are the same on any machine (--time-limit then only guards the wall clock)")
    ap.add_argument("--costs", default=";".join(COST_SETS), help="semicolon-separated cost sets F,B,W,C "
                    "(per rank, as --costs elsewhere; default the three of schedules.py)")
    ap.add_argument("--budgets", default="", help="comma-separated memory budgets (fractions of 1F1B's activation "
                    "memory) to plan at, e.g. 0.625 (default: every cap from V-Min's to 1F1B's)")
    ap.add_argument("--csv", default="out/bench_optimality.csv", help="where to write the CSV")
    args = ap.parse_args(argv)
    optimal.require_ortools()
    done = []
    ms = [int(x) for x in args.microbatches.split(",") if x]
    if any(m < 1 for m in ms):
        ap.error(f"--microbatches {args.microbatches}: give positive counts, e.g. 4,5,6")
    cost_sets = [c.strip() for c in args.costs.split(";") if c.strip()]
    for c in cost_sets:
        try:
            Costs.parse(c)
        except ConfigError as exc:
            ap.error(str(exc))
    pps = [int(x) for x in args.pp.split(",") if x]
    try:
        chosen = [float(x) for x in args.budgets.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--budgets {args.budgets}: give comma-separated numbers, e.g. 0.625,0.75")
    for pp in pps:  # the planner's own checks, before any solver runs
        table = stage_table(Costs().per_stage(2), 2 * pp, None)
        for m in ms or [pp]:
            for b in chosen:
                try:
                    search.check_budget("--budgets", pp, m, b, table)
                except ConfigError as exc:
                    ap.error(str(exc))
    if args.work_limit is not None and not args.work_limit > 0:
        ap.error(f"--work-limit {args.work_limit:g}: give the solver's deterministic time, > 0 (e.g. 5)")
    for row in rows(pps, args.time_limit, ms, cost_sets, chosen, args.work_limit):
        done.append(row)
        print(f"pp={row['pp']} m={row['microbatches']} {row['costs']} budget {row['budget']:g}: planner "
              f"{row['planner']:g}, {row['status']} {row['optimum']:g}, gap {row['gap']:.2%}", flush=True)
    os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
    with open(args.csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(done)
    proven = [r for r in done if r["status"] == "optimal"]

    def summary(label, picked):
        gaps = sorted((r["gap"] for r in picked), reverse=True)
        return [label, len(picked), sum(g <= 1e-9 for g in gaps), sum(g > 0.02 for g in gaps),
                f"{sum(gaps) / max(1, len(gaps)):.3%}", f"{gaps[0]:.2%}" if gaps else "-"]
    print(format_table(["against", "instances", "at it", "above 2%", "mean gap", "max gap"],
                       [summary("proven optimum", proven), summary("solver's best, all", done)]))
    print(f"CSV: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
