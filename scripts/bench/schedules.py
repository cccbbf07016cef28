"""Every registered schedule over a grid of pp, microbatches and costs: a table and a CSV.

Default grid: pp in 4, 8, 12, 16; microbatches 2p, 4p, 8p; cost sets 1,1,1,0 / 2,2.2,1.6,0.05 /
2,2,2,0.25 (per rank, as users give them).  All figures come from the simulator on the same
model, so makespans compare across schedules; "vs 1F1B" is makespan / 1F1B's makespan.

    python scripts/bench/schedules.py [--pp 4,8,12,16] [--factors 2,4,8] [--csv out/bench_schedules.csv]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

from megatron_vshape.cli import format_table
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Costs
from megatron_vshape.schedule.simulate import simulate

COST_SETS = ("1,1,1,0", "2,2.2,1.6,0.05", "2,2,2,0.25")
FIELDS = ("pp", "microbatches", "costs", "schedule", "bubble_rate", "span_bubble_rate", "peak_vs_1f1b", "makespan",
          "vs_1f1b", "generate_s", "error")


def _ints(text: str):
    return [int(x) for x in text.split(",") if x]


def run(pps, factors, cost_sets, budgets=()):
    rows = []
    for costs_text in cost_sets:
        costs = Costs.parse(costs_text)
        for pp in pps:
            for factor in factors:
                m = factor * pp
                group = []
                for name, budget in [(n, None) for n in registry.names() if n != "v-auto"] + [("v-auto", b) for b in budgets]:
                    row = dict(pp=pp, microbatches=m, costs=costs_text, schedule=name if budget is None else f"v-auto@{budget:g}")
                    t0 = time.perf_counter()
                    try:
                        options = {} if budget is None else {"memory_budget": budget}
                        schedule = registry.build(name, pp, m, costs, **options)
                    except ConfigError as exc:
                        row["error"] = str(exc).splitlines()[0]
                        group.append(row)
                        continue
                    row["generate_s"] = round(time.perf_counter() - t0, 3)
                    sim = simulate(schedule)
                    row.update(bubble_rate=sim.bubble_rate, span_bubble_rate=sim.span_bubble_rate,
                               peak_vs_1f1b=max(sim.peak_vs_1f1b), makespan=sim.makespan)
                    group.append(row)
                base = next((r["makespan"] for r in group if r["schedule"] == "1f1b" and "makespan" in r), None)
                for r in group:
                    if base and "makespan" in r:
                        r["vs_1f1b"] = r["makespan"] / base
                rows += group
    return rows


# (4, 96) and (16, 20): just under 3000 and 2000 ops, where v-auto also plans the named
# V-shape below its budget and short runs get the last improvement pass (the slowest plans);
# (4, 8) and (6, 6): up to 400 ops, where v-auto between the named budgets also runs relax()
# (and at (4, 8), budget 0.9, between V-Half's and V-ZB's, delay_search()); (4, 14): 336 ops,
# where relax() (0.7) and delay_search() (0.9) run on plans past 200 ops, the slowest short runs.
TIMING_SIZES = ((4, 8), (6, 6), (4, 14), (4, 32), (4, 96), (8, 64), (16, 20), (16, 48), (16, 128), (32, 256))


def machine_speed(additions: int = 10**7) -> float:
    """CPU seconds this interpreter takes for `additions` integer additions in a loop: the
    planner's work is fixed counts, so its times scale with this (on the 2-core machine the
    README's tables come from it went from 0.47 s to 0.30 s within one table)."""
    start, total = time.process_time(), 0
    for i in range(additions):
        total += i
    return time.process_time() - start


def timing() -> None:
    """CPU time of one plan (build + verify) per V schedule, each in a fresh cache; CPU time is
    this process's own cost (on a shared machine the wall clock also counts other work).  The
    machine's speed is measured before and after, since a shared machine's speed drifts."""
    from megatron_vshape.planner import search
    from megatron_vshape.planner.choose import fastest_within

    before = machine_speed()
    print("\nplanning time (build + verify, CPU seconds, one core; wall in brackets), costs 2,2.2,1.6,0.05:")
    names = ["v-min", "v-half", "v-zb", "v-auto@0.7", "v-auto@0.9", "v-auto@1.5", "auto@1.0"]
    table = []
    for pp, m in TIMING_SIZES:
        cells = [pp, m]
        for label in names:
            name, _, budget = label.partition("@")
            options = {"memory_budget": float(budget)} if budget else {}
            if name == "auto" and pp > 16:
                cells.append("-")  # 41 budget steps, one v-auto search each: minutes
                continue
            search._plan.cache_clear()
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                if name == "auto":  # --pipeline-schedule auto: every schedule, v-auto at each budget step
                    fastest_within(pp, m, Costs(2, 2.2, 1.6, 0.05), float(budget))
                else:
                    registry.build(name, pp, m, Costs(2, 2.2, 1.6, 0.05), **options)
                cells.append(f"{time.process_time() - cpu:.2f} ({time.perf_counter() - wall:.1f})")
            except ConfigError as exc:
                cells.append("cannot serve: " + str(exc).splitlines()[0][:40])
        table.append(cells)
    print(format_table(["pp", "m"] + names, table))
    print(f"machine speed: 10^7 additions in a Python loop took {before:.2f} s before the table and "
          f"{machine_speed():.2f} s after (times scale with it)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="4,8,12,16", help="comma-separated pipeline sizes (default 4,8,12,16)")
    ap.add_argument("--factors", default="2,4,8", help="microbatches = factor * pp (default 2,4,8)")
    ap.add_argument("--costs", default=";".join(COST_SETS), help="cost sets F,B,W,C separated by ';'")
    ap.add_argument("--csv", default="out/bench_schedules.csv", help="where to write the CSV")
    ap.add_argument("--budgets", default="", help="also v-auto at these memory budgets, e.g. 0.5,0.75,1.5")
    ap.add_argument("--timing", action="store_true",
                    help="also print the CPU time of planning each V schedule at pp 4..16, m <= 128 and pp=32, m=256")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    budgets = [float(b) for b in args.budgets.split(",") if b]
    rows = run(_ints(args.pp), _ints(args.factors), [c for c in args.costs.split(";") if c], budgets)
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)

    def pct(x):
        return "" if x is None else f"{100 * x:.2f}%"

    table = [
        [r["costs"], r["pp"], r["microbatches"], r["schedule"], pct(r.get("bubble_rate")), pct(r.get("span_bubble_rate")),
         "" if "peak_vs_1f1b" not in r else f"{r['peak_vs_1f1b']:.3f}",
         "" if "makespan" not in r else f"{r['makespan']:g}",
         "" if "vs_1f1b" not in r else f"{r['vs_1f1b']:.3f}", r.get("error", "")]
        for r in rows
    ]
    print(format_table(["costs", "pp", "m", "schedule", "bubble", "span bubble", "peak vs 1F1B", "makespan", "vs 1F1B", "note"], table))
    print(f"\n{len(rows)} rows in {time.perf_counter() - t0:.1f}s; CSV: {args.csv}", file=sys.stderr)
    if args.timing:
        timing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
