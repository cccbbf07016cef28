"""scripts/bench/budget_steps.py: the cap levels it scans and its --ends stage costs (the
scans themselves are benchmarks, quoted in docs/planner.md)."""
import csv

import pytest
from bench_scripts import load_bench

from megatron_vshape.planner import search
from megatron_vshape.schedule.ops import Costs
from megatron_vshape.schedule.simulate import one_f_one_b_peak

bench = load_bench("budget_steps")


def test_ends_scale_the_first_and_last_stage_only():
    stages = bench.heavy_ends(4, Costs(2, 2.2, 1.6, 0.1), "1.2x1.25,1.6x1.5")
    assert len(stages) == 8
    plain = Costs(2, 2.2, 1.6, 0.1).per_stage(2)
    assert (stages[0].F, stages[0].B, stages[0].W, stages[0].size) == pytest.approx((1.2 * plain.F, 1.2 * plain.B, 1.2 * plain.W, 1.25))
    assert (stages[7].F, stages[7].B, stages[7].W, stages[7].size) == pytest.approx((1.6 * plain.F, 1.6 * plain.B, 1.6 * plain.W, 1.5))
    assert all((s.F, s.B, s.W, s.size) == (plain.F, plain.B, plain.W, 1.0) for s in stages[1:7])
    assert bench.heavy_ends(4, Costs(), "") is None


def test_levels_are_whole_caps_or_quarters_of_an_activation_from_v_mins_budget():
    assert bench.levels(6, 12, 1.0, False) == search.budget_steps(6, 12, high=1.0)
    quarters = bench.levels(6, 12, 1.0, True)
    unit = 2 * one_f_one_b_peak(6, 12)
    assert quarters[0][1] == pytest.approx(search.min_budget(6))
    assert quarters[-1] == pytest.approx((unit, 1.0))
    for (cap, budget), (nxt, _) in zip(quarters, quarters[1:]):
        assert cap == pytest.approx(budget * unit) and nxt - cap == pytest.approx(0.25)


def test_a_scan_with_heavy_ends_lists_its_slower_steps_and_exits_1_only_then(tmp_path, capsys):
    out = tmp_path / "steps.csv"
    code = bench.main(["--pp", "3", "--factors", "1", "--costs", "1,1,1,0", "--high", "0.75",
                       "--ends", "1.2x1.25,1.6x1.5", "--csv", str(out)])
    rows = list(csv.DictReader(open(out)))
    assert [float(r["budget"]) for r in rows] == sorted(float(r["budget"]) for r in rows) and len(rows) >= 2
    assert all(float(r["peak"]) <= float(r["cap"]) + 1e-9 for r in rows)
    slower = [(a, b) for a, b in zip(rows, rows[1:]) if float(b["makespan"]) > float(a["makespan"]) + 1e-9]
    printed = capsys.readouterr().out
    assert printed.count("\nslower: ") == len(slower) and code == (1 if slower else 0)
    assert f"{len(rows) - 1} steps, {len(slower)} slower" in printed


def test_malformed_ends_say_the_form():
    with pytest.raises(SystemExit):
        bench.main(["--ends", "1.2,1.5"])


def test_jobs_scan_in_processes_and_give_the_same_rows(tmp_path, capsys):
    """--jobs 2: each (costs, pp, m) scanned in its own process, the rows and their order the
    same as one process gives (only the CPU seconds differ).  The first of the two scans is the
    longer (pp=4), so rows taken as they finish would come in the other order."""
    one, two = tmp_path / "one.csv", tmp_path / "two.csv"
    scan = ["--pp", "4,3", "--factors", "1", "--costs", "2,2.2,1.6,0.05", "--high", "0.75"]
    assert bench.main(scan + ["--csv", str(one)]) == bench.main(scan + ["--jobs", "2", "--csv", str(two)])
    untimed = lambda path: [{k: v for k, v in r.items() if k != "cpu_s"} for r in csv.DictReader(open(path))]  # noqa: E731
    assert untimed(one) == untimed(two) and [r["pp"] for r in untimed(one)][::len(untimed(one)) - 1] == ["4", "3"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench.main(["--jobs", "0"])
    assert "--jobs 0" in capsys.readouterr().err


def test_auto_scans_what_fastest_within_picks_never_longer_and_never_rising(tmp_path, capsys):
    """--auto: at each level the choice of --pipeline-schedule auto, no longer than v-auto's own
    plan there and never longer than at the level below (exit 0)."""
    alone, auto = tmp_path / "alone.csv", tmp_path / "auto.csv"
    scan = ["--pp", "4", "--factors", "2", "--costs", "2,2,2,0.25", "--high", "1.0"]
    bench.main(scan + ["--csv", str(alone)])
    assert bench.main(scan + ["--auto", "--csv", str(auto)]) == 0
    own, picked = list(csv.DictReader(open(alone))), list(csv.DictReader(open(auto)))
    assert [r["cap"] for r in own] == [r["cap"] for r in picked] and len(picked) == 5
    assert all(float(b["makespan"]) <= float(a["makespan"]) + 1e-9 for a, b in zip(own, picked))
    assert all(float(b["makespan"]) <= float(a["makespan"]) + 1e-9 for a, b in zip(picked, picked[1:]))
    assert "4 steps, 0 slower" in capsys.readouterr().out
