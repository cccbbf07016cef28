"""scripts/bench/vs_official.py's grid (the comparison itself needs the paper's released scheduler,
which this repository does not ship): pp 4..16, m p..8p, every cap from V-Min's to 2p."""
import os

import pytest
from bench_scripts import load_bench

from megatron_vshape.planner import search

bench = load_bench("vs_official")


def test_the_grid_spans_every_microbatch_count_and_cap_from_v_mins():
    grid = list(bench.points(range(4, 17), 128, bench.COST_SETS))
    for pp in range(4, 17):
        low = search.budget_steps(pp, pp, high=2.0)[0][0]
        mine = [(m, c, cap) for p, m, c, cap in grid if p == pp]
        assert {m for m, _, _ in mine} == set(range(pp, 8 * pp + 1))
        assert {cap for _, _, cap in mine} == set(range(low, 2 * pp + 1))
        assert len(mine) == len(set(mine)) == (7 * pp + 1) * len(bench.COST_SETS) * (2 * pp + 1 - low)


def test_min_m_and_max_m_cut_the_grid_and_keep_its_order():
    whole = list(bench.points(range(4, 17), 128, bench.COST_SETS))
    band = list(bench.points(range(4, 17), 64, bench.COST_SETS, min_m=33))
    assert band == [p for p in whole if 33 <= p[1] <= 64]
    assert band and min(p[1] for p in band) == 33 and max(p[1] for p in band) == 64
    assert len(whole) == 39_417  # the grid's size docs/planner.md quotes


def test_against_replans_v_auto_at_an_earlier_runs_points(tmp_path, capsys):
    """--against: v-auto re-planned at the stored points' official peaks and compared with the
    official makespans stored there (the released scheduler's figures of tests/unit/test_reorder.py)."""
    earlier, after = tmp_path / "earlier.csv", tmp_path / "after.csv"
    rows = [{"pp": 6, "microbatches": 9, "costs": "1,1,1,0", "cap": 8, "official": 32.5, "official_peak": 8, "official_s": 1.0},
            {"pp": 4, "microbatches": 8, "costs": "2,2,2,0.25", "cap": 6, "official": 1e9, "official_peak": 6, "official_s": 1.0}]
    with open(earlier, "w", newline="") as f:
        writer = bench.csv.DictWriter(f, fieldnames=bench.FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    assert bench.main(["--against", str(earlier), "--csv", str(after)]) == 0
    with open(after, newline="") as f:
        got = list(bench.csv.DictReader(f))
    assert [(r["pp"], r["microbatches"], r["cap"]) for r in got] == [("6", "9", "8"), ("4", "8", "6")]
    for row, stored in zip(got, rows):
        assert float(row["official"]) == stored["official"]
        assert int(row["ours_peak"]) <= stored["official_peak"]
        assert abs(float(row["gap"]) - (float(row["ours"]) / stored["official"] - 1)) < 1e-12
    assert float(got[0]["ours"]) <= 32.5
    assert "points 2  worse 0" in capsys.readouterr().out


def test_without_official_or_against_it_says_what_to_give(capsys):
    with pytest.raises(SystemExit):
        bench.main([])
    assert "--against [CSV]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--against", "--keep"])
    assert "nothing to keep" in capsys.readouterr().err


def test_the_stored_official_figures_bound_v_auto_at_a_sample_of_their_points(tmp_path, capsys):
    """scripts/bench/data holds the released scheduler's figures (an outside bound, measured by
    --official runs): one row a point, its peak within its cap; v-auto re-planned with
    --against (no path: those figures) at a sample of the pp=4 points is never longer and
    peaks no higher."""
    with open(bench.STORED, newline="") as f:
        stored = list(bench.csv.DictReader(f))
    points = [(int(r["pp"]), int(r["microbatches"]), r["costs"], int(r["cap"])) for r in stored]
    assert len(points) == len(set(points)) and points == sorted(points)
    assert all(0 < int(r["official_peak"]) <= int(r["cap"]) and float(r["official"]) > 0 for r in stored)
    after = tmp_path / "after.csv"
    assert bench.main(["--against", "--pp", "4", "--max-m", "10", "--sample", "6", "--seed", "3", "--csv", str(after)]) == 0
    with open(after, newline="") as f:
        got = list(bench.csv.DictReader(f))
    assert len(got) == 6 and all(r["pp"] == "4" and int(r["microbatches"]) <= 10 for r in got)
    for row in got:
        assert float(row["ours"]) <= float(row["official"]) + 1e-9, row
        assert int(row["ours_peak"]) <= int(row["official_peak"])
    assert "points 6  worse 0" in capsys.readouterr().out


def test_keep_adds_new_points_sorted_and_leaves_stored_ones(tmp_path):
    path = str(tmp_path / "data" / "stored.csv")
    row = lambda pp, m, cap, official: {"pp": pp, "microbatches": m, "costs": "1,1,1,0", "cap": cap,  # noqa: E731
                                        "official": official, "official_peak": cap, "ours": 1.0, "gap": 0.0}
    assert bench.keep([row(6, 9, 8, 32.5), row(4, 8, 6, 30.0)], path) == 2
    assert bench.keep([row(4, 8, 6, 99.0), row(4, 5, 4, 20.0)], path) == 1  # (4, 8, 6) stays 30
    with open(path, newline="") as f:
        got = list(bench.csv.DictReader(f))
    assert [(r["pp"], r["microbatches"], r["cap"], r["official"]) for r in got] == [
        ("4", "5", "4", "20.0"), ("4", "8", "6", "30.0"), ("6", "9", "8", "32.5")]
    assert list(got[0]) == list(bench.STORED_FIELDS)


def test_against_picks_stored_points_by_pp_microbatches_costs_and_points():
    args = bench.argparse.Namespace(pp=[4, 6], min_m=5, max_m=8, costs="1,1,1,0;2,2,2,0.25", points=None)
    point = lambda pp, m, costs, cap=8: {"pp": str(pp), "microbatches": str(m), "costs": costs, "cap": str(cap)}  # noqa: E731
    assert bench._picked(point(4, 8, "1,1,1,0"), args) and bench._picked(point(6, 5, "2,2,2,0.25"), args)
    assert not bench._picked(point(5, 8, "1,1,1,0"), args)  # pp
    assert not bench._picked(point(4, 9, "1,1,1,0"), args) and not bench._picked(point(4, 4, "1,1,1,0"), args)  # m
    assert not bench._picked(point(4, 8, "2,2.2,1.6,0.05"), args)  # costs
    unset = bench.argparse.Namespace(pp=None, min_m=1, max_m=None, costs=None, points=None)
    assert bench._picked(point(13, 100, "3,2,2,0"), unset)
    named = bench.argparse.Namespace(pp=None, min_m=1, max_m=None, costs=None, points={(4, 8, 7), (13, 100, 20)})
    assert bench._picked(point(4, 8, "1,1,1,0", 7), named) and bench._picked(point(13, 100, "3,2,2,0", 20), named)
    assert not bench._picked(point(4, 8, "1,1,1,0", 8), named)  # cap


def test_against_replans_only_the_points_named(tmp_path, capsys):
    """--points with --against: the stored points named, not all of them (it re-planned every
    stored point before)."""
    out, two = tmp_path / "named.csv", tmp_path / "two.csv"
    assert bench.main(["--against", "--points", "4:4:4,4:5:5", "--costs", "1,1,1,0", "--csv", str(out)]) == 0
    rows = list(bench.csv.DictReader(open(out)))
    assert sorted((r["microbatches"], r["cap"]) for r in rows) == [("4", "4"), ("5", "5")]
    assert "2 stored points" in capsys.readouterr().err
    # --jobs 2: the same plans, in the same order, from two processes
    assert bench.main(["--against", "--points", "4:4:4,4:5:5", "--costs", "1,1,1,0", "--jobs", "2", "--csv", str(two)]) == 0
    assert _untimed(_rows(two)) == _untimed(rows)
    with pytest.raises(SystemExit):
        bench.main(["--against", "--points", "4:4", "--csv", str(out)])


# The released scheduler's interface (schedule(pp, m, (f, b, w, c), max_mem) -> each rank's
# nodes, with .type F/B/W and .chunk 0/1), answering with this project's V-Min plan: its peak
# is V-Min's cap, under every cap of the grid.  It prints, as the released one does.
STAND_IN = '''
from types import SimpleNamespace
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.ops import Costs

def schedule(pp, m, costs, max_mem):
    f, b, w, c = costs
    plan = registry.build("v-min", pp, m, Costs(2 * f, 2 * b, 2 * w, c))
    print("memory and bubble table")
    return [[SimpleNamespace(type=op.kind, chunk=0 if op.stage == r else 1) for op in ops]
            for r, ops in enumerate(plan.ranks)]
'''


def _rows(path):
    with open(path, newline="") as f:
        return list(bench.csv.DictReader(f))


def _untimed(rows):
    """The rows without their CPU-second columns (all that differs between processes)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


def test_official_runs_in_processes_resume_with_new_and_keep_as_they_come(tmp_path, monkeypatch, capsys):
    """--jobs 2 measures what one process does, in the same order; --keep stores each point;
    --new then measures only the points not stored.  The replay is checked by a round trip:
    the stand-in's order replayed simulates to the V-Min plan's own makespan and peak."""
    from megatron_vshape.schedule import registry
    from megatron_vshape.schedule.ops import Costs
    from megatron_vshape.schedule.simulate import simulate

    official, stored = tmp_path / "v_auto_schedule.py", tmp_path / "data" / "stored.csv"
    official.write_text(STAND_IN)
    monkeypatch.setattr(bench, "STORED", str(stored))
    named = ["--pp", "4", "--costs", "1,1,1,0", "--points", "4:4:4,4:5:6,4:6:8", "--official", str(official)]
    one, two, more = tmp_path / "one.csv", tmp_path / "two.csv", tmp_path / "more.csv"
    assert bench.main(named + ["--csv", str(one)]) == 0
    assert bench.main(named + ["--jobs", "2", "--keep", "--csv", str(two)]) == 0
    assert _untimed(_rows(one)) == _untimed(_rows(two))
    assert [(r["microbatches"], r["cap"]) for r in _rows(one)] == [("4", "4"), ("5", "6"), ("6", "8")]
    for row in _rows(one):
        plan = simulate(registry.build("v-min", 4, int(row["microbatches"]), Costs()))
        assert float(row["official"]) == round(plan.makespan, 6)
        assert int(row["official_peak"]) == max(plan.peak_activations) <= int(row["cap"])
    assert bench.stored_points() == {(4, 4, "1,1,1,0", 4), (4, 5, "1,1,1,0", 6), (4, 6, "1,1,1,0", 8)}
    assert "kept 3 new points" in capsys.readouterr().err
    named[5] += ",4:5:5"
    assert bench.main(named + ["--new", "--keep", "--csv", str(more)]) == 0
    assert [(r["microbatches"], r["cap"]) for r in _rows(more)] == [("5", "5")]
    assert "1 of 4 grid points, 1 not stored yet" in capsys.readouterr().err
    assert len(bench.stored_points()) == 4 and not os.path.exists(str(stored) + ".new")
    rows = _rows(stored)  # a stored figure that the scheduler does not give
    rows[1]["official"] = "999.0"
    with open(stored, "w", newline="") as f:
        writer = bench.csv.DictWriter(f, fieldnames=bench.STORED_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    assert bench.main(named + ["--csv", str(more)]) == 1
    err = capsys.readouterr().err
    assert "DIFFERS from the stored figures: (4, 5, '1,1,1,0', 5)" in err and "1 of 4 points stored already" in err


def test_kept_stores_every_batch_and_what_a_stopped_run_measured(tmp_path):
    path = str(tmp_path / "stored.csv")
    row = lambda m: {"pp": 4, "microbatches": m, "costs": "1,1,1,0", "cap": 4, "official": 1.0, "official_peak": 4}  # noqa: E731
    kept = bench.Kept(path, batch=2)
    rows = kept.each(row(m) for m in range(4, 9))
    next(rows), next(rows), next(rows)  # a batch of two stored, one pending
    assert len(bench.stored_points(path)) == 2
    rows.close()  # the run stopped: the pending row is stored too
    assert len(bench.stored_points(path)) == 3 and kept.new == 3


def test_jobs_and_new_are_checked_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--against", "--new"])
    assert "--new are for --official runs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--official", "x.py", "--jobs", "0"])
    assert "--jobs 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--official", "no/such/v_auto_schedule.py", "--pp", "4", "--max-m", "4"])
    assert "no such file" in capsys.readouterr().err


# A stand-in shaped like the released file where official_memo.py hooks in: schedule() builds
# each block under M = min(2p, max_mem), and scores the ones that fit.
STRUCTURED = '''
built = []

def schedule_by_building_block(p, m, block, max_mem, keep_stable_phase=False):
    built.append((tuple(block[0]), max_mem))
    peak = sum(block[0])
    if peak > max_mem:
        return None, peak, [6 * m] * p
    extra = 1 if m <= p and 2 * m <= max_mem else 0  # the warm-up rule: W's released
    return [["F"] * (block[0][0] * m + extra)], peak, [0] * p

def evaluate_schedule(schedule, f, b, w, c):
    return len(schedule[0]) * f + c

def schedule(p, m, cost, max_mem):
    best = None
    for block in ((1, 1), (2, 1), (1, 3), (3, 3)):
        s, peak, _ = schedule_by_building_block(p, m, [list(block)], min(2 * p, max_mem))
        if s is not None:
            score = evaluate_schedule(s, *cost)
            best = best if best is not None and best[0] <= score else (score, peak, len(s[0]))
    return best
'''


def test_the_released_schedulers_work_is_shared_across_caps_and_costs_with_the_same_answers(tmp_path):
    """official_memo: a block's schedule is built once for every cap at or above the first
    that fits it (and again where the warm-up rule changes), scored once per cost set, and
    every answer is the unshared module's."""
    path = tmp_path / "structured.py"
    path.write_text(STRUCTURED)
    plain, mine = bench.load(str(path)), bench.load(str(path))
    shared = bench.official_memo.install(mine)
    for m in (2, 6):  # m <= p: the warm-up rule turns on at M = 2m = 4
        shared.clear()
        mine.built.clear()
        for cost in ((1, 1, 1, 0), (2, 1, 1, 0.5)):
            for cap in range(2, 9):
                assert mine.schedule(4, m, cost, cap) == plain.schedule(4, m, cost, cap)
        first = {(1, 1): 2, (2, 1): 3, (1, 3): 4, (3, 3): 6}  # the least cap that fits each block
        again = {(1, 1), (2, 1)} if m == 2 else set()  # fit below M = 4, built again there
        assert sorted(mine.built) == sorted([(b, M) for b, at in first.items() for M in range(2, at + 1)]
                                            + [(b, 4) for b in again])
    assert bench.official_memo.install(bench.load(str(tmp_path / "structured.py"))).calls == 0
    stand_in = tmp_path / "plain.py"
    stand_in.write_text(STAND_IN)
    assert bench.official_memo.install(bench.load(str(stand_in))) is None  # another file: runs as it is


def _table_rows(pp, costs, gap_of):
    """A row for every grid point of `pp` with `costs`, v-auto's makespan given by gap_of(m, cap)."""
    return [{"pp": p, "microbatches": m, "costs": c, "cap": cap, "official": 100.0, "official_peak": cap,
             "ours": 100.0 * (1 + gap_of(m, cap)), "ours_peak": cap}
            for p, m, c, cap in bench.points([pp], 128, [costs])]


def test_the_table_counts_each_part_and_how_much_of_its_grid_it_covers(tmp_path, capsys):
    """One line per (pp, cost family): pp=4 with all three sets is 'every point'; pp=5 with one
    set is a third of the three sets' grid; another cost set is its own family, whose grid at a
    pp is that of the sets measured; worse/equal/better and the gaps from ours / official."""
    three = [r for c in bench.COST_SETS for r in _table_rows(4, c, lambda m, cap: 0.0 if cap % 2 else -0.01)]
    three[0]["ours"] = 102.0  # one point worse, by 2%
    part = _table_rows(5, "1,1,1,0", lambda m, cap: 0.0)
    other = _table_rows(4, "1,2,1,0.5", lambda m, cap: -0.05)
    lines = bench.table(three + part + other).splitlines()
    by = {tuple(cell.strip() for cell in line.strip("|").split("|")[:2]): line for line in lines[2:]}
    cells = lambda key: [cell.strip() for cell in by[key].strip("|").split("|")]
    odd = sum(1 for r in three[1:] if r["cap"] % 2)  # the equal ones (the first is worse)
    assert cells(("4", "the three")) == ["4", "the three", f"{len(three):,}", "every point", "1", f"{odd:,}",
                                         f"{len(three) - odd - 1:,}", "+2.00%", f"{(0.02 - 0.01 * (len(three) - odd - 1)) / len(three):+.2%}"]
    assert cells(("5", "the three"))[2:4] == [f"{len(part):,}", f"{1 / 3:.1%} of {3 * len(part):,}"]
    assert cells(("4", "1 others"))[2:] == [f"{len(other):,}", "every point", "0", "0", f"{len(other):,}", "-5.00%", "-5.00%"]
    assert cells(("all", "all"))[2] == f"{len(three) + len(part) + len(other):,}"
    # --table: the same table from runs' CSVs, a point in both files counted once (the last file's row)
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    for path, rows in ((first, three + part), (second, other + three[:1])):
        with open(path, "w", newline="") as f:
            writer = bench.csv.DictWriter(f, fieldnames=bench.FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    capsys.readouterr()
    assert bench.main(["--table", str(first), str(second)]) == 1  # a point is worse: listed, exit 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[:-1] == lines and out[-1] == f"WORSE 4:4:4 costs {bench.COST_SETS[0]}: ours 102.0, official 100.0"
    assert bench.main(["--table", str(first), "--pp", "5"]) == 0  # none worse at pp=5
    assert [line.split("|")[1].strip() for line in capsys.readouterr().out.strip().splitlines()[2:]] == ["5", "all"]
