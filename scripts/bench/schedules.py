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


def run(pps, factors, cost_sets):
    rows = []
    for costs_text in cost_sets:
        costs = Costs.parse(costs_text)
        for pp in pps:
            for factor in factors:
                m = factor * pp
                group = []
                for name in registry.names():
                    row = dict(pp=pp, microbatches=m, costs=costs_text, schedule=name)
                    t0 = time.perf_counter()
                    try:
                        schedule = registry.build(name, pp, m, costs)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="4,8,12,16", help="comma-separated pipeline sizes (default 4,8,12,16)")
    ap.add_argument("--factors", default="2,4,8", help="microbatches = factor * pp (default 2,4,8)")
    ap.add_argument("--costs", default=";".join(COST_SETS), help="cost sets F,B,W,C separated by ';'")
    ap.add_argument("--csv", default="out/bench_schedules.csv", help="where to write the CSV")
    ap.add_argument("--timing", action="store_true", help="also time generating each schedule at pp=32, m=256")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = run(_ints(args.pp), _ints(args.factors), [c for c in args.costs.split(";") if c])
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
        # CPU time is this process's own cost; wall time also counts whatever else the machine runs.
        print("\ngeneration time (build + verify) at pp=32, microbatches=256, unit costs:")
        for name in registry.names():
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                registry.build(name, 32, 256)
                print(f"  {name:18s} cpu {time.process_time() - cpu:.3f}s  wall {time.perf_counter() - wall:.3f}s")
            except ConfigError as exc:
                print(f"  {name:18s} cannot serve: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
