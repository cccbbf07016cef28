"""Schedule names as `--pipeline-schedule` takes them, mapped to their generators: one table.

A generator is a pure function `(pp, microbatches, costs=Costs(), **options) -> Schedule`,
with `costs` as users give them (one rank's share of the model), returning a verified
schedule; an option it does not take raises ConfigError (ops.check_no_options).  The
generators do not know this table, so nothing here imports back (no cycle).

`build` also takes unequal stage costs (stage_costs.py): a generator whose signature has
`stage_costs` plans for them; any other schedule keeps its order and is simulated under
them (its order does not depend on costs, or was planned for equal stages).
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict, List, Optional, Sequence

from ..planner import generators
from . import baselines
from .errors import ConfigError
from .ops import Costs, Schedule, StageCost
from .stage_costs import fit

Generator = Callable[..., Schedule]
GENERATORS: Dict[str, Generator] = {
    "1f1b": baselines.one_f_one_b,
    "1f1b-interleaved": baselines.interleaved_1f1b,
    "zb-h1": baselines.zb_h1,
    "zb-h2": baselines.zb_h2,
    "v-min": generators.v_min,
    "v-half": generators.v_half,
    "v-zb": generators.v_zb,
    "v-auto": generators.v_auto,
}


def names() -> List[str]:
    return list(GENERATORS)


def generator(name: str) -> Generator:
    try:
        return GENERATORS[name]
    except KeyError:
        raise ConfigError(f"unknown schedule {name!r}; choose one of: {', '.join(GENERATORS)}") from None


def plans_for_stage_costs(name: str) -> bool:
    """Whether schedule `name`'s generator plans for unequal stage costs itself."""
    return "stage_costs" in inspect.signature(generator(name)).parameters


def plans_under_budget(name: str) -> bool:
    """Whether schedule `name`'s generator plans under a memory budget it is given (v-auto)."""
    return "memory_budget" in inspect.signature(generator(name)).parameters


def build(name: str, pp: int, microbatches: int, costs: Optional[Costs] = None,
          stage_costs: Optional[Sequence[StageCost]] = None, **options) -> Schedule:
    """Generate schedule `name` for pp ranks and `microbatches` microbatches (under
    `stage_costs`, one per stage in model order, when given)."""
    gen, costs = generator(name), costs or Costs()
    if stage_costs is None:
        return gen(pp, microbatches, costs, **options)
    if plans_for_stage_costs(name):
        return gen(pp, microbatches, costs, stage_costs=stage_costs, **options)
    schedule = gen(pp, microbatches, costs, **options)
    schedule.stage_costs = fit(stage_costs, schedule.num_stages, f"{name} at pp={pp}")
    return schedule
