"""Unequal stages and memory budgets in the data model: accessors, simulator, weighted
memory, the verifier's budget check, export round trip and the stage-costs file."""
import json

import pytest

from megatron_vshape.planner import search

from megatron_vshape.schedule import export, registry, stage_costs
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Costs, Op, Placement, Schedule, StageCost
from megatron_vshape.schedule.simulate import peak_activations, simulate
from megatron_vshape.schedule.verify import InvalidSchedule, verify


def _two_stage(stage_costs=None, budget=None):
    # pp=2, one microbatch, 1F1B order: F@0 F@1 B@1 W@1 | B@0 W@0
    ranks = [[Op("F", 0, 0), Op("B", 0, 0), Op("W", 0, 0)], [Op("F", 0, 1), Op("B", 0, 1), Op("W", 0, 1)]]
    return Schedule("t", Placement("single", 2), 1, Costs(1, 1, 1, 0.5), ranks, {}, stage_costs, budget)


def test_accessors_and_simulation_follow_stage_costs():
    s = _two_stage((StageCost(2, 3, 4, 1.5), StageCost(1, 5, 0.5, 1)))
    assert s.duration("F", 0) == 2 and s.duration("BW", 0) == 7 and s.duration("W", 1) == 0.5
    assert s.size(0) == 1.5 and s.size(1) == 1
    # F@0 [0,2], hop .5, F@1 [2.5,3.5], B@1 [3.5,8.5], hop .5, B@0 [9,12], W@0 [12,16]
    assert simulate(s).makespan == 16
    assert simulate(_two_stage()).makespan == 1 + 0.5 + 1 + 1 + 0.5 + 1 + 1


def test_equal_stage_costs_change_nothing():
    plain = registry.build("v-half", 4, 12, Costs(2, 2.2, 1.6, 0.05))
    search._plan.cache_clear()  # planned again from the stage costs, not read from the cache
    same = registry.build("v-half", 4, 12, Costs(2, 2.2, 1.6, 0.05), stage_costs=[StageCost(1, 1.1, 0.8)] * 8)
    assert same.ranks == plain.ranks
    a, b = simulate(plain), simulate(same)
    assert a.makespan == pytest.approx(b.makespan)
    assert (a.peak_activations, a.peak_vs_1f1b) == (b.peak_activations, b.peak_vs_1f1b)


def test_peak_activations_weighted_by_size():
    s = registry.build("1f1b", 4, 8, stage_costs=[StageCost(1, 1, 1, 2.5)] + [StageCost(1, 1, 1)] * 3)
    assert peak_activations(s) == [10.0, 3, 2, 1]  # rank 0 holds 4 activations of size 2.5
    assert simulate(s).peak_vs_1f1b[0] == 2.5


def test_verifier_checks_the_memory_budget_on_every_rank():
    s = registry.build("1f1b", 4, 8)
    s.memory_budget = 1.0
    verify(s)
    s.memory_budget = 0.9
    with pytest.raises(InvalidSchedule, match="rank 0: peak activations 1 of 1F1B exceed the memory budget 0.9"):
        verify(s)
    s.memory_budget = 0.5
    with pytest.raises(InvalidSchedule, match="rank 1"):  # 3/4 > 0.5 too
        verify(s)


def test_export_round_trips_stage_costs_and_budget():
    costs = [StageCost(1.5, 1.2, 0.9, 1.75)] + [StageCost(1, 1.1, 0.8)] * 6 + [StageCost(2, 2.5, 1, 1.25)]
    s = registry.build("v-zb", 4, 8, Costs(2, 2.2, 1.6, 0.05), stage_costs=costs)
    s.memory_budget = 2.0
    data = json.loads(export.to_json(s))
    assert data["stage_costs"][0] == {"F": 1.5, "B": 1.2, "W": 0.9, "size": 1.75} and data["memory_budget"] == 2.0
    back = export.from_dict(data)
    assert back.stage_costs == s.stage_costs and back.memory_budget == 2.0 and back.ranks == s.ranks
    assert simulate(back).makespan == data["makespan"]
    assert "stage_costs" not in export.to_dict(registry.build("v-zb", 4, 8))  # equal stages: format unchanged


def test_file_loads_and_merges_pairs_for_single_placement(tmp_path):
    path = tmp_path / "sc.json"
    entries = [{"F": 1, "B": 1, "W": 1, "size": 2}] + [{"F": 1, "B": 1, "W": 1}] * 6 + [{"F": 3, "B": 2, "W": 1}]
    path.write_text(json.dumps({"stage_costs": entries}))
    sc = stage_costs.load(str(path))
    assert len(sc) == 8 and sc[0].size == 2 and sc[1].size == 1
    one = registry.build("1f1b", 4, 8, stage_costs=sc)
    assert one.stage_costs[0] == StageCost(2, 2, 2, 1.5) and one.stage_costs[3] == StageCost(4, 3, 2, 1)
    assert stage_costs.parse(entries) == sc  # a bare list reads the same


@pytest.mark.parametrize("content, message", [
    ({"stage_costs": [{"F": 1, "B": 1, "W": 1}] * 6}, "give 8 entries"),
    ({"stage_costs": [{"F": 1, "B": -1, "W": 1}] * 8}, "stage 0 B=-1 is negative"),
    ({"stage_costs": [{"F": 1, "B": 1}] * 8}, "stage 0 has no W"),
    ({"stage_costs": [{"F": 1, "B": 1, "W": "x"}] * 8}, "W='x' is not a number"),
    ({"stage_costs": [{"F": 1, "B": 1, "W": 1, "sise": 2}] * 8}, "unknown key"),
    ({"costs": 1}, "expected a list of stages"),
])
def test_bad_files_name_the_value_and_the_fix(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=message):
        registry.build("v-half", 4, 8, stage_costs=stage_costs.load(str(path)))
