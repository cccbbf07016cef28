"""scripts/bench/plan_digest.py: one line a plan (makespan, peak, hashes of the op lists and of
how it was found), the check that a refactor of the planner keeps every plan."""
import pytest
from bench_scripts import load_bench

from megatron_vshape.schedule import registry
from megatron_vshape.schedule.ops import Costs
from megatron_vshape.schedule.simulate import simulate

bench = load_bench("plan_digest")
GRID = ["--pp", "4", "--factors", "1,2", "--costs", "1,1,1,0", "--budgets", "0.75"]


def _lines(capsys, argv):
    assert bench.main(argv) == 0
    return capsys.readouterr().out.splitlines()


def test_a_line_a_plan_with_its_makespan_and_op_lists_hash(capsys):
    lines = _lines(capsys, GRID)
    assert [ln.split()[1:4] for ln in lines] == [["4", m, name] for m in ("4", "8")
                                                 for name in ("v-min", "v-half", "v-zb", "v-auto@0.75")]
    for line in lines:
        costs, pp, m, label, makespan, peak, ops, how = line.split()
        name, _, budget = label.partition("@")
        s = registry.build(name, int(pp), int(m), Costs.parse(costs), **({"memory_budget": float(budget)} if budget else {}))
        assert float(makespan) == pytest.approx(simulate(s).makespan, rel=1e-5)
        assert ops == bench.digest(s.ranks) and how == bench.digest(s.meta["plan"])


def test_jobs_give_the_same_lines(capsys):
    assert _lines(capsys, GRID + ["--jobs", "2"]) == _lines(capsys, GRID)
