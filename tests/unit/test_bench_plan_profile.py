"""scripts/bench/plan_profile.py: counting changes neither the plan nor the planner."""
from bench_scripts import load_bench

from megatron_vshape.planner import justify, listing, search
from megatron_vshape.planner.problem import Problem
from megatron_vshape.schedule.ops import Costs, stage_table

bench = load_bench("plan_profile")


def test_the_profiled_plan_is_the_planners_and_the_planner_is_put_back():
    engines = (Problem.run, listing.greedy, search.greedy, justify.schedule, search._plan, search._search_on)
    costs = Costs.parse("2,2.2,1.6,0.05")
    rows, order = bench.profile(4, 8, 0.7, costs)  # v-auto includes V-Half's plan here (0.625)
    assert (Problem.run, listing.greedy, search.greedy, justify.schedule, search._plan, search._search_on) == engines

    per_stage = costs.per_stage(2)
    search._plan.cache_clear()
    assert order == search._plan("v-auto", 4, 8, per_stage, stage_table(per_stage, 8, None), 0.7)[0]

    steps = {r[0]: r for r in rows}
    assert bench.NAMED in steps and "search on" in steps and "improve starts" in steps
    total = float(steps.pop("total")[1])
    assert 0 < sum(float(r[1]) for r in steps.values()) <= total + 1e-3  # each step's own time, once
    ops = lambda label, col: int(steps[label][col].replace(",", ""))  # noqa: E731
    assert ops("improve starts", 3) > 0 and ops(bench.NAMED, 3) > 0  # improve() simulates
    assert ops("search on", 5) > 0  # the plan is justified there
