"""The registered V-shape generators: each a pure function (pp, microbatches, costs, ...) ->
verified Schedule that plans with search.plan under its memory budget.  V-Min, V-Half and
V-ZB keep to the paper's budgets ((p+4)//3, (p+2)//2 and p of 1F1B's p microbatches); V-Auto
takes any budget from V-Min's to 2.0."""
from __future__ import annotations

from typing import Optional, Sequence

from ..schedule.ops import Costs, Schedule, StageCost, check_no_options, check_sizes
from ..schedule.vshape import memory_caps
from .search import plan

DEFAULT_BUDGET = 1.0  # v-auto without a budget: the fastest V within 1F1B's activation memory


def _named(name: str, pp: int, microbatches: int, costs: Optional[Costs], per_1f1b: int, options: dict) -> Schedule:
    stage_costs = options.pop("stage_costs", None)
    check_no_options(name, options)
    check_sizes(name, pp, microbatches)
    memory_caps(name, pp, microbatches, per_1f1b)  # reject too few microbatches first, with this schedule's words
    return plan(name, pp, microbatches, costs, per_1f1b / pp, stage_costs)


def v_min(pp: int, microbatches: int, costs: Costs = Costs(), stage_costs=None, **options) -> Schedule:
    """V-Min: about 1/3 of 1F1B's activation memory ((p+4)//3 of p microbatches)."""
    return _named("v-min", pp, microbatches, costs, (pp + 4) // 3, dict(options, stage_costs=stage_costs))


def v_half(pp: int, microbatches: int, costs: Costs = Costs(), stage_costs=None, **options) -> Schedule:
    """V-Half: about half of 1F1B's activation memory ((p+2)//2 of p microbatches)."""
    return _named("v-half", pp, microbatches, costs, (pp + 2) // 2, dict(options, stage_costs=stage_costs))


def v_zb(pp: int, microbatches: int, costs: Costs = Costs(), stage_costs=None, **options) -> Schedule:
    """V-ZB: 1F1B's activation memory, almost no bubble."""
    return _named("v-zb", pp, microbatches, costs, pp, dict(options, stage_costs=stage_costs))


def v_auto(pp: int, microbatches: int, costs: Costs = Costs(), memory_budget: Optional[float] = None,
           stage_costs: Optional[Sequence[StageCost]] = None, **options) -> Schedule:
    """V-Auto: the fastest V-shape schedule found within `memory_budget` (a fraction of 1F1B's
    activation memory, from V-Min's ((p+4)//3)/p to 2.0; default 1.0)."""
    check_no_options("v-auto", options)
    budget = DEFAULT_BUDGET if memory_budget is None else memory_budget
    return plan("v-auto", pp, microbatches, costs, budget, stage_costs)
