"""The fastest schedule that fits a memory budget: what `--pipeline-schedule auto` and
`megatron-vshape compare --memory-budget X` call.

Every registered schedule that serves the sizes is built, simulated under the costs (and stage
costs), and the shortest one whose peak activations stay within the budget on every rank wins;
ties go to the earlier name in the registry.  v-auto enters with the shortest of its plan at the
budget itself and its plans at every budget step below (`v_auto_steps`, what `frontier` draws):
each budget is its own search, and a step up can land a little longer, but a plan that fits a
smaller budget fits this one.  So the choice at a step weighs every plan the choices at the steps
below weighed, and is never slower than theirs; between two steps it is never slower than at the
step below.  With whole stage sizes every budget's cap is a step's.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

from ..schedule import registry
from ..schedule.errors import ConfigError
from ..schedule.ops import Costs, Schedule, StageCost
from ..schedule.simulate import SimResult, simulate
from .search import MAX_BUDGET, budget_steps, lower_bound, min_budget


def v_auto_steps(pp: int, microbatches: int, costs: Optional[Costs] = None,
                 stage_costs: Optional[Sequence[StageCost]] = None,
                 high: float = MAX_BUDGET) -> Iterator[Tuple[float, Schedule, SimResult]]:
    """v-auto at every budget step from V-Min's up to `high` (search.budget_steps, one
    stage-activation a step): (budget, schedule, sim) of the shortest plan at that step or any
    step below it, so the makespans never rise.  A step no plan serves (too few microbatches) is
    left out.  Once a plan reaches the problem's lower bound the larger steps are not planned:
    nothing is shorter."""
    best, bound = None, None
    for _, budget in budget_steps(pp, microbatches, high):
        if best is None or best[1].makespan > bound * (1 + 1e-9):
            try:
                s = registry.build("v-auto", pp, microbatches, costs, stage_costs=stage_costs, memory_budget=budget)
            except ConfigError:
                continue
            sim = simulate(s)
            bound = lower_bound(s) if bound is None else bound  # the same at every budget
            if best is None or sim.makespan < best[1].makespan - 1e-9:
                best = (s, sim)
        yield budget, best[0], best[1]


def _v_auto_within(pp: int, microbatches: int, costs: Optional[Costs], memory_budget: float,
                   stage_costs: Optional[Sequence[StageCost]], schedule: Schedule,
                   sim: SimResult) -> Tuple[Schedule, SimResult]:
    """v-auto's plan at the budget itself (`schedule`), or the last of `v_auto_steps` up to the
    budget when that is shorter."""
    bound = lower_bound(schedule)
    if bound is not None and sim.makespan <= bound * (1 + 1e-9):
        return schedule, sim  # optimal already: no step below is shorter
    for _, s, s_sim in v_auto_steps(pp, microbatches, costs, stage_costs, min(memory_budget, MAX_BUDGET)):
        if s_sim.makespan < sim.makespan - 1e-9:
            schedule, sim = s, s_sim
    return schedule, sim


def candidates(pp: int, microbatches: int, costs: Optional[Costs], memory_budget: float,
               stage_costs: Optional[Sequence[StageCost]] = None) -> List[Tuple[str, Optional[Schedule], str]]:
    """(name, schedule or None, why not) for every registered schedule at these sizes."""
    out = []
    for name in registry.names():
        options = {}
        if registry.plans_under_budget(name):
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
        if name == "v-auto":
            schedule, sim = _v_auto_within(pp, microbatches, costs, memory_budget, stage_costs, schedule, sim)
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
    planned = schedule.memory_budget
    at = f"; planned at budget {planned:.4g}, shorter than at {memory_budget:g} itself" if (
        name == "v-auto" and planned is not None and planned < min(memory_budget, MAX_BUDGET) - 1e-12) else ""
    reason = (f"{name}: fastest of {len(fitting)} schedules within memory budget {memory_budget:g} of 1F1B "
              f"(makespan {makespan:g}, bubble {sim.bubble_rate:.2%}, peak {peak:.3g}{at})")
    if len(fitting) > 1:
        m2, _, n2, _, _, _ = fitting[1]
        reason += f"; next {n2} at makespan {m2:g} ({m2 / makespan - 1:+.1%})"
    return schedule, reason
