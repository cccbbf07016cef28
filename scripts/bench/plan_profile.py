"""Where one v-auto plan's time goes, step by step: CPU seconds and the ops each step runs
through the planner's three engines (the simulator `Problem.run`, the list scheduler
`listing.greedy`, justification's `justify.schedule`), and the microseconds per op.

A step's figures are its own (what its inner steps took is theirs); the named plan v-auto
includes (`_plan` of V-Min, V-Half or V-ZB inside v-auto's starts) is one line, its whole
search.  The seconds per op differ by engine and by step: that is what a single work budget
counted in simulated ops has to convert (docs/planner.md, "Planning time").

    python scripts/bench/plan_profile.py [--points 4:8:0.7,8:16:0.7] [--costs 2,2.2,1.6,0.05]

The planner runs unchanged: the steps and engines are wrapped for counting only (and put
back after), so each plan is the one `megatron-vshape plan` builds, from a cold search.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections import Counter, defaultdict
from typing import Callable, Dict, List, Tuple

from megatron_vshape.cli import format_table
from megatron_vshape.planner import justify, listing, search
from megatron_vshape.planner.problem import Problem
from megatron_vshape.schedule.ops import Costs, stage_table

DEFAULT_POINTS = "4:8:0.7,4:32:0.7,8:16:0.7,8:64:0.7,16:20:0.7,16:128:0.7"
ENGINES = ("run", "list", "justify")
STEPS = (  # search.py's steps, and inside _starts the starts it builds
    ("_legacy", "starts: paper's constructions"), ("_greedy_candidates", "starts: greedy rules"),
    ("_squeezed_candidates", "starts: squeezed blocks"), ("_estimated", "starts: block estimates"),
    ("_reordered_candidates", "starts: reordered blocks"), ("_refit_candidates", "starts: refit"),
    ("_unit_size_start", "starts: unit-size"), ("_starts", "starts: their relists"),
    ("_improve_starts", "improve starts"), ("_search_on", "search on"),
    ("_late_starts", "late starts"), ("_relisted_end", "relisted end"),
)
NAMED = "named plan (its whole search)"


class Profile:
    """Exclusive CPU seconds and engine ops by step, on a stack of open steps."""

    def __init__(self):
        self.ops: Counter = Counter()
        self.seconds: Dict[str, float] = defaultdict(float)
        self.by_step: Dict[str, Counter] = defaultdict(Counter)
        self.stack: List[list] = []  # [label, start time, ops at start, children's seconds, children's ops]

    def wrap(self, fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def step(*args, **kwargs):
            if any(frame[0] == NAMED for frame in self.stack):
                return fn(*args, **kwargs)  # inside the named plan: its line takes it all
            self.stack.append([label, time.process_time(), self.ops.copy(), 0.0, Counter()])
            try:
                return fn(*args, **kwargs)
            finally:
                _, t0, ops0, child_s, child_ops = self.stack.pop()
                spent_s, spent_ops = time.process_time() - t0, self.ops - ops0
                self.seconds[label] += spent_s - child_s
                self.by_step[label].update(spent_ops)
                self.by_step[label].subtract(child_ops)
                if self.stack:
                    self.stack[-1][3] += spent_s
                    self.stack[-1][4].update(spent_ops)
        return step

    def count(self, fn: Callable, engine: str, size: Callable) -> Callable:
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            self.ops[engine] += size(*args, **kwargs)
            return fn(*args, **kwargs)
        return counted


@contextlib.contextmanager
def counting(prof: Profile):
    """The engines and the steps wrapped for `prof`, put back on leaving."""
    saved = [(Problem, "run", Problem.run), (listing, "greedy", listing.greedy), (search, "greedy", search.greedy),
             (justify, "schedule", justify.schedule), (search, "_plan", search._plan)]
    saved += [(search, name, getattr(search, name)) for name, _ in STEPS]
    Problem.run = prof.count(Problem.run, "run", lambda P, order, limit, end, pos, free: sum(map(len, order)) - sum(pos))
    listed = prof.count(listing.greedy, "list", lambda P, *a, **k: P.n - (sum(map(len, k["start"].out)) if k.get("start") else 0))
    listing.greedy = search.greedy = listed
    justify.schedule = prof.count(justify.schedule, "justify", lambda P, *a, **k: P.n)
    for name, label in STEPS:
        setattr(search, name, prof.wrap(getattr(search, name), label))
    cached = search._plan
    cached.cache_clear()  # every plan searched afresh: v-auto's and the named plan it includes
    search._plan = lambda name, *args: (cached if name == "v-auto" else prof.wrap(cached, NAMED))(name, *args)
    try:
        yield prof
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def profile(pp: int, m: int, budget: float, costs: Costs) -> Tuple[List[List[str]], tuple]:
    """The table of one v-auto plan (a cold search), and the plan's op lists."""
    per_stage = costs.per_stage(2)
    with counting(Profile()) as prof:
        t0 = time.process_time()
        order, _ = search._plan("v-auto", pp, m, per_stage, stage_table(per_stage, 2 * pp, None), budget)
        total = time.process_time() - t0
    rows = []
    for label in sorted(prof.seconds, key=lambda s: -prof.seconds[s]):
        ops = prof.by_step[label]
        n = sum(ops[e] for e in ENGINES)
        s = prof.seconds[label]
        rows.append([label, f"{s:.3f}", f"{100 * s / total:.0f}%"] + [f"{ops[e]:,}" for e in ENGINES]
                    + [f"{1e6 * s / n:.2f}" if n else "-"])
    rows.append(["total", f"{total:.3f}", "100%"] + [f"{sum(c[e] for c in prof.by_step.values()):,}" for e in ENGINES] + [""])
    return rows, order


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=DEFAULT_POINTS, help="PP:M:BUDGET, comma-separated")
    ap.add_argument("--costs", default="2,2.2,1.6,0.05", help="F,B,W,C per rank")
    args = ap.parse_args(argv)
    costs = Costs.parse(args.costs)
    for point in args.points.split(","):
        pp, m, budget = point.split(":")
        pp, m, budget = int(pp), int(m), float(budget)
        print(f"\nv-auto pp={pp} m={m} ({6 * pp * m} ops) at budget {budget:g}, costs {args.costs}")
        print(format_table(["step", "cpu s", "share", "run ops", "listed ops", "justified ops", "us/op"],
                           profile(pp, m, budget, costs)[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
