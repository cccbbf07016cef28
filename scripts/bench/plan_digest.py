"""A digest of every V plan over a grid: makespan, peak and a hash of the op lists, one line
per plan, so that a change meant to keep plans identical (a refactor of the planner) can be
checked by diffing two runs.

Default grid: schedules.py's (pp 4, 8, 12, 16; microbatches 2p, 4p, 8p; its three cost
sets), v-min, v-half, v-zb and v-auto at --budgets; with --short also the short runs where
the search's size-dependent steps run (pp 3, 4, 6; m = p-1, p, p+2, 2p+1).

    python scripts/bench/plan_digest.py [--pp 4,8] [--factors 2] [--budgets 0.625,0.75,0.875] [--short] [--jobs 2] > before.txt
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time

from megatron_vshape.schedule import registry
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Costs
from megatron_vshape.schedule.simulate import simulate
from parallel import check_jobs, in_processes  # scripts/bench/parallel.py, beside this script

COST_SETS = ("1,1,1,0", "2,2.2,1.6,0.05", "2,2,2,0.25")


def digest(x) -> str:
    """A short hash of op lists (by their text form) or of a string."""
    text = x if isinstance(x, str) else repr([[str(op) for op in ops] for ops in x])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def sizes(pps, factors, short):
    out = [(pp, f * pp) for pp in pps for f in factors]
    if short:
        out += [(pp, m) for pp in (3, 4, 6) for m in (pp - 1, pp, pp + 2, 2 * pp + 1)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="4,8,12,16")
    ap.add_argument("--factors", default="2,4,8")
    ap.add_argument("--costs", default=";".join(COST_SETS))
    ap.add_argument("--budgets", default="0.625,0.75,0.875", help="v-auto's memory budgets")
    ap.add_argument("--short", action="store_true", help="also the short runs (m near p)")
    ap.add_argument("--jobs", type=int, default=1, help="plans built at a time, one process each (the same lines)")
    args = ap.parse_args(argv)
    check_jobs(ap, args.jobs)
    ints = lambda t: [int(x) for x in t.split(",") if x]  # noqa: E731
    plans = [(n, {}) for n in ("v-min", "v-half", "v-zb")]
    plans += [("v-auto", {"memory_budget": float(b)}) for b in args.budgets.split(",") if b]
    t0 = time.perf_counter()
    points = [(costs, pp, m, name, options) for costs in [c for c in args.costs.split(";") if c]
              for pp, m in sizes(ints(args.pp), ints(args.factors), args.short) for name, options in plans]
    for line in in_processes(_line, points, args.jobs):
        print(line, flush=True)
    print(f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


def _line(point) -> str:
    """One plan's digest line (or its error): the unit --jobs hands a process."""
    costs, pp, m, name, options = point
    label = f"{name}@{options['memory_budget']:g}" if options else name
    try:
        s = registry.build(name, pp, m, Costs.parse(costs), **options)
    except ConfigError as exc:
        return f"{costs} {pp} {m} {label} error {str(exc).splitlines()[0][:60]}"
    sim = simulate(s)
    return f"{costs} {pp} {m} {label} {sim.makespan:.6g} {max(sim.peak_vs_1f1b):.4f} {digest(s.ranks)} {digest(s.meta.get('plan', ''))}"


if __name__ == "__main__":
    sys.exit(main())
