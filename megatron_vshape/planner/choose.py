"""The fastest schedule that fits a memory budget: what `--pipeline-schedule auto` and
`megatron-vshape compare --memory-budget X` call.

Every registered schedule that serves the sizes is built (v-auto at the budget itself),
simulated under the costs (and stage costs), and the shortest one whose peak activations
stay within the budget on every rank wins; ties go to the earlier name in the registry.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..schedule import registry
from ..schedule.errors import ConfigError
from ..schedule.ops import Costs, Schedule, StageCost
from ..schedule.simulate import simulate
from .search import MAX_BUDGET, min_budget


def candidates(pp: int, microbatches: int, costs: Optional[Costs], memory_budget: float,
               stage_costs: Optional[Sequence[StageCost]] = None) -> List[Tuple[str, Optional[Schedule], str]]:
    """(name, schedule or None, why not) for every registered schedule at these sizes."""
    out = []
    for name in registry.names():
        options = {}
        if name == "v-auto":
            if memory_budget < min_budget(pp) - 1e-12:
                out.append((name, None, f"budget {memory_budget:g} is below V-Min's {min_budget(pp):.4g}"))
                continue
            options["memory_budget"] = min(memory_budget, MAX_BUDGET)
        try:
            out.append((name, registry.build(name, pp, microbatches, costs, stage_costs=stage_costs, **options), ""))
        except ConfigError as exc:
            out.append((name, None, str(exc).splitlines()[0]))
    return out


def fastest_within(pp: int, microbatches: int, costs: Optional[Costs], memory_budget: float,
                   stage_costs: Optional[Sequence[StageCost]] = None,
                   flag: str = "--memory-budget") -> Tuple[Schedule, str]:
    """(the fastest schedule whose peak_vs_1f1b <= memory_budget on every rank, a reason
    naming its figures and the runner-up); ConfigError when none fits, naming the budget as `flag`
    (the option that gave it)."""
    if not memory_budget > 0:
        raise ConfigError(f"{flag} {memory_budget!r} must be > 0 (a fraction of 1F1B's activation memory)")
    fitting, over = [], []
    for k, (name, schedule, why) in enumerate(candidates(pp, microbatches, costs, memory_budget, stage_costs)):
        if schedule is None:
            continue
        sim = simulate(schedule)
        peak = max(sim.peak_vs_1f1b)
        if peak <= memory_budget + 1e-9:
            fitting.append((sim.makespan, k, name, schedule, sim, peak))
        else:
            over.append((peak, name))
    if not fitting:
        least = min(over) if over else None
        hint = f"; the least any schedule needs is {least[0]:.4g} ({least[1]})" if least else ""
        floor = min_budget(pp)
        fix = (f"raise {flag} to at least {floor:.4g}: V-Min's floor at pp={pp}, which more microbatches do not lower"
               if memory_budget < floor - 1e-12 else f"add microbatches, or raise {flag}")
        raise ConfigError(f"no schedule fits {flag} {memory_budget:g} at pp={pp}, microbatches={microbatches}"
                          f"{hint}; {fix}")
    fitting.sort(key=lambda x: x[:2])
    makespan, _, name, schedule, sim, peak = fitting[0]
    reason = (f"{name}: fastest of {len(fitting)} schedules within memory budget {memory_budget:g} of 1F1B "
              f"(makespan {makespan:g}, bubble {sim.bubble_rate:.2%}, peak {peak:.3g})")
    if len(fitting) > 1:
        m2, _, n2, _, _, _ = fitting[1]
        reason += f"; next {n2} at makespan {m2:g} ({m2 / makespan - 1:+.1%})"
    return schedule, reason
