"""The V-shape planner: the fastest schedule it can find under a memory budget.

For one problem (pp, microbatches, costs, stage costs, memory budget) it builds several
candidates and keeps the shortest under the simulator's rules:

  * the paper's building blocks as vshape.py lays them out (every plan of V-Min, V-Half and
    V-ZB that fits the cap), so the search is never worse than those constructions;
  * greedy list scheduling (`greedy`): whenever a rank is free it runs the most urgent op
    that is ready, under the per-rank cap, with a look-ahead that keeps memory feasible to
    the end (a microbatch enters a rank only while room stays reserved for its second
    chunk and for the second chunks of every microbatch already in flight, so no rank can
    ever wait for memory that never frees); W's fill waits, or run when memory is needed.
    Which op is most urgent is a priority rule; a fixed family of rules is tried;
  * blocks repeated and squeezed on unit slots (slots.py, `_squeezed_candidates`): the
    paper's V-Min and V-Half blocks and the uniform-offset family (the shortest blocks; in
    v-auto's long runs those of the best estimated plan instead, `_estimated`), warm-up and
    cool-down moved to their earliest free slots under the cap;
  * in v-auto's own plans, the blocks at the cap repeated, squeezed and reordered as the
    paper's released scheduler does (reorder.py: its warm-up and cool-down shapes, then every
    empty slot filled by the first later op that may move there), on long runs the best
    estimated first, within REORDER_OPS; the shortest is a late start (below,
    `_reordered_candidates`);
  * with few microbatches (m <= p, short runs), the squeezed and greedy candidates built
    for one stage-activation more, repaired under the cap (`refit`);
  * an improvement pass (`improve`) on the best of these: ops on the critical path moved
    earlier on their rank, then seeded local moves, each kept only if the simulated
    makespan (then the sum of rank finish times) drops, or stays, and the cap still holds;
  * then the best order's F's and B's kept and its W's placed anew by the greedy's rule
    (into waits at least theta * W long, or where memory needs them), kept if shorter;
  * on short runs at a named V-shape's cap, between V-Min's and V-Half's or above V-ZB's
    (between any named caps when m <= p), a search that may cross the cap at a price
    (`relax`; v-auto's own gets its share less what the named plan it includes spent): the tight cap blocks
    nearly every move that fits, so it goes through orders over the cap to shorter ones
    that fit again, kept if shorter; besides single ops it moves one microbatch's op along
    the whole pipeline at once (a chain move: the same op kind and chunk on every rank);
  * on short runs, one more improvement of the best order with ties of makespan broken by
    the F's and B's end times (a W waits for nobody), kept if shorter;
  * on short runs with m > p and a cap between V-Half's and V-ZB's, `delay_search`:
    the first chunk's backward delayed by one microbatch from some microbatch on, on
    every rank at once (`delayed`), then relaxed back under the cap; each try starts from
    the best order so far, and the best is kept if shorter;
  * justification (justify.py): the plan list-scheduled backward, then forward, each op
    into the first gap of its rank where it fits under the cap, with random restarts around
    it on short runs (`justify_search`), kept if shorter; it fills waits that no single move
    reaches (an op moved across many places at once, on every rank);
  * last, the cool-down list-scheduled anew (`relist`): each rank keeps its order up to its
    last F of a chunk (or a few microbatches earlier) and a greedy rule runs the rest under
    the real costs; on long runs first on the squeezed blocks (the best of them improved,
    kept if shorter than the plan so far; in v-auto then the best of the shortest blocks its
    estimate passed over, the best reordered block, and the second-best improved start,
    likewise and justified), then on the
    plan, then on that with rules that wait for the op they prefer instead of starting
    another just before it is ready (`hold`);
  * the plan's microbatches relabelled in order on every stage (microbatch_order.py): the
    moves above may leave two ops of a kind out of order, which changes the order gradients
    are added in; relabelled, the plan is no longer and holds the same memory.

A plan that reaches the problem's lower bound (`Problem.bound`) is optimal, so the steps stop
there: a start at the bound is the plan, the local searches end when they reach it, and the
late starts and final relists are skipped.

Everything is deterministic: the work is bounded by counts of simulated ops, never by the
clock, and the random moves use a fixed seed, so every rank computes the same schedule.
Results are cached per problem (plan_cache.py: in memory, and on disk for other processes
when MEGATRON_VSHAPE_PLAN_CACHE names a directory).

`_plan` runs them as six named steps: `_starts` (the candidates), `_moves` (which moves run
with how much work, from the run's size and where the cap lies), `_improve_starts`,
`_search_on`, `_late_starts` and `_relisted_end`.  The moves live beside this module: problem.py (the problem on integer op ids and its simulator), listing.py
(`greedy`, `relist`), local.py (`improve`, `relax`, `delay_search`, `refit`), justify.py,
slots.py and reorder.py.

The cap: `memory_budget` X is peak_vs_1f1b's unit (1F1B's rank 0 with plain stages is 1),
so a rank of the V may hold X * 2 * min(p, m) stage-activations, each weighted by its
stage's size (1 when stages are equal; at m >= p that is floor(X * 2p) plain ones).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule import microbatch_order, vshape
from ..schedule.blocks import EPS, Stuck
from ..schedule.errors import ConfigError
from ..schedule.ops import Costs, Schedule, StageCost, check_sizes, stage_table
from ..schedule.simulate import one_f_one_b_peak
from ..schedule.verify import verify
from . import justify, reorder, slots
from .listing import HOLD_RULES, RELIST_RULES, RULES, Listed, greedy, relist
from .local import delay_search, improve, refit, relax
from .plan_cache import PlanCache
from .problem import Problem

MAX_BUDGET = 2.0


def min_budget(pp: int) -> float:
    """V-Min's budget, the least the V-shapes serve: ((p+4)//3)/p of 1F1B."""
    return ((pp + 4) // 3) / pp


# Ops simulated by the search for one problem (selection plus improvement): bounds CPU time.
RULE_WORK = 30_000  # greedy ops (each costs several simulated ones)
IMPROVE_WORK = 2_000_000
IMPROVE_STARTS = 3
RETIME_THETAS = (0.0, 0.5, 1.0)  # W placements tried on the best order at the end
RELIST_SHARE = 4  # the relisted start's improve() gets 1/RELIST_SHARE of one start's work
IMPROVE_FULL_OPS = 2000  # runs up to this many ops get all of IMPROVE_WORK
RELAX_OPS = 400  # runs of up to this many ops get relax() (where: see _moves)
# relax()'s moves for one plan, up to RELAX_FULL_OPS ops (beyond, fewer by the square): a named
# V-shape's plan gets RELAX_MOVES_NAMED, and v-auto's own relax() gets the rest of its share,
# the named plan it includes having spent those.  v-auto's own share is half of what it was
# before justify_search (run after relax) took that time: it finds more per second there
# (git log -S JUSTIFY_MANY: what it was measured against).
RELAX_MOVES_NAMED = 15_000
RELAX_MOVES = 30_000  # with m <= p (improve()'s refit starts need time there)
RELAX_MOVES_MANY = 31_000  # with m > p, between V-Min's and V-Half's caps (v-auto's own 16,000: half of
JUSTIFY_MANY = 3  # what they were, their time given to JUSTIFY_MANY x justify_search()'s restarts there)
RELAX_MOVES_ABOVE = 32_500  # with m > p above V-ZB's cap (moves cost more where the cap rarely binds)
RELAX_FULL_OPS = 200
RELAX_SHARE = 2  # with m > p, v-auto's improve() gets 1/RELAX_SHARE of its work when relax() runs
DELAY_MOVES = 6_000  # relax()'s moves after each delay (fewer by the square beyond RELAX_FULL_OPS ops)
JUSTIFY_TRIES = 150  # justify_search()'s restarts at up to RELAX_FULL_OPS ops (fewer by ops beyond, to RELAX_OPS)
JUSTIFY_LONG_WORK = 12_000  # beyond RELAX_OPS ops: restarts x ops (docs/planner.md, "Planning time")
JUSTIFY_KICKS = 0.5  # where delay_search() runs: restarts more (x tries) that delay the first chunk's backward too
DELAY_TRIES = 6  # delay_search()'s tries at most (the planning time of short runs stays about 1.2 s)


def cap_of(pp: int, microbatches: int, budget: float, table: Optional[Sequence[StageCost]] = None) -> float:
    """Weighted stage-activations a rank may hold under `budget` (see the module docstring):
    floored where every stage's size is a whole number (a rank's sum is one then, so the
    same orders fit, and equal problems get equal caps), else the budget itself, as the
    verifier checks it (floored, stages of size 1.3 would lose up to one activation)."""
    cap = budget * 2 * one_f_one_b_peak(pp, microbatches)
    if table is None or all(float(c.size).is_integer() for c in table):
        return math.floor(cap + 1e-9)
    return cap


def budget_steps(pp: int, microbatches: int, high: float = MAX_BUDGET) -> List[Tuple[int, float]]:
    """Every cap on the V from V-Min's budget up to `high`, one stage-activation per step,
    each with the smallest budget that gives it: (cap, budget)."""
    unit = 2 * one_f_one_b_peak(pp, microbatches)  # stage-activations of 1F1B's rank 0
    low = min_budget(pp)
    first = -(-round(low * unit * 1e9) // 10**9)  # ceil without float noise
    return [(cap, max(low, cap / unit)) for cap in range(first, int(high * unit + 1e-9) + 1)]


def check_budget(name: str, pp: int, microbatches: int, budget: float, table: Sequence[StageCost]) -> float:
    low = min_budget(pp)
    if not (isinstance(budget, (int, float)) and low - 1e-12 <= budget <= MAX_BUDGET):
        raise ConfigError(f"{name}: --memory-budget {budget!r} is outside {low:.4g} (V-Min's ((p+4)//3)/p at pp={pp}) "
                          f"to {MAX_BUDGET:g}; give a fraction of 1F1B's activation memory in that range")
    cap = cap_of(pp, microbatches, budget, table)
    need = max(table[r].size + table[2 * pp - 1 - r].size for r in range(pp))
    if cap + EPS < need:
        more = next((k for k in range(microbatches + 1, pp + 1) if cap_of(pp, k, budget, table) + EPS >= need), None)
        fix = f"use microbatches >= {more}" if more else "raise --memory-budget"
        raise ConfigError(f"{name}: microbatches={microbatches} is too few for pp={pp} at memory budget {budget:g}: "
                          f"a rank may hold {cap:g} stage-activations but one microbatch needs {need:g} on one rank; {fix}")
    return cap


def _legacy(name: str, pp: int, m: int, costs: Costs, cap: float) -> List[Schedule]:
    """Today's constructions (vshape.PLANS, laid out under equal per-stage `costs`) at this
    cap, each built where it can be; the caller checks them under the real stage costs."""
    if cap < 2:
        return []
    caps_of = lambda k: [int(cap + EPS)] * pp  # noqa: E731
    user = Costs(2 * costs.F, 2 * costs.B, 2 * costs.W, costs.C)  # legacy_search takes them per rank
    if name in vshape.PLANS:  # today's generator exactly: the search is never worse than it
        groups = [vshape.PLANS[name]]
    else:
        groups = [[p for plans in vshape.PLANS.values() for p in plans]]
    out = []
    for plans in groups:
        try:
            out.append(vshape.legacy_search(name, pp, m, user, caps_of, plans))
        except (Stuck, ValueError, ConfigError):
            continue
    return out


def _greedy_candidates(P: Problem) -> List[Tuple[List[List[int]], str]]:
    """Every rule on a prefix of the run (the steady state repeats) within RULE_WORK ops;
    the best rule is then built at full length."""
    m_sel = min(P.m, max(2 * P.pp + 2, RULE_WORK // (6 * P.pp * len(RULES))))
    Q = P if m_sel == P.m else Problem(P.pp, m_sel, P.costs, P.table, P.cap)
    scored = []
    for k, rule in enumerate(RULES):
        try:
            got = greedy(Q, *rule)
        except Stuck:
            continue
        score = Q.evaluate(got)
        if score is not None:
            scored.append((score, k, got))
    scored.sort(key=lambda x: x[:2])
    out = []
    for _, k, got in scored[:1]:
        order, theta, reserve = RULES[k]
        try:
            out.append((got if Q is P else greedy(P, *RULES[k]), f"greedy {order} theta={theta:g} reserve {reserve}"))
        except Stuck:
            continue
    return out


BLOCK_OPS = 16_000  # ops squeezed for the uniform-offset blocks of one problem: bounds CPU time
STRETCHED = 4  # squeezed candidates carried to full length
RANK_RELIST_WORK = 40_000  # greedy ops for ranking squeezed candidates by their relisted cool-down
LATE_STRETCHED = 2  # squeezed candidates carried for the late start of the blocks the estimate passed over
WHOLE_OPS = 3000  # runs of up to this many ops are squeezed at full length


@lru_cache(maxsize=64)
def _uniform_blocks(pp: int):
    return slots.uniform_blocks(pp)


@lru_cache(maxsize=64)
def _steady_peaks(pp: int, sizes: Tuple[float, ...]) -> Tuple[float, ...]:
    """slots.steady_peak of every uniform block for these stage sizes (a v-auto plan and the
    named plan it includes ask for the same ones)."""
    view = SimpleNamespace(S=2 * pp, size=sizes)
    return tuple(slots.steady_peak(view, b) for b in _uniform_blocks(pp))


def _top_blocks(P: Problem) -> List[Tuple[str, slots.Block]]:
    """The uniform-offset blocks that use the most memory the cap allows (the steady state's
    bubble falls as blocks hold more), shortest first, within BLOCK_OPS squeezed ops."""
    out, work = [], BLOCK_OPS
    for _, block in _fitting_blocks(P):
        work -= 6 * P.S * min(P.m, slots.small_m(block))
        if work < 0:
            break
        out.append((f"uniform block {block[0]}/{block[1]}", block))
    return out


def _estimated(P: Problem, shortest: Sequence[Tuple[str, slots.Block]]) -> Tuple[List[Tuple[str, slots.Block]], List[Tuple[str, slots.Block]], List[slots.Block]]:
    """v-auto's long runs: the uniform-offset blocks at the cap to squeeze instead of
    `shortest` (_top_blocks' name-order list), chosen by a cheap estimate of their real-cost
    plan, within the ops that squeezing `shortest` would take; and the blocks of `shortest`
    it passed over (a late start: the estimate misjudges some); and the blocks it estimated,
    best first.

    The estimate of a block: squeezed once on min(m, p) microbatches (a whole warm-up and
    cool-down, where blocks of one steady peak differ most; steady mode, both passes) plus
    one steady period (slots.steady_period) for each microbatch more.  Estimates go first,
    while what is left still pays for one chosen block's squeeze: the shortest block (the
    name order's first, so it is never left unjudged), then the rest in order of steady
    period (the term that grows with m; ties shortest first); then the best-estimated are
    squeezed while the rest lasts.  Block length says little: at pp=10, m=23,
    2,2.2,1.6,0.05, cap 18 the six shortest of 50 blocks relisted to 152.4 at best, the
    block of the best estimate to 149.3 (the best of all 50)."""
    fitting = _fitting_blocks(P)
    if not fitting:
        return [], [], []
    Q = P if P.m <= P.pp else Problem(P.pp, P.pp, P.costs, P.table, P.cap)
    period = _steady_periods(P)
    squeeze = {b: _squeezed_ops(P, b) for _, b in fitting}
    work, guess = sum(squeeze[b] for _, b in shortest), {}
    for _, block in fitting[:1] + sorted(fitting[1:], key=lambda x: (period[x[1]], x[0])):
        if work - 6 * Q.S * Q.m < max(squeeze.values()):
            break
        work -= 6 * Q.S * Q.m
        got = [Q.evaluate(slots.orders(Q, at)) for at, _, _ in slots.squeeze_block(Q, block, ("steady",))]
        got = [score[0] for score in got if score is not None]
        guess[block] = min(got) + (P.m - Q.m) * period[block] if got else math.inf
    chosen, ranked = [], sorted(guess, key=guess.get)
    for block in ranked:
        if guess[block] == math.inf or work < squeeze[block]:
            break
        work -= squeeze[block]
        chosen.append((f"uniform block {block[0]}/{block[1]} (period {period[block]:g}) (estimate {guess[block]:.5g})", block))
    return chosen, [x for x in shortest if x[1] not in {b for _, b in chosen}], ranked


@lru_cache(maxsize=2)  # _estimated and _reordered_candidates of one problem ask for the same ones
def _steady_periods(P: Problem) -> Dict[slots.Block, float]:
    """slots.steady_period of every block at the cap, on as many microbatches as squeezing
    them takes (at most m)."""
    fitting = _fitting_blocks(P)
    m_r = min(P.m, max((slots.small_m(b) for _, b in fitting), default=P.m))
    R = P if m_r == P.m else Problem(P.pp, m_r, P.costs, P.table, P.cap)
    return {b: slots.steady_period(R, b) for _, b in fitting}


def _squeezed_ops(P: Problem, block: slots.Block) -> int:
    """Ops _squeezed_candidates squeezes for `block`: on min(m, slots.small_m) microbatches,
    in both modes where the run is squeezed whole (only the steady mode stays periodic)."""
    m_q = min(P.m, slots.small_m(block))
    whole = m_q == P.m or 6 * P.pp * P.m <= WHOLE_OPS
    return 6 * P.S * m_q * (len(slots.MODES) if whole else 1)


def _fitting_blocks(P: Problem) -> List[Tuple[int, slots.Block]]:
    """(length, block) of the uniform-offset blocks whose steady peak is the most the cap
    allows, shortest first."""
    peaks = [(peak, max(max(r) for r in b), b) for peak, b in zip(_steady_peaks(P.pp, tuple(P.size)), _uniform_blocks(P.pp))]
    top = max((x[0] for x in peaks if x[0] <= P.cap + EPS), default=0.0)
    return sorted((n, b) for peak, n, b in peaks if top - EPS <= peak <= P.cap + EPS)


def _paper_blocks(pp: int) -> List[Tuple[str, slots.Block]]:
    return [(f"paper's {kind} block", slots.paper_pattern(pp, kind)) for kind in ("min", "half")]


def _squeezed_candidates(P: Problem, blocks: Optional[Sequence[Tuple[str, slots.Block]]] = None,
                         carried: int = STRETCHED, whole: bool = True,
                         relisted: bool = False) -> List[Tuple[List[List[int]], str]]:
    """`blocks` (by default the paper's V-Min and V-Half blocks and the shortest of
    _top_blocks) repeated and squeezed on unit slots (slots.py), all on the same few
    microbatches and compared there (with `whole`, on all of a short run); the best
    `carried` are stretched to the full run.  With `relisted` (the caller relists the
    carried ones) they are compared with their cool-down relisted from its first keep point
    only (cheap), as many as RANK_RELIST_WORK allows: the squeeze's own cool-down ranks them
    badly, and the block that relists shortest is often not among the best few squeezed."""
    if blocks is None:
        blocks = _paper_blocks(P.pp) + _top_blocks(P)
    if not blocks:
        return []
    m_q = min(P.m, max(slots.small_m(b) for _, b in blocks))
    if m_q == P.m or (whole and 6 * P.pp * P.m <= WHOLE_OPS):  # short runs: squeeze them whole
        Q = P  # (modes that reshuffle the steady phase too are kept)
    else:
        Q = Problem(P.pp, m_q, P.costs, P.table, P.cap)
    found = []
    modes = slots.MODES if Q is P else ("steady",)  # only the steady mode stays periodic
    for name, block in blocks:
        for at_q, lazy_w, how in slots.squeeze_block(Q, block, modes):
            score = Q.evaluate(slots.orders(Q, at_q))
            if score is not None:
                found.append((score, len(found), block, at_q, lazy_w, f"{name} squeezed ({how})"))
    found.sort(key=lambda x: x[:2])
    ranked = list(found)
    if relisted:  # the best by the squeeze's own cool-down first, while the work lasts
        work, rules = RANK_RELIST_WORK, len(RELIST_RULES) * 6 * Q.pp * Q.m
        for k, (score, *rest) in enumerate(ranked[:work // rules]):
            ranked[k] = (min(score, relist(Q, slots.orders(Q, rest[2]), work=rules)[0]), *rest)
        ranked.sort(key=lambda x: x[:2])
    out, taken = [], set()
    for _, k, block, at_q, lazy_w, how in ranked:
        order = slots.stretched(P, Q, block, at_q, lazy_w)
        if order is not None:
            out.append((order, how))
            taken.add(k)
            if len(out) == carried:
                break
    if relisted:  # the best by the squeeze's own cool-down stays a candidate too
        for _, k, block, at_q, lazy_w, how in found:
            if k in taken:
                break
            order = slots.stretched(P, Q, block, at_q, lazy_w)
            if order is not None:
                out.append((order, how))
                break
    return out


REORDER_OPS = 50_000  # ops of the runs reorder.framework() builds for one problem: bounds CPU time


def _reordered_candidates(P: Problem, first: Sequence[slots.Block]) -> List[Tuple[Tuple[float, float, float], List[List[int]], str]]:
    """The blocks at the cap repeated, squeezed and reordered as the paper's released scheduler
    does (reorder.py), `first` first (v-auto's estimate), then the rest by steady period,
    within REORDER_OPS: the shortest of them with its score (none if none fits).  Stages of
    equal size only (the shapes' counts are in activations)."""
    if len(set(P.size)) > 1:
        return []
    period = _steady_periods(P)
    taken = set(first)
    rest = sorted((period[b], n, b) for n, b in _fitting_blocks(P) if b not in taken)
    work, found = REORDER_OPS, []
    for block in list(first) + [b for _, _, b in rest]:
        short = max(2 * P.pp, slots.small_m(block)) + 4  # a steady stretch to repeat (reorder._periodic_cut)
        work -= 6 * P.pp * min(max(P.m, 2 * P.pp), short)  # the ops of the run it is built on
        if work < 0:
            break
        order = reorder.framework(block, P.m, int(P.cap / P.size[0] + EPS), short)
        score = None if order is None else P.evaluate(order)
        if score is not None and P.fits(order):
            found.append((score, len(found), order, f"uniform block {block[0]}/{block[1]} reordered as the paper's"))
    found.sort(key=lambda x: (x[0][:2], x[1]))
    return [(score, order, how) for score, _, order, how in found[:1]]


REFIT_OPS = 400  # runs of up to this many ops get refit candidates (planning time)


def _refit_candidates(P: Problem) -> List[Tuple[Tuple[float, float, float], List[List[int]], str]]:
    """Few microbatches (m <= p: the whole run is warm-up and cool-down, no steady block): the
    squeezed and greedy candidates built for one stage-activation more, brought under the cap
    by refit(), each with its score.  Between the named budgets, repairing those beats
    building for the cap."""
    if P.m > P.pp or P.cap + 1 > 2 * P.m * max(P.size) + EPS:
        return []  # the cap holds every activation already: a larger one changes nothing
    Q = Problem(P.pp, P.m, P.costs, P.table, P.cap + 1)
    out = []
    for source in (_squeezed_candidates, _greedy_candidates):  # the best refit of each
        best = None
        for k, (order, how) in enumerate(source(Q)):
            got = refit(P, order, seed=k)
            score = None if got is None else P.evaluate(got)
            if score is not None and (best is None or score[:2] < best[0][:2]):
                best = (score, got, f"{how} at cap {Q.cap:g}, refit to {P.cap:g}")
        if best is not None:
            out.append(best)
    return out


UNIT_SIZE_MOVES = 7_500  # relax() moves for _unit_size_start (fewer by the square beyond RELAX_FULL_OPS ops)


def _unit_size_start(P: Problem, budget: float, moves: int) -> Optional[Tuple[Tuple[float, float, float], List[List[int]], str]]:
    """Stages of unequal activation sizes (a heavier embedding or output stage on rank 0): the
    best squeezed or greedy candidate built as if every activation were one plain stage's,
    brought under the real cap by relax(), with its score; None if relax() finds no order
    that fits.  Blocks built for the real sizes leave the rank with the heavier stage a
    microbatch short in every period, where these overflow it a little: at pp=3, m=10,
    per-stage 2,6,4,0 with a 1.3x embedding stage at V-Min's budget the plan was 322 from
    the other starts, 306.4 from this one (the optimum 304.4)."""
    unit = tuple(replace(c, size=1.0) for c in P.table)
    Q = Problem(P.pp, P.m, P.costs, unit, cap_of(P.pp, P.m, budget, unit))
    found = [(Q.evaluate(o), k, o, how) for k, (o, how) in enumerate(_squeezed_candidates(Q) + _greedy_candidates(Q))]
    found = [c for c in found if c[0] is not None]
    if not found:
        return None
    _, _, order, how = min(found, key=lambda c: (c[0][:2], c[1]))
    got, ms = relax(P, [list(o) for o in order], moves)
    if ms == math.inf:
        return None
    return P.evaluate(got), got, f"{how} for stage sizes of 1, relaxed under the cap ({ms:g})"


NAMED_BUDGETS = (("v-min", lambda p: ((p + 4) // 3) / p), ("v-half", lambda p: ((p + 2) // 2) / p), ("v-zb", lambda p: 1.0))
NAMED_BELOW_OPS = 3_000  # above this many ops v-auto skips it (planning time: 2 s at pp <= 16, m <= 128)


def _named_below(name: str, pp: int, m: int, budget: float) -> Optional[Tuple[str, float]]:
    """For v-auto: the named V-shape with the largest budget <= `budget` (None if none)."""
    if name != "v-auto":
        return None
    fits = [(n, b(pp)) for n, b in NAMED_BUDGETS if b(pp) <= budget + 1e-12]
    return max(fits, key=lambda x: x[1]) if fits else None


@dataclass
class _Starts:
    """The candidate orders of one problem, each (score, tie-break, order, how), the
    tie-break being the order the starts were made in: `cands` ranked, `refits` (other
    basins: improved besides the best few), and the late starts `relisted`, `by_length`
    (v-auto's shortest blocks its estimate passed over) and `reordered` (v-auto's
    blocks reordered as the paper's scheduler does), tried after everything else.
    `includes_named`: v-auto's candidates include the named plan below its budget, whose own
    search spent a share of the work."""
    cands: list
    refits: list
    relisted: list
    by_length: list
    includes_named: bool
    reordered: list
    own: bool  # v-auto's own plan on a long run (over RELAX_OPS ops): the late starts it alone gets


def _starts(name: str, P: Problem, costs: Costs, budget: float, below: Optional[Tuple[str, float]]) -> _Starts:
    """Step 1: every start the problem gets (see the module docstring), scored.  Of starts
    that score the same, the one made first ranks first: the named plan, the paper's block
    constructions, the squeezed blocks, the greedy rules."""
    pp, m, table, n_ops = P.pp, P.m, P.table, 6 * P.pp * P.m
    cands: List[Tuple[Tuple[float, float], int, List[List[int]], str]] = []
    includes_named = False
    if below is not None and n_ops <= NAMED_BELOW_OPS:
        # The V-shape named for the largest budget <= this one fits too: v-auto is never slower
        # than it, and never slower as the budget passes V-Min's, V-Half's and V-ZB's.
        try:
            order, how = _plan(below[0], pp, m, costs, table, below[1])
            cands.append((P.evaluate([list(o) for o in order]), len(cands), [list(o) for o in order],
                          f"{below[0]}'s plan: {how}"))
            includes_named = True
        except (ConfigError, Stuck):
            pass  # too few microbatches for that budget's cap: nothing to include
    for s in _legacy(name, pp, m, costs, P.cap):
        order = P.encode(s.ranks)
        got = P.evaluate(order)
        if got is not None and P.fits(order):
            cands.append((got, len(cands), order, f"blocks {s.meta.get('candidate')}"))
    # Squeezed blocks: the paper's, then the shortest at the cap.  On runs over RELAX_OPS ops
    # (not on short ones, where relax() runs: there these shortened no grid plan and cost
    # 0.25 s) each is relisted too, a start tried last (below).  In v-auto's own long runs
    # the blocks squeezed are those of the best estimates (_estimated), within the squeezed
    # ops the shortest would take.  In all of v-auto's own plans the blocks reordered as the
    # paper's scheduler does are a start tried last (in the named plans their caps are the
    # ones the paper's blocks were built for): short runs too, where v-auto lost to it (pp=5,
    # m=12, cap 8, 2,2.2,1.6,0.05: 78.3 against 78.2; with it 77.8).
    own = n_ops > RELAX_OPS and name not in dict(NAMED_BUDGETS)
    shortest = _top_blocks(P)
    ranked, passed, estimated = _estimated(P, shortest) if own else (shortest, [], [])
    relisted = []
    for order, how in _squeezed_candidates(P, _paper_blocks(P.pp) + ranked, relisted=n_ops > RELAX_OPS):
        cands.append((P.evaluate(order), len(cands), order, how))
        got, better = relist(P, order) if n_ops > RELAX_OPS else (None, None)
        if got is not None and got[:2] < cands[-1][0][:2]:
            relisted.append((got, len(relisted), better, how + ", cool-down relisted"))
    reordered = []  # the blocks reordered as the paper's scheduler does: a late start
    if name == "v-auto":
        for score, order, how in _reordered_candidates(P, estimated):
            reordered.append((score, len(reordered), order, how))
    by_length = []  # the shortest blocks the estimate passed over, squeezed in the steady mode: tried last
    for order, how in _squeezed_candidates(P, passed, LATE_STRETCHED, whole=False, relisted=True):
        got, better = relist(P, order)
        by_length.append((got, len(by_length), better, how + ", cool-down relisted"))
    for order, how in _greedy_candidates(P):
        got = P.evaluate(order)
        if got is not None:
            cands.append((got, len(cands), order, how))
    refits = []
    if n_ops <= REFIT_OPS:  # short runs, where the planning time allows it
        for score, order, how in _refit_candidates(P):
            refits.append((score, len(refits), order, how))
    if name == "v-auto" and n_ops <= RELAX_OPS and len(set(P.size)) > 1 and P.cap < cap_of(pp, m, 1.0, table) - EPS:
        # Below V-ZB's cap, where the sizes decide what fits: another basin again.
        got = _unit_size_start(P, budget, int(UNIT_SIZE_MOVES * min(1.0, RELAX_FULL_OPS / n_ops) ** 2))
        if got is not None:
            refits.append((got[0], len(refits), got[1], got[2]))
    if not cands + refits:
        raise Stuck(f"{name}: no candidate fits cap {P.cap:g} at pp={pp}, microbatches={m}")
    cands.sort(key=lambda c: (c[0][:2], c[1]))
    return _Starts(cands, refits, relisted, by_length, includes_named, reordered, own)


@dataclass
class _Moves:
    """Which of the search's moves run on one problem, and with how much work (step 2).

    Short runs get relax() too: the named V-shapes' (their blocks are built for equal stages
    and costs, and elsewhere improve() stops up to 8% above the optimum); between V-Min's and
    V-Half's caps, where their blocks leave memory unused and the tight cap stalls improve();
    above V-ZB's, where no block was built for the cap; and with m <= p (all warm-up and
    cool-down) between any two.  Between V-Half's and V-ZB's with m > p, relax() alone found
    nothing shorter on the instances with proven optima: delay_search() runs there instead.
    At V-Min's or V-Half's cap itself v-auto's own plan searches on as between them: with
    unequal stages the named plan's share of the search left plans up to 5.8% above the
    optimum there (docs/planner.md, "How good it is")."""
    named: bool  # a named V-shape's plan (not v-auto's own)
    relaxing: bool
    delaying: bool
    improve_work: int  # improve()'s simulated ops, shared by the starts
    relax_moves: int  # relax()'s moves at up to RELAX_FULL_OPS ops (fewer by `fewer` beyond)
    fewer: float  # (RELAX_FULL_OPS / ops)^2 beyond RELAX_FULL_OPS ops
    justify_tries: int
    justify_kicks: int


def _moves(name: str, P: Problem, below: Optional[Tuple[str, float]], includes_named: bool) -> _Moves:
    pp, m, cap, n_ops = P.pp, P.m, P.cap, 6 * P.pp * P.m
    work = int(IMPROVE_WORK * min(1.0, IMPROVE_FULL_OPS / n_ops))  # long runs: fewer, costlier moves
    if includes_named:
        work //= 2  # half the work was spent improving the named plan included
    half_cap, zb_cap = (cap_of(pp, m, b(pp), P.table) for _, b in NAMED_BUDGETS[1:])
    at_named = below is not None and cap < cap_of(pp, m, below[1], P.table) + EPS
    between = n_ops <= RELAX_OPS and below is not None and (not at_named or cap < zb_cap - EPS)
    delaying = between and m > pp and half_cap + EPS < cap < zb_cap - EPS
    named = name in dict(NAMED_BUDGETS)
    relaxing = (between and not delaying) or (named and n_ops <= RELAX_OPS and RELAX_MOVES_NAMED > 0)
    if relaxing and m > pp and not named:
        # The time goes to relax().  Not with m <= p, where improve()'s refit starts need it,
        # nor in a named plan, whose relax() is short (v-half's proven optimum at pp=4, m=8
        # needs its whole improve()).
        work //= RELAX_SHARE
    moves = 0
    if relaxing:
        if named:
            moves = RELAX_MOVES_NAMED
        else:
            moves = RELAX_MOVES if m <= pp else RELAX_MOVES_ABOVE if cap > zb_cap + EPS else RELAX_MOVES_MANY
            moves -= RELAX_MOVES_NAMED if includes_named else 0
    # Justified (list-scheduled backward, then forward), with random restarts around the
    # plan: on short runs as many as take about the time of JUSTIFY_TRIES at 200 ops, on long
    # ones JUSTIFY_LONG_WORK ops of list scheduling (30 restarts at 400 ops, 3 at 4,000, 1 up
    # to 12,000), then none: on long runs with m near p justification is the step that finds
    # the most per second, and more restarts never lengthen a plan.
    tries = int(JUSTIFY_TRIES * min(1.0, RELAX_FULL_OPS / n_ops)) if n_ops <= RELAX_OPS else JUSTIFY_LONG_WORK // n_ops
    if relaxing and not named and not at_named and m > pp and cap < zb_cap - EPS:  # between V-Min's and V-Half's caps
        tries *= JUSTIFY_MANY  # paid for by half of relax()'s moves (docs/planner.md, "How the search works")
    return _Moves(named, relaxing, delaying, work, moves, min(1.0, RELAX_FULL_OPS / n_ops) ** 2,
                  tries, int(tries * JUSTIFY_KICKS) if delaying else 0)


class _Best:
    """The best order so far, its score and how it was found; `finalists` are plans a later
    step displaced, relisted at the end too (a relist may shorten them more)."""

    def __init__(self, score, order, how, runner_up=()):
        self.score, self.order, self.how, self.finalists = score, order, how, []
        self.plain = score  # the plan before justification (see _late_starts)
        self.runner_up = list(runner_up)  # the second basin improve() left (a late start on long runs)

    def take(self, P: Problem, ms: float, order, step: str, keep_displaced: bool = False) -> bool:
        """Keep `order` (makespan `ms`) if shorter, its step named in `how`."""
        if ms < self.score[0] - EPS:
            if keep_displaced:
                self.finalists.append((self.score, self.order, self.how))
            self.how += f" + {step} ({self.score[0]:g} -> {ms:g})"
            self.score, self.order = P.evaluate(order), order
            return True
        return False


def _improve_starts(P: Problem, starts: _Starts, moves: _Moves) -> Tuple[_Best, int, int]:
    """Step 3: improve the best few distinct starts (different basins), sharing improve()'s
    work, and the refit ones (other basins again); then the best order's W's placed anew.
    Returns the best, the work left unused and how many starts ran."""
    cands = starts.cands
    chosen = [c for k, c in enumerate(cands) if k == 0 or c[0][:2] != cands[k - 1][0][:2]][:IMPROVE_STARTS]
    chosen += [c for c in starts.refits if all(c[0][:2] != s[0][:2] for s in chosen)]
    optimal = [c for c in chosen if c[0][0] <= P.bound + EPS]
    if optimal:
        chosen = optimal[:1]  # at the lower bound already: the plan (the steps below stop at once)
    results, left = [], 0
    for k, (score, _, order, how) in enumerate(chosen):
        better, unused = improve(P, [o[:] for o in order], moves.improve_work // len(chosen), seed=k)
        left += unused
        got = P.evaluate(better)
        if got[0] < score[0] - EPS:
            how += f" + improve ({score[0]:g} -> {got[0]:g})"
        results.append((got, k, better, how))
    results.sort(key=lambda c: (c[0][:2], c[1]))
    score, _, best, how = results[0]
    for theta in RETIME_THETAS:  # the best order's F's and B's kept, its W's placed anew
        try:
            got = greedy(P, "", theta, follow=best)
        except Stuck:
            continue
        new = P.evaluate(got)
        if new is not None and new[:2] < score[:2] and new[0] < score[0] + EPS and P.fits(got):
            score, best, how = new, got, how + f" + W's re-placed (theta={theta:g})"
    runner_up = next(([c] for c in results[1:] if c[0][0] > score[0] + EPS), [])
    return _Best(score, best, how, runner_up), left, len(chosen)


def _search_on(P: Problem, best: _Best, moves: _Moves, left: int, n_starts: int) -> None:
    """Step 4: the moves that go on from the best order (relax, one more improve, the
    delayed first chunk, justification, relax again), each kept only if shorter."""
    n_ops = 6 * P.pp * P.m
    if moves.relaxing:
        got, ms = relax(P, [list(o) for o in best.order], int(moves.relax_moves * moves.fewer), seed=n_starts)
        best.take(P, ms, got, "relaxed across the cap")
    if n_ops <= IMPROVE_FULL_OPS:
        left += moves.improve_work // n_starts  # short runs: time for one more start's share
    if left:
        # Improve the best once more, ties of makespan broken the other way (F's and B's
        # early, W's late): that leaves plateaus the first pass could not.
        better, _ = improve(P, [o[:] for o in best.order], left, seed=n_starts, tie=2)
        got = P.evaluate(better)
        if got[0] < best.score[0] - EPS:
            best.score, best.order, best.how = got, better, best.how + f" + improve, W's late on ties ({best.score[0]:g} -> {got[0]:g})"
    if moves.delaying:
        got, ms = delay_search(P, [list(o) for o in best.order], int(DELAY_MOVES * moves.fewer), min(P.m, DELAY_TRIES))
        best.take(P, ms, got, "first chunk's backward delayed")
    # The plan itself is justified in two rounds, beyond that in one: a third gained nothing at
    # pp=16, m=20 to 128, and a second costs what the first did and gained nothing at pp=16,
    # m=128 or pp=32, m=256.
    tries = moves.justify_tries
    best.plain = best.score  # a late start that would have displaced this plan is relisted too
    got, ms = justify.justify_search(P, [list(o) for o in best.order], tries, seed=n_starts,
                                     rounds=2 if tries else 1, kicks=moves.justify_kicks)
    best.take(P, ms, got, "justified", keep_displaced=n_ops > RELAX_OPS)  # long runs: relisted at the end too
    if moves.relaxing and n_ops > RELAX_FULL_OPS:
        # Beyond RELAX_FULL_OPS ops the moves above fall as the square of RELAX_FULL_OPS / ops,
        # and the planning time with them: from pp=5 on (m near p) that left plans up to 3%
        # above the best known, which more moves reach.  So one more relax() from the best,
        # with the moves that bring the total to RELAX_FULL_OPS / ops of the full count
        # (about the same planning time at every size): kept if shorter, and the plan it
        # displaces is relisted at the end too.  Not after delay_search(): there it gained
        # 0.05% a plan for 0.3-0.4 s, the least per second of any step.
        more = moves.relax_moves * (RELAX_FULL_OPS / n_ops - moves.fewer)
        got, ms = relax(P, [list(o) for o in best.order], int(more), seed=n_starts + 1)
        best.take(P, ms, got, "relaxed again", keep_displaced=True)


def _late_starts(P: Problem, best: _Best, starts: _Starts, moves: _Moves, plain, n_starts: int) -> None:
    """Step 5: the best relisted block, then the best of the shortest blocks v-auto's estimate
    passed over, then the best block reordered as the paper's scheduler does, then on v-auto's
    long runs the second-best start improve() left (those three justified once too:
    justification gains most there, and not always from the basin that was shortest before
    it), each improved with a quarter of one start's share (planning time), kept if shorter:
    starts in their own basins, tried after the rest so that they never displace them (the
    plan is never longer for them).  `plain` is the plan before justification: a late start
    that would have displaced it is relisted too.  Their justification restarts are
    JUSTIFY_LONG_WORK ops of list scheduling at every size, as on long runs (short runs give
    their own plan's justification many more, where it is the main search)."""
    runner_up = best.runner_up if starts.own else []
    tries = min(moves.justify_tries, JUSTIFY_LONG_WORK // (6 * P.pp * P.m))
    for k, late in enumerate((starts.relisted, starts.by_length, starts.reordered, runner_up)):
        if not late or best.score[0] <= P.bound + EPS:
            continue
        got, _, order, why = min(late, key=lambda c: (c[0][:2], c[1]))
        order, _ = improve(P, order, moves.improve_work // (RELIST_SHARE * n_starts), seed=n_starts + 1 + k)
        why += f" + improve ({got[0]:g} -> {P.evaluate(order)[0]:g})"
        if late is not starts.relisted:  # justified, as the starts they compete with were
            order, ms = justify.justify_search(P, order, tries, seed=n_starts, rounds=1)
            why += f" + justified ({ms:g})"
        got = P.evaluate(order)
        if got[0] < best.score[0] - EPS:
            best.finalists.append((best.score, best.order, best.how))
            best.score, best.order, best.how = got, order, why
        elif got[0] < plain[0] - EPS:
            best.finalists.append((got, order, why))
        plain = min(plain, got, key=lambda c: c[0])


def _relisted_end(P: Problem, best: _Best) -> Tuple[List[List[int]], str]:
    """Step 6: the plan is relisted last, and so is each plan a later step displaced (it may
    relist shorter): each plan is at most as long as without the late steps."""
    ends = []
    for k, (was, order, why) in enumerate(best.finalists + [(best.score, best.order, best.how)]):
        if was[0] <= P.bound + EPS:
            ends.append((was[0], -k, order, why + " (reaches the lower bound: optimal)"))
            continue
        prefixes: Dict[Tuple[int, int], Listed] = {}
        mine = [list(o) for o in order]
        got, again = relist(P, mine, prefixes=prefixes)
        # Then the rules that wait for the op they prefer: a list rule never idles, so in the
        # cool-down it starts a first-chunk B just before the second-chunk B that the chain
        # through every rank waits for (kept only if shorter, so no plan gets longer).
        held, waited = relist(P, again, rules=HOLD_RULES, prefixes=prefixes if again is mine else None)
        if held[:2] < got[:2]:
            got, again = held, waited
        if got[0] < was[0] - EPS:
            ends.append((got[0], -k, again, why + f" + cool-down relisted ({was[0]:g} -> {got[0]:g})"))
        else:
            ends.append((was[0], -k, order, why))
    _, _, order, how = min(ends, key=lambda e: e[:2])
    return order, how


@PlanCache
def _plan(name: str, pp: int, m: int, costs: Costs, table: Tuple[StageCost, ...], budget: float) -> Tuple[Tuple[Tuple[int, ...], ...], str]:
    """The search: starts, the moves this problem gets, improve the best starts, search on
    from the best, the late starts, the cool-down relisted; then microbatches in order."""
    P = Problem(pp, m, costs, table, check_budget(name, pp, m, budget, table))
    below = _named_below(name, pp, m, budget)
    starts = _starts(name, P, costs, budget, below)
    moves = _moves(name, P, below, starts.includes_named)
    best, left, n_starts = _improve_starts(P, starts, moves)
    _search_on(P, best, moves, left, n_starts)
    _late_starts(P, best, starts, moves, best.plain, n_starts)
    order, how = _relisted_end(P, best)
    # Moves of single ops may leave two of a kind out of microbatch order on a stage; in
    # order, gradients add up as in the non-pipelined model (never longer, same memory).
    order = P.encode(microbatch_order.relabel([[P.op(i) for i in o] for o in order]))
    return tuple(tuple(o) for o in order), how


def plan(name: str, pp: int, microbatches: int, costs: Optional[Costs], budget: float,
         stage_costs: Optional[Sequence[StageCost]] = None) -> Schedule:
    """The best verified V-shape schedule found under `budget` (peak_vs_1f1b units), with
    `costs` as users give them (per rank) and `stage_costs` per stage when unequal."""
    check_sizes(name, pp, microbatches)
    costs = (costs or Costs()).per_stage(2)
    if stage_costs is not None:
        from ..schedule.stage_costs import fit

        stage_costs = fit(stage_costs, 2 * pp, f"{name} at pp={pp}")
    table = stage_table(costs, 2 * pp, stage_costs)
    order, how = _plan(name, pp, microbatches, costs, table, float(budget))
    P = Problem(pp, microbatches, costs, table, cap_of(pp, microbatches, budget, table))
    s = P.schedule(name, order, float(budget), stage_costs, {"plan": how, "makespan": P.evaluate(order)[0]})
    return verify(s)


def lower_bound(schedule: Schedule) -> Optional[float]:
    """Problem.bound of a V-shape schedule's problem (its costs and stage costs): no order of
    its ops is shorter, whatever the memory; None for other placements."""
    if schedule.placement.kind != "v" or not schedule.split_backward:
        return None
    pp, S = schedule.pp, 2 * schedule.pp
    return Problem(pp, schedule.microbatches, schedule.costs, stage_table(schedule.costs, S, schedule.stage_costs), math.inf).bound
