"""v-auto against the paper's released adaptive scheduler (`v_auto_schedule.schedule` of
sail-sg/zero-bubble-pipeline-parallelism), both measured by this project's simulator.

The official scheduler is not part of this project: pass the path of its file
(megatron/core/pipeline_parallel/zerobubble/scheduler/v_auto_schedule.py in that repository).
For each point (pp, microbatches, costs, cap) it schedules under `max_mem` = cap; its order is
replayed as our op lists (its F/B/W rows go down the ranks: chunk 0's forward, chunk 1's
backward; f/b/w go up), simulated, and v-auto is planned at the official schedule's own peak
(budget = peak / (2p)), so the two are compared at the same memory.  "worse" counts points
where v-auto's makespan is longer.

Grid: pp 4..16, microbatches p..8p, the three cost sets of schedules.py, every cap from V-Min's
to 2p (--costs gives others): 39,417 points.  Points are measured a (pp, microbatches) at a time,
the released scheduler's work shared between their caps and cost sets (official_memo.py: under
a CPU second a point at pp 10..16, where it took 8-35 s alone) and v-auto planned once for each
official peak; v-auto's planning is then most of the time.  --sample N draws N points uniformly
with --seed; --pp, --min-m, --max-m and --points restrict the grid.

    python scripts/bench/vs_official.py --official PATH/v_auto_schedule.py [--sample 60] [--seed 1]
                                        [--pp 4,5,...] [--min-m 33] [--max-m 64] [--points 10:23:18,...]
                                        [--csv out/vs_official.csv]

To check a planner change without running the released scheduler again, --against re-plans
v-auto at stored points and compares with the official figures stored with them (--official is
then not needed).  Without a path it takes scripts/bench/data/official_v_auto.csv, the official
figures of every run quoted in docs/planner.md; --pp, --min-m, --max-m, --costs and --sample
pick among its points:

    python scripts/bench/vs_official.py --against [--pp 4] [--sample 100] --csv out/after.csv
    python scripts/bench/vs_official.py --against out/vs_official.csv --csv out/after.csv

--keep adds an --official run's figures to that file as they come (a point already there keeps
its row), --new measures only the grid points not stored yet, and --jobs N runs N processes
(with --official each loads the released scheduler once and takes a (pp, microbatches) at a
time; with --against it re-checks the stored points N times faster).  A point measured that is
stored already is checked against its stored figures (DIFFERS, and exit 1, if the released
scheduler now gives others).  The rest of the grid is a few CPU seconds a point: a many-core
machine completes it, stopped and resumed at will:

    python scripts/bench/vs_official.py --official PATH/v_auto_schedule.py --pp 10 --new --jobs 64 --keep

Every run ends with a table by pipeline size and cost family (how much of the grid it covers,
worse, equal, better, worst and mean gap): docs/planner.md's table is that of `--against` over
every stored point.  --table prints it again from runs' CSVs, without planning, then the
points where v-auto is longer (exit 1 if any):

    python scripts/bench/vs_official.py --table out/pp4.csv out/pp5.csv [--pp 4]
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import io
import os
import random
import sys
import time
from typing import Dict, Iterable, Iterator, List, Sequence, Set, Tuple

from megatron_vshape.planner import search
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.ops import B, F, W, Costs, Op, Placement, Schedule
from megatron_vshape.schedule.simulate import simulate
import official_memo  # scripts/bench/, beside this script
from parallel import check_jobs, in_processes

COST_SETS = ("1,1,1,0", "2,2.2,1.6,0.05", "2,2,2,0.25")  # per rank, as users give them
FIELDS = ("pp", "microbatches", "costs", "cap", "official", "official_peak", "ours", "ours_peak", "gap", "official_s", "ours_s")
STORED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "official_v_auto.csv")
STORED_FIELDS = FIELDS[:6]  # the official figures of a point: what --against needs


def load(path: str):
    spec = importlib.util.spec_from_file_location("official_v_auto", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay(official, pp: int, m: int, stage_costs: Costs, cap: int) -> Schedule:
    """The official schedule under `cap` stage-activations per rank, as our op lists."""
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its memory/bubble table
        rows = official.schedule(pp, m, (stage_costs.F, stage_costs.B, stage_costs.W, stage_costs.C), cap)
    ranks = []
    for r, row in enumerate(rows):
        seen, ops = {}, []
        for node in row:
            kind, chunk = {"F": F, "B": B, "W": W}[node.type], int(node.chunk)  # chunk 1: the official f, B, W
            stage = r if chunk == 0 else 2 * pp - 1 - r
            mb = seen.get((kind, stage), 0)
            seen[(kind, stage)] = mb + 1
            ops.append(Op(kind, mb, stage))
        ranks.append(ops)
    return Schedule("official v_auto", Placement("v", pp, 2), m, stage_costs, ranks, {})


def points(pps, max_m, cost_sets, min_m=1):
    for pp in pps:
        low = search.budget_steps(pp, pp, high=2.0)[0][0]
        for m in range(max(pp, min_m), min(8 * pp, max_m) + 1):
            for costs in cost_sets:
                for cap in range(low, 2 * pp + 1):
                    yield pp, m, costs, cap


def measured(official, pp, m, costs_text, cap) -> dict:
    """The official schedule's makespan and peak at one point, and its CPU seconds."""
    user = Costs.parse(costs_text)
    t = time.process_time()
    theirs = replay(official, pp, m, user.per_stage(2), cap)
    t_off = time.process_time() - t
    sim = simulate(theirs)
    return {"pp": pp, "microbatches": m, "costs": costs_text, "cap": cap, "official": round(sim.makespan, 6),
            "official_peak": max(sim.peak_activations), "official_s": round(t_off, 2)}


_OFFICIAL = None  # the released scheduler, loaded once in each --jobs process
_SHARED = None  # its work shared within a group of points (official_memo.py)


def _load_official(path: str) -> None:
    global _OFFICIAL, _SHARED
    _OFFICIAL = load(path)
    _SHARED = official_memo.install(_OFFICIAL)


def _compare_group(group) -> List[dict]:
    """The points of one (pp, microbatches) in grid order (each cost set's caps ascending): the
    released scheduler's work shared between them, and v-auto planned once for each official
    peak (caps above what the official schedule holds give the same peak; such rows repeat the
    one plan's CPU seconds)."""
    if _SHARED is not None:
        _SHARED.clear()
    search._plan.cache_clear()  # the group's named plans (V-Min's, V-Half's, V-ZB's) are then built once
    planned, rows = {}, []
    for point in group:
        row = measured(_OFFICIAL, *point)
        key = (row["costs"], row["official_peak"])
        if key not in planned:
            planned[key] = ours_at(row)
        ours = planned[key]
        rows.append({**row, "ours": ours["ours"], "ours_peak": ours["ours_peak"],
                     "gap": ours["ours"] / row["official"] - 1, "ours_s": ours["ours_s"]})
    return rows


def _by_run(items: Iterable, run=lambda row: (int(row["pp"]), int(row["microbatches"]))) -> List[list]:
    """`items` split by run(item), the (pp, microbatches) of a row by default: each part in the
    order its items came, the parts in the order of their first item."""
    parts: Dict[Tuple[int, int], list] = {}
    for item in items:
        parts.setdefault(run(item), []).append(item)
    return list(parts.values())


def _groups(chosen, grid) -> List[list]:
    """`chosen` (grid points) in grid order, split by (pp, microbatches)."""
    at = {g: k for k, g in enumerate(grid)}
    return _by_run(sorted(chosen, key=at.get), run=lambda point: point[:2])


def _replanned(rows: List[dict]) -> List[dict]:
    """ours_at() of stored rows of one (pp, microbatches), the named plans built once for them."""
    search._plan.cache_clear()
    return [ours_at(row) for row in rows]


def ours_at(row: dict) -> dict:
    """`row` (a point with the official schedule's makespan and peak) with v-auto planned at
    that peak (budget = peak / (2p)) beside it.  The planner's cache is the caller's: its
    entries are whole plans, the same built or looked up (search._plan is a pure function of
    the problem), so only `ours_s`, the CPU seconds, tells whether the named plans v-auto
    includes were built here or by an earlier point of the same (pp, microbatches)."""
    pp = int(row["pp"])
    t = time.process_time()
    ours = simulate(registry.build("v-auto", pp, int(row["microbatches"]), Costs.parse(row["costs"]),
                                   memory_budget=float(row["official_peak"]) / (2 * pp)))
    official = float(row["official"])
    return {**row, "ours": round(ours.makespan, 6), "ours_peak": max(ours.peak_activations),
            "gap": ours.makespan / official - 1, "ours_s": round(time.process_time() - t, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--official", help="path of the released v_auto_schedule.py")
    ap.add_argument("--against", nargs="?", const=STORED,
                    help="stored points (an earlier run's CSV; without a path the figures in scripts/bench/data): "
                         "re-plan v-auto at them, against their official figures")
    ap.add_argument("--keep", action="store_true",
                    help=f"add this --official run's figures to {os.path.relpath(STORED)} as they come")
    ap.add_argument("--new", action="store_true", help="with --official: only the grid points not stored yet")
    ap.add_argument("--jobs", type=int, default=1, help="processes: with --official each measures a (pp, microbatches) at a time, with --against a point")
    ap.add_argument("--pp", type=_sizes, help="pipeline sizes, comma-separated (default: 4..16)")
    ap.add_argument("--max-m", type=int, help="largest microbatch count (default 128; the grid goes to 8p)")
    ap.add_argument("--costs", help="cost sets separated by ';' (default: the three of schedules.py)")
    ap.add_argument("--sample", type=int, default=0, help="points drawn uniformly (0: all)")
    ap.add_argument("--min-m", type=int, default=1, help="smallest microbatch count (the grid starts at p)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--csv", default="out/vs_official.csv")
    ap.add_argument("--points", type=_triples, help="only these grid points, PP:M:CAP separated by commas (e.g. 10:23:18)")
    ap.add_argument("--table", nargs="+", metavar="CSV",
                    help="only print the table of earlier runs' CSVs (their --csv; a point in several: the last file's row)")
    args = ap.parse_args(argv)
    if args.table:
        rows: Dict[Tuple[int, int, str, int], dict] = {}
        for path in args.table:
            with open(path, newline="") as f:
                rows.update((_key(r), r) for r in csv.DictReader(f) if r.get("ours") and _picked(r, args))
        if not rows:
            ap.error(f"--table {' '.join(args.table)}: no row with v-auto's figures (give the --csv of an --official or --against run)")
        print(table(list(rows.values())))
        worse = [r for r in rows.values() if _gap(r) > 1e-9]  # what table() counts as worse
        for r in worse:  # the points to look at, as --points names them
            print(f"WORSE {r['pp']}:{r['microbatches']}:{r['cap']} costs {r['costs']}: ours {r['ours']}, official {r['official']}")
        return 1 if worse else 0
    if args.against and (args.keep or args.new):
        ap.error("--keep and --new are for --official runs; --against re-plans stored points and has nothing to keep")
    check_jobs(ap, args.jobs)
    if args.against:
        with open(args.against, newline="") as f:
            chosen = [row for row in csv.DictReader(f) if _picked(row, args)]
        if 0 < args.sample < len(chosen):
            chosen = random.Random(args.seed).sample(chosen, args.sample)
        print(f"{len(chosen)} stored points of {args.against}", file=sys.stderr)
        groups = in_processes(_replanned, _by_run(chosen), args.jobs)
        report((row for group in groups for row in group), args.csv)
        return 0
    if not args.official:
        ap.error("give --official PATH (the released v_auto_schedule.py) or --against [CSV] (stored points)")
    pps = args.pp or range(4, 17)
    grid = list(points(pps, args.max_m or 128, [c for c in (args.costs or ";".join(COST_SETS)).split(";") if c], args.min_m))
    if args.points:
        grid = [g for g in grid if (g[0], g[1], g[3]) in args.points]
        if not grid:
            print(f"--points {sorted(args.points)}: none on the grid (pp in --pp, m from p to min(8p, --max-m), cap from V-Min's to 2p)", file=sys.stderr)
            return 2
    if not os.path.isfile(args.official):
        ap.error(f"--official {args.official}: no such file (give the path of the released v_auto_schedule.py)")
    whole, stored = len(grid), _stored(STORED)
    if args.new:
        grid = [g for g in grid if g not in stored]
    chosen = random.Random(args.seed).sample(grid, args.sample) if 0 < args.sample < len(grid) else grid
    print(f"{len(chosen)} of {whole} grid points" + (f", {len(grid)} not stored yet" if args.new else ""), file=sys.stderr)
    groups = in_processes(_compare_group, _groups(chosen, grid), args.jobs, _load_official, args.official)
    checked = Checked(stored)
    rows = checked.each(row for group in groups for row in group)
    kept = Kept() if args.keep else None
    report(kept.each(rows) if kept else rows, args.csv)
    if kept:
        print(f"kept {kept.new} new points in {kept.path}", file=sys.stderr)
    print(checked.summary(), file=sys.stderr)
    return 1 if checked.differ else 0


def _sizes(text: str) -> List[int]:
    """--pp: comma-separated pipeline sizes."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give pipeline sizes separated by commas, e.g. 4,8") from None


def _triples(text: str) -> Set[Tuple[int, int, int]]:
    """--points: PP:M:CAP triples separated by commas."""
    try:
        got = {tuple(int(x) for x in p.split(":")) for p in text.split(",")}
    except ValueError:
        got = set()
    if not got or any(len(p) != 3 for p in got):
        raise argparse.ArgumentTypeError(f"{text!r}: give PP:M:CAP triples separated by commas, e.g. 10:23:18")
    return got


def _picked(row: dict, args) -> bool:
    """A stored point inside --pp, --min-m, --max-m, --costs and --points (each only where given)."""
    pp, m = int(row["pp"]), int(row["microbatches"])
    return ((not args.pp or pp in args.pp)
            and args.min_m <= m <= (args.max_m or m)
            and (not args.costs or row["costs"] in args.costs.split(";"))
            and (not args.points or (pp, m, int(row["cap"])) in args.points))


def _key(row) -> Tuple[int, int, str, int]:
    return int(row["pp"]), int(row["microbatches"]), row["costs"], int(row["cap"])


def _stored(path: str) -> Dict[Tuple[int, int, str, int], dict]:
    """The rows stored at `path` by point (none if there is no file yet)."""
    if not os.path.exists(path):
        return {}
    with open(path, newline="") as f:
        return {_key(r): r for r in csv.DictReader(f)}


def stored_points(path: str = "") -> Set[Tuple[int, int, str, int]]:
    """(pp, microbatches, costs, cap) of every point stored at `path` (default STORED)."""
    return set(_stored(path or STORED))


class Checked:
    """Points measured again that are stored already: their official figures must be the stored
    ones (the released scheduler is deterministic; official_memo.py shares its work on a reading
    of its code, which this checks)."""

    def __init__(self, stored: Dict[Tuple[int, int, str, int], dict]):
        self.stored, self.same, self.differ = stored, 0, []

    def each(self, rows: Iterable[dict]) -> Iterator[dict]:
        for row in rows:
            was = self.stored.get(_key(row))
            if was is not None:
                if float(was["official"]) == row["official"] and int(was["official_peak"]) == row["official_peak"]:
                    self.same += 1
                else:
                    self.differ.append(row)
                    print(f"DIFFERS from the stored figures: {_key(row)}: official {row['official']} peak "
                          f"{row['official_peak']}, stored {was['official']} peak {was['official_peak']}", file=sys.stderr)
            yield row

    def summary(self) -> str:
        if self.differ:
            return f"{len(self.differ)} of {self.same + len(self.differ)} points stored already have other official figures now"
        if not self.same:
            return "no point measured was stored already (nothing to check the official figures against)"
        return f"{self.same} points measured were stored already: the same official figures"


class Kept:
    """--keep as rows come: every `batch` rows and at the end, so a long run stopped part way
    keeps what it measured (up to `batch` rows less)."""

    def __init__(self, path: str = "", batch: int = 10):
        self.path, self.batch, self.new = path or STORED, batch, 0

    def each(self, rows: Iterable[dict]) -> Iterator[dict]:
        pending = []
        try:
            for row in rows:
                pending.append(row)
                yield row
                if len(pending) == self.batch:
                    self.new += keep(pending, self.path)
                    pending = []
        finally:
            if pending:
                self.new += keep(pending, self.path)


def keep(rows, path: str = "") -> int:
    """The official figures of `rows` added to the stored points at `path` (default STORED),
    sorted by point; a point already stored keeps its row (the released scheduler is
    deterministic).  Written beside and renamed over, so a run stopped while it writes leaves
    the file whole.  Returns how many were new."""
    path = path or STORED
    stored = _stored(path)
    new = {_key(r): {k: r[k] for k in STORED_FIELDS} for r in rows if _key(r) not in stored}
    stored.update(new)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".new", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=STORED_FIELDS)
        writer.writeheader()
        writer.writerows(stored[k] for k in sorted(stored))
    os.replace(path + ".new", path)
    return len(new)


def report(results, path: str) -> List[dict]:
    """Each row written to the CSV at `path` and printed as it comes, then the summary; the rows."""
    rows = []
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in results:
            rows.append(row)
            writer.writerow(row)
            f.flush()
            mark = "WORSE" if row["gap"] > 1e-9 else ""
            print(" ".join(f"{k}={row[k]}" for k in FIELDS[:8]), f"gap={row['gap']:+.3%}", mark, flush=True)
    worse = [r for r in rows if r["gap"] > 1e-9]
    equal = [r for r in rows if abs(r["gap"]) <= 1e-9]
    print(f"\npoints {len(rows)}  worse {len(worse)}  equal {len(equal)}  better {len(rows) - len(worse) - len(equal)}  "
          f"worst gap {max((r['gap'] for r in rows), default=0):+.3%}  mean {sum(r['gap'] for r in rows) / max(1, len(rows)):+.3%}")
    if rows:
        print("\n" + table(rows))
    return rows


def _gap(row: dict) -> float:
    """ours / official - 1 of a row, from its figures (a CSV row holds them as text)."""
    return float(row["ours"]) / float(row["official"]) - 1


def table(rows: Sequence[dict]) -> str:
    """The rows by pipeline size and cost family (schedules.py's three sets, then the others
    measured), as a markdown table: how much of that part of the grid they cover (the grid at
    that pp with the family's cost sets), and how v-auto fares.  docs/planner.md quotes it."""
    others = sorted({r["costs"] for r in rows} - set(COST_SETS))
    families = [("the three", list(COST_SETS))] + ([(f"{len(others)} others", others)] if others else [])
    lines = ["| pp | cost sets | points | of the grid | worse | equal | better | worst gap | mean gap |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, sets in families + [("all", None)]:
        for pp in sorted({int(r["pp"]) for r in rows}) if sets else [None]:
            part = [r for r in rows if (sets is None or r["costs"] in sets) and (pp is None or int(r["pp"]) == pp)]
            if not part:
                continue
            gaps = [_gap(r) for r in part]
            worse, equal = sum(g > 1e-9 for g in gaps), sum(abs(g) <= 1e-9 for g in gaps)
            if pp is None:
                cover = ""
            else:
                grid = sum(1 for _ in points([pp], 128, sets))
                cover = "every point" if len({_key(r) for r in part}) == grid else f"{len(part) / grid:.1%} of {grid:,}"
            lines.append(f"| {pp if pp is not None else 'all'} | {name} | {len(part):,} | {cover} | {worse:,} | {equal:,} | "
                         f"{len(part) - worse - equal:,} | {max(gaps):+.2%} | {sum(gaps) / len(gaps):+.2%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
