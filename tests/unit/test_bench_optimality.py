"""scripts/bench/optimality.py: the planner against the proven optimum on small instances (at
pp=2 the V's one budget, so the run is short), a CSV row per instance and a summary."""
import csv

import pytest
from bench_scripts import load_bench

pytest.importorskip("ortools.sat.python.cp_model", reason="OR-Tools is not installed: pip install '.[optimal]'")

# Each solve stops at this much of CP-SAT's deterministic time on one worker, so "optimal" is the
# same answer on a fast and a loaded machine; --time-limit only guards the wall clock.
LIMITS = ["--time-limit", "600", "--work-limit", "2"]


def _bench():
    return load_bench("optimality")


def test_budgets_step_one_stage_activation_from_v_min():
    bench = _bench()
    got = bench.budgets(4, 8)
    assert [cap for _, cap in got] == [4, 5, 6, 7, 8]
    assert got[0][0] == pytest.approx(0.5) and got[-1][0] == pytest.approx(1.0)


def test_each_budget_plans_at_its_own_cap():
    """pp=3's budget for cap 5 is 5/6: rounded to 0.833333 it gave cap 4 (V-Half's) again, and
    the bench never tested cap 5."""
    from megatron_vshape.planner import search

    for pp, m in ((3, 6), (4, 8), (6, 7)):
        for budget, cap in _bench().budgets(pp, m):
            assert search.cap_of(pp, m, budget) == cap


def test_pp2_rows_are_proven_and_written(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "opt.csv"
    assert bench.main(["--pp", "2", *LIMITS, "--csv", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == 9  # m 2, 4, 6 x three cost sets, one budget
    for row in rows:
        assert row["status"] == "optimal"
        assert 0 <= float(row["gap"]) <= 0.02
    assert "max gap" in capsys.readouterr().out


def test_microbatches_option_chooses_the_counts(tmp_path):
    bench = _bench()
    out = tmp_path / "opt.csv"
    assert bench.main(["--pp", "2", "--microbatches", "3", *LIMITS, "--csv", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [int(r["microbatches"]) for r in rows] == [3, 3, 3]  # three cost sets, one budget at pp=2
    with pytest.raises(SystemExit):
        bench.main(["--pp", "2", "--microbatches", "0"])


def test_costs_option_chooses_the_cost_sets(tmp_path):
    bench = _bench()
    out = tmp_path / "opt.csv"
    assert bench.main(["--pp", "2", "--microbatches", "3", "--costs", "1,2,1,0.1; 3,2,2,1", *LIMITS,
                       "--csv", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["costs"] for r in rows] == ["1,2,1,0.1", "3,2,2,1"]
    assert all(r["status"] == "optimal" and 0 <= float(r["gap"]) <= 0.02 for r in rows)
    with pytest.raises(SystemExit):
        bench.main(["--pp", "2", "--costs", "1,x,1"])


def test_budgets_option_plans_at_those_budgets_only(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "opt.csv"
    assert bench.main(["--pp", "2", "--microbatches", "3", "--costs", "1,1,1,0", "--budgets", "1.5",
                       *LIMITS, "--csv", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [(float(r["budget"]), int(r["cap"])) for r in rows] == [(1.5, 6)]
    assert "solver's best, all" in capsys.readouterr().out
    for bad in ("0.3", "2.5", "x"):
        with pytest.raises(SystemExit):
            bench.main(["--pp", "2", "--budgets", bad])
