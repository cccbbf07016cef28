"""The exact reference: the shortest schedule under the simulator's execution model, solved
with OR-Tools CP-SAT (an optional extra: `pip install megatron_vshape[optimal]`).

The model is the simulator's (simulate.py, comm.py), stated as constraints:
  * one interval per op, of its stage's cost; the ops of a rank never overlap;
  * an op starts after each input's producer ends, plus the hop latency C when the producer
    sits on another rank (the V's turn on rank p-1 is handed over for free): F@s after F@s-1;
    B/BW@s after B/BW@s+1 and after F@s; W@s after B@s;
  * all ranks start together at t=0; the makespan (the last end) is minimised;
  * per rank, the stage-activations alive never exceed the cap: one activation of stage s
    (weight `size` of s) lives from its F's start to its W's (or BW's) end, as the simulator
    counts it (+size at F, -size when W/BW ends; a W ending when an F starts frees first).
    A reservoir constraint per rank states it (+size at each F's start, -size at each W's end;
    it proved faster here than a cumulative over lifespans).

Time is in integers: every cost is multiplied by `scale`, the least common multiple of the
costs' decimal denominators (e.g. 2,2.2,1.6,0.05 per rank -> per stage 1,1.1,0.8,0.05 -> x20),
so the optimum is exact; costs with more than MAX_SCALE's resolution are rounded to it and the
result says so (`rounded`).  The solver's order per rank is re-simulated eagerly; the
schedule returned verifies and its simulated makespan is the one claimed (checked here).

Microbatches are interchangeable, so every op kind of a stage may run them in index order
without losing the optimum: take two microbatches' start times in any schedule and give the
earlier of the two at every op to the lower index.  Every dependency t[v] >= t[u] + d holds for
both, so it holds for their minimum and their maximum; each rank's busy slots, each stage's
starts and ends of lifespans (so the memory alive at any time) and the makespan are unchanged.
Sorting pairwise this way reaches index order everywhere; the search space shrinks by m!-fold
per op kind and stage.
ortools is imported inside `solve` only; the rest of schedule/ never needs it.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule import microbatch_order
from ..schedule.comm import ACT, input_message, is_remote, local_predecessor
from ..schedule.errors import ConfigError
from ..schedule.ops import B, BW, F, W, Costs, Op, Placement, Schedule, StageCost, stage_table
from ..schedule.simulate import one_f_one_b_peak, simulate
from ..schedule.verify import verify

INSTALL_HINT = "the exact reference needs OR-Tools: pip install 'megatron_vshape[optimal]' (ortools==9.15.6755)"
MAX_SCALE = 10_000  # exact integer time units per cost unit at most; finer costs are rounded
ROUNDING = 1_000  # rounded costs: the smallest resolved to 1 part in this


def require_ortools() -> None:
    """Raise ConfigError naming the fix when the optional extra is not installed."""
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        raise ConfigError(f"--optimal: {INSTALL_HINT}") from None


@dataclass
class Problem:
    """What is solved: a placement, the microbatches, per-stage costs (`costs` per stage with
    C the hop latency; `stage_costs` when stages differ), whether backward is split into B and
    W, and the memory budget in peak_vs_1f1b's unit (None: no limit)."""

    name: str
    placement: Placement
    microbatches: int
    costs: Costs
    stage_costs: Optional[Tuple[StageCost, ...]] = None
    split: bool = True
    memory_budget: Optional[float] = None

    def __post_init__(self):
        if self.memory_budget is not None:
            need = max(sum(self.stages[s].size for s in self.placement.stages_of(r)) for r in range(self.placement.pp))
            # The V's rank 0 holds a microbatch's two stages at once; a smaller cap deadlocks.
            if self.placement.kind == "v" and self.cap < need - 1e-9:
                raise ConfigError(f"memory budget {self.memory_budget:g} of 1F1B ({self.cap:g} stage-activations per "
                                  f"rank) cannot hold one microbatch's {need:g} on one rank; raise the budget")

    @property
    def stages(self) -> Tuple[StageCost, ...]:
        return stage_table(self.costs, self.placement.num_stages, self.stage_costs)

    @property
    def cap(self) -> Optional[float]:
        """The budget in (size-weighted) stage-activations per rank, as peak_vs_1f1b counts them."""
        if self.memory_budget is None:
            return None
        return self.memory_budget * one_f_one_b_peak(self.placement.pp, self.microbatches) * self.placement.chunks


def problem_of(schedule: Schedule, memory_budget: Optional[float] = None) -> Problem:
    """The problem a built schedule solves: its placement, costs and B/W split, under
    `memory_budget`, else the schedule's own budget, else its own peak (the optimum at the same memory)."""
    if memory_budget is None:
        memory_budget = schedule.memory_budget
    if memory_budget is None:
        memory_budget = max(simulate(schedule).peak_vs_1f1b)
    return Problem(schedule.name, schedule.placement, schedule.microbatches, schedule.costs, schedule.stage_costs,
                   schedule.split_backward, memory_budget)


@dataclass
class Result:
    schedule: Optional[Schedule]  # None when nothing feasible was found in the time limit
    makespan: Optional[float]  # the re-simulated makespan of `schedule`
    bound: float  # proven lower bound on the makespan
    status: str  # "optimal", "feasible" or "unknown" (no schedule found) / "infeasible"
    scale: int  # integer time units per cost unit
    rounded: bool  # costs were rounded to 1/scale
    wall_s: float
    work: float = 0.0  # the solver's deterministic time spent (machine-independent)

    @property
    def gap(self) -> Optional[float]:
        return None if self.makespan is None else (self.makespan - self.bound) / self.makespan

    def to_dict(self) -> dict:
        return {"status": self.status, "makespan": self.makespan, "lower_bound": self.bound, "gap": self.gap,
                "time_units_per_cost_unit": self.scale, "costs_rounded": self.rounded, "solve_s": self.wall_s}


def time_scale(values: Sequence[float]) -> Tuple[int, bool]:
    """Integer units per cost unit: the least common multiple of the values' decimal
    denominators when that is at most MAX_SCALE (exact), else a power of ten that resolves the
    smallest positive value to 1 part in ROUNDING (e.g. measured seconds), with rounded=True."""
    scale = 1
    for v in values:
        scale = math.lcm(scale, Fraction(repr(float(v))).denominator)
        if scale > MAX_SCALE:
            smallest = min(v for v in values if v > 0)
            return 10 ** max(0, math.ceil(math.log10(ROUNDING / smallest))), True
    return scale, False


def _ops(problem: Problem) -> List[Op]:
    kinds = (F, B, W) if problem.split else (F, BW)
    return [Op(k, mb, s) for s in range(problem.placement.num_stages) for mb in range(problem.microbatches) for k in kinds]


def _inputs(op: Op, problem: Problem) -> List[Tuple[Op, bool]]:
    """The ops `op` waits for, and whether each crosses ranks (comm.py's rule)."""
    S, pl = problem.placement.num_stages, problem.placement
    out = []
    msg = input_message(op, S)
    if msg is not None:
        kind = F if msg.kind == ACT else (B if problem.split else BW)
        out.append((Op(kind, op.microbatch, msg.src_stage), is_remote(msg, pl)))
    for before in local_predecessor(op) or ():
        out.append((Op(before, op.microbatch, op.stage), False))
    return out


def solve(problem: Problem, time_limit: float = 10.0, hint: Optional[Schedule] = None,
          workers: Optional[int] = None, seed: int = 0, work_limit: Optional[float] = None) -> Result:
    """Minimise the makespan of `problem` within `time_limit` seconds of solver time.

    With `work_limit` the solver stops after that much of its deterministic time (a count of
    its own work, the same on any machine) instead, on one worker unless `workers` says
    otherwise (interleaved, so still deterministic): the same call gives the same answer on
    a fast and a loaded machine, as tests need.  `time_limit` then only guards the wall.

    `hint` (a schedule of the same problem, e.g. today's generator) starts the search and,
    when it fits the cap, bounds the horizon.  A proven optimum's makespan does not depend on
    timing; which optimal order comes back may, with several workers (re-planning inside the
    runtime uses the planner, never this)."""
    require_ortools()
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    pl, S, m = problem.placement, problem.placement.num_stages, problem.microbatches
    table = problem.stages
    scale, rounded = time_scale([v for st in table for v in (st.F, st.B, st.W)] + [problem.costs.C])
    dur = {(k, s): round(table[s].of(k) * scale) for s in range(S) for k in (F, B, W, BW)}
    hop = round(problem.costs.C * scale)
    ops = _ops(problem)

    hint_sim = simulate(hint) if hint is not None else None
    hint_fits = hint_sim is not None and (problem.cap is None or max(hint_sim.peak_activations) <= problem.cap + 1e-9)
    if hint_fits and not rounded:
        horizon = round(hint_sim.makespan * scale)
    else:
        horizon = sum(dur[(op.kind, op.stage)] + hop for op in ops)

    model = cp_model.CpModel()
    start, end, interval = {}, {}, {}
    for op in ops:
        d = dur[(op.kind, op.stage)]
        start[op] = model.new_int_var(0, horizon - d, f"s_{op}")
        end[op] = start[op] + d
        interval[op] = model.new_fixed_size_interval_var(start[op], d, f"i_{op}")
    for op in ops:
        for src, remote in _inputs(op, problem):
            model.add(start[op] >= end[src] + (hop if remote else 0))
    for r in range(pl.pp):
        model.add_no_overlap([interval[op] for op in ops if pl.rank_of(op.stage) == r])
    for op in ops:  # each op kind of a stage runs its microbatches in index order (see above)
        if op.microbatch:
            model.add(start[op] >= end[Op(op.kind, op.microbatch - 1, op.stage)])
    if problem.cap is not None:
        sizes, size_scale = _integer_sizes(problem)
        cap = math.floor(problem.cap * size_scale + 1e-9)
        release = W if problem.split else BW
        for r in range(pl.pp):
            times, changes = [], []
            held = sorted(pl.stages_of(r))
            for i, s in enumerate(held):
                # Implied by the cap and FIFO (redundant, for propagation): when F(k)@s starts, each
                # stage t of this rank up to s holds its activations k+1-(W's of t done) >= 1, so
                # W(k-c)@t is done, c the room t has once the others hold one each.
                others = sum(sizes[t] for t in held[:i + 1])
                for t in held[:i + 1]:
                    c = (cap - others + sizes[t]) // sizes[t] if sizes[t] else m
                    for mb in range(max(c, 0), m):
                        model.add(start[Op(F, mb, s)] >= end[Op(release, mb - c, t)])
                for mb in range(m):
                    times += [start[Op(F, mb, s)], end[Op(release, mb, s)]]
                    changes += [sizes[s], -sizes[s]]
            # level(t): sizes of F's started minus W's ended at or before t (a W ending as an F
            # starts frees its room first, as in the simulator's count)
            model.add_reservoir_constraint(times, changes, 0, cap)
    makespan = model.new_int_var(0, horizon, "makespan")
    for op in ops:
        if op.kind in (W, BW):  # a stage's last op for its microbatch
            model.add(makespan >= end[op])
    model.minimize(makespan)
    if hint is not None:
        for r, timeline in enumerate(hint_sim.timeline):
            for op, s0, _ in timeline:
                if op in start:
                    model.add_hint(start[op], min(round(s0 * scale), horizon))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    if work_limit is not None:
        solver.parameters.max_deterministic_time = float(work_limit)
        solver.parameters.num_workers = workers or 1
        solver.parameters.interleave_search = True  # several workers in a fixed order: deterministic
    else:
        solver.parameters.num_workers = workers or min(8, os.cpu_count() or 1)
    solver.parameters.random_seed = seed
    code = solver.solve(model)
    wall = time.perf_counter() - t0
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        status = "infeasible" if code == cp_model.INFEASIBLE else "unknown"
        bound = solver.best_objective_bound / scale if code == cp_model.UNKNOWN else math.inf
        return Result(None, None, bound, status, scale, rounded, wall, solver.deterministic_time)
    ranks: List[List[Op]] = [[] for _ in range(pl.pp)]
    for op in sorted(ops, key=lambda o: solver.value(start[o])):
        ranks[pl.rank_of(op.stage)].append(op)
    # Microbatches are interchangeable to the solver; in order they are bit-exact (no later).
    solved = _schedule(problem, microbatch_order.relabel(ranks), scale if rounded else None)
    sim = simulate(solved)
    claimed = solver.objective_value / scale
    # Eager re-simulation starts every op no later than the solver did: never longer, and
    # exactly as long when the solver proved optimality.  Anything else is a model mismatch.
    if sim.makespan > claimed + 1e-9 * max(1.0, claimed):
        raise AssertionError(f"optimal: re-simulated makespan {sim.makespan} exceeds the solver's {claimed}")
    if code == cp_model.OPTIMAL and abs(sim.makespan - claimed) > 1e-9 * max(1.0, claimed):
        raise AssertionError(f"optimal: re-simulated makespan {sim.makespan} differs from the proven optimum {claimed}")
    bound = min(solver.best_objective_bound / scale, sim.makespan)
    status = "optimal" if code == cp_model.OPTIMAL else "feasible"
    solved.meta.update(optimal={"status": status, "lower_bound": bound, "of": problem.name,
                                "time_units_per_cost_unit": scale, "costs_rounded": rounded})
    return Result(solved, sim.makespan, bound, status, scale, rounded, wall, solver.deterministic_time)


def _integer_sizes(problem: Problem) -> Tuple[Dict[int, int], int]:
    scale, _ = time_scale([st.size for st in problem.stages] + [problem.cap or 1.0])
    return {s: round(st.size * scale) for s, st in enumerate(problem.stages)}, scale


def _schedule(problem: Problem, ranks: List[List[Op]], rounded_scale: Optional[int]) -> Schedule:
    """The solver's order as a verified schedule (the verifier also checks the memory budget)
    under the costs that were solved (rounded to 1/scale when they had to be)."""
    c, stage_costs = problem.costs, problem.stage_costs
    if rounded_scale:
        q = lambda v: round(v * rounded_scale) / rounded_scale  # noqa: E731
        c = Costs(q(c.F), q(c.B), q(c.W), q(c.C))
        if stage_costs is not None:
            stage_costs = tuple(StageCost(q(x.F), q(x.B), q(x.W), x.size) for x in stage_costs)
    return verify(Schedule(problem.name, problem.placement, problem.microbatches, c, ranks, {},
                           stage_costs, problem.memory_budget))
