"""Local search on a plan's per-rank orders, each move simulated (problem.Rerun).

`improve` moves ops on the critical path earlier, then seeded moves of any op a few places
either way, kept where the makespan drops or stays and the cap holds; `relax` may cross the
cap at a price that adapts, so a tight cap does not block it; `delay_search` delays the
first chunk's backward from some microbatch on and relaxes back under the cap; `refit`
repairs an order made for a larger cap.  Work is a count of simulated ops or moves, and
every random move is seeded: the same inputs give the same plan on every rank.
"""
from __future__ import annotations

import math
import random
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule.blocks import EPS
from .problem import Problem, Rerun

STALE_KICKS = 5  # kicks in a row without a new best end the improvement
MAX_SWEEPS = 100  # moves per op (6 distances) an improvement tries at most
RELAX_PRICE = 1.0  # lam's start: this many mean ops' time per stage-activation over the cap
RELAX_ADAPT, RELAX_RISE, RELAX_FALL = 200, 1.3, 1.15  # lam's update: every so many moves
STEPS = (-3, -2, -1, 1, 2, 3)  # how far improve() and relax() move an op on its rank
RELAX_CHAIN = 0.3  # the share of relax()'s moves that are chain moves (_chain_move)


def _critical(P: Problem, order: List[List[int]]) -> List[Tuple[int, int]]:
    """(rank, index) of ops on a critical path that wait for their rank, not their input:
    moving one of them earlier is what can shorten the run."""
    S, dur = P.S, P.dur
    end, free = P.blank(), [0.0] * P.pp
    P.run(order, math.inf, end, [0] * P.pp, free)  # the eager run: end times, each rank's finish
    where = {o: (r, i) for r, ops in enumerate(order) for i, o in enumerate(ops)}
    r = max(range(P.pp), key=free.__getitem__)
    i = len(order[r]) - 1
    path = []
    while i >= 0:
        o = order[r][i]
        slot, s = o % 3, (o // 3) % S
        start = end[o] - dur[s][slot]
        deps = P.inputs(o)
        prev_end = end[order[r][i - 1]] if i else 0.0
        bound = next((d for d, h in deps if abs(end[d] + h - start) < EPS and where[d][0] != r), None)
        if bound is not None and abs(prev_end - start) > EPS:
            r, i = where[bound]
            continue
        if i:
            path.append((r, i))
        i -= 1
    return path


def improve(P: Problem, order: List[List[int]], work: int, seed: int = 0, patience: int = 250,
            tie: int = 1) -> Tuple[List[List[int]], int]:
    """Iterated local search, kept only where (makespan, then evaluate's tie-breaker `tie`)
    drops and the cap holds; at most `work` simulated ops in all (a count, so the result
    never depends on the clock), and the work left when it converged is returned with the
    best order.  First ops on the critical path move earlier on their rank; then seeded
    moves of any op a few places either way, sideways ones (no worse) taken too so the
    search crosses plateaus of equal makespan; after `patience` moves in a row rejected, a
    kick (a few random valid moves taken whatever they cost) leaves the local optimum, and
    the best order seen is returned."""
    sim = Rerun(P, order)
    score = sim.score
    n_ops = sum(len(o) for o in order)
    # Moves tried, each counted as a whole run; and tiny runs (under ~60 ops), where a move
    # costs its fixed overhead more than its ops, at most MAX_SWEEPS times each op's moves.
    budget = work // max(1, n_ops)
    swept = budget > MAX_SWEEPS * 6 * n_ops
    if swept:
        budget = MAX_SWEEPS * 6 * n_ops
    rng = random.Random(seed)
    best, best_score = [o[:] for o in order], score
    if score[0] <= P.bound + EPS:
        budget = 0  # nothing is shorter than the lower bound

    def attempt(r: int, i: int, j: int, force: bool = False, sideways: bool = False) -> bool:
        nonlocal score, budget, best, best_score
        if j < 0 or j >= len(order[r]) or i == j:
            return False
        budget -= 1
        ops = order[r]
        new = ops[:]
        new.insert(j, new.pop(i))
        if P.peak(new) > P.cap + EPS:
            return False
        order[r] = new
        got = sim.trial(order, {r: min(i, j)}, math.inf if force else score[0] + EPS)
        if got is not None and (force or got[0] < score[0] - EPS or (got[0] < score[0] + EPS and got[tie] < score[tie] + (EPS if sideways else -EPS))):
            score = got
            sim.commit(order)
            if got[0] < best_score[0] - EPS or (got[0] < best_score[0] + EPS and got[tie] < best_score[tie] - EPS):
                best, best_score = [o[:] for o in order], got
                if got[0] <= P.bound + EPS:
                    budget = 0
            return True
        order[r] = ops
        return False

    while budget > 0:
        better = False
        budget -= 2  # finding the critical path costs about two simulations
        for r, i in _critical(P, order):
            for d in (1, 2, 3):
                if budget <= 0:
                    break
                if attempt(r, i, i - d):
                    better = True
                    break
            if better or budget <= 0:
                break
        if not better:
            break
    idle, stale, last_best = 0, 0, best_score
    while budget > 0:
        r = rng.randrange(P.pp)
        i = rng.randrange(len(order[r]))
        if attempt(r, i, i + rng.choice(STEPS), sideways=True):
            idle = 0
            continue
        idle += 1
        if idle >= patience:  # kick: leave this local optimum from where the best one is
            stale = stale + 1 if best_score == last_best else 0
            last_best = best_score
            if stale >= STALE_KICKS:
                break  # converged: kicks from the best order keep finding nothing better
            order[:] = [o[:] for o in best]
            score, idle, kicked = sim.reset(order), 0, 0
            while kicked < 3 and budget > 0:
                r = rng.randrange(P.pp)
                i = rng.randrange(len(order[r]))
                kicked += attempt(r, i, i + rng.choice((-2, -1, 1, 2)), force=True)
    return best, 0 if swept else max(0, budget) * n_ops


def _overflow_area(P: Problem, ops: Sequence[int]) -> float:
    """How far a rank's order goes over the cap, summed over its F's (0 when it fits)."""
    cap, over = P.cap, P.cap + EPS
    return sum(x - cap for x, o in zip(P.live(ops), ops) if x > over and o % 3 == 0)


def _area_after(P: Problem, old: List[int], new: List[int], lo: int, live: List[float], area: float) -> float:
    """_overflow_area of `new`, a rank's order that differs from `old` (whose live() is
    `live` and overflow area `area`) only from position lo over a few places: the same
    area, not summed again, when no F in those places goes over the cap in either."""
    hi, over, n = lo, P.cap + EPS, len(new)
    while hi < n and new[hi] != old[hi]:
        hi += 1
    for k in range(lo, hi):
        if live[k] > over and old[k] % 3 == 0:
            return _overflow_area(P, new)
    now, delta = (live[lo - 1] if lo else 0.0), P.delta
    for o in new[lo:hi]:
        now += delta[o]
        if now > over and o % 3 == 0:
            return _overflow_area(P, new)
    return area


def _move(P: Problem, ops: List[int], i: int, j: int) -> Optional[Tuple[List[int], int]]:
    """A rank's order with ops[i] moved to position j, and the first position changed; None
    when j is off the order or the move is futile."""
    if not 0 <= j < len(ops) or P.futile(ops, i, j):
        return None
    new = ops[:]
    new.insert(j, new.pop(i))
    return new, min(i, j)


def _single_move(P: Problem, order: List[List[int]], rng: random.Random) -> Dict[int, Tuple[List[int], int]]:
    """relax()'s plain move: one op a few places either way on its rank, as {rank: (its new
    order, the first position changed)}; empty when futile."""
    r = rng.randrange(P.pp)
    i = rng.randrange(len(order[r]))
    got = _move(P, order[r], i, i + rng.choice(STEPS))
    return {} if got is None else {r: got}


def _chain_move(P: Problem, order: List[List[int]], rng: random.Random) -> Dict[int, Tuple[List[int], int]]:
    """relax()'s chain move: one microbatch's F, B or W of one chunk moved the same few places
    on every rank at once (on each, the op of that chunk's stage there), as _single_move's
    changes.  It moves a microbatch later or earlier along the whole pipeline; the same move
    on one rank alone only makes the others wait, so single moves rarely get there."""
    j, slot, chunk = rng.randrange(P.m), rng.randrange(3), rng.randrange(2)
    d = rng.choice(STEPS)
    out = {}
    for s in range(chunk * P.pp, (chunk + 1) * P.pp):
        r = P.rank[s]
        i = order[r].index(3 * (j * P.S + s) + slot)
        got = _move(P, order[r], i, i + d)
        if got is not None:
            out[r] = got
    return out


def relax(P: Problem, order: List[List[int]], moves: int, seed: int = 0) -> Tuple[List[List[int]], float]:
    """Local search that may cross the memory cap at a price: moves of an op a few places
    either way are kept when makespan + lam * (memory over the cap, summed) does not grow;
    lam rises while the order is over the cap and falls while it fits, so the search
    oscillates around the cap instead of stopping at it.  Under a tight cap (between V-Min's
    and V-Half's budgets) nearly every move that fits is blocked, and improve() stalls far
    from the optimum; through orders over the cap, this one reaches orders that fit again
    and are shorter.  A share RELAX_CHAIN of the moves are chain moves (_chain_move).
    Returns the shortest order that fits (the start if none is shorter; makespan inf if
    neither the start nor any order seen fits) and its makespan, after `moves` moves tried."""
    rng = random.Random(seed)
    sim = Rerun(P, order)
    over = [_overflow_area(P, o) for o in order]
    lives = [list(P.live(o)) for o in order]  # of the current order, for _area_after
    mean_op = sum(map(sum, P.dur)) / (3 * len(P.dur))
    lam = RELAX_PRICE * mean_op  # time charged per stage-activation over the cap
    value = sim.score[0] + lam * sum(over)
    best, best_ms = [o[:] for o in order], (math.inf if sum(over) else sim.score[0])
    for move in range(moves):
        if best_ms <= P.bound + EPS:
            break  # nothing is shorter than the lower bound
        changes = _chain_move(P, order, rng) if rng.random() < RELAX_CHAIN else _single_move(P, order, rng)
        if changes:
            was = {r: (order[r], over[r]) for r in changes}
            for r, (new, lo) in changes.items():
                order[r], over[r] = new, _area_after(P, order[r], new, lo, lives[r], over[r])
            excess = sum(over)
            price = lam * excess
            got = sim.trial(order, {r: lo for r, (_, lo) in changes.items()}, value - price + EPS)
            if got is not None and got[0] + price < value + EPS:
                sim.commit(order)
                for r in changes:
                    lives[r] = list(P.live(order[r]))
                value = got[0] + price
                if got[0] < best_ms - EPS and excess == 0.0:
                    best, best_ms = [o[:] for o in order], got[0]
            else:
                for r, (ops, area) in was.items():
                    order[r], over[r] = ops, area
        if move % RELAX_ADAPT == RELAX_ADAPT - 1:
            lam = lam * RELAX_RISE if sum(over) else lam / RELAX_FALL
            value = sim.score[0] + lam * sum(over)
    return best, best_ms


def delayed(P: Problem, order: Sequence[Sequence[int]], first: int) -> List[List[int]]:
    """`order` with the first chunk's backward (its B's and W's, on every rank) of microbatches
    `first`..m-1 one microbatch later: their eager start times pushed back by one
    microbatch's mean work on a rank, each rank's ops re-sorted by those times.  Everything
    moved only waits for ops moved too, or for ops that stay, so every dependency still
    goes forward in time and the new order cannot deadlock.  Between V-Half's and V-ZB's
    caps the proven optima run those B's about this much later than our constructions do,
    behind the second chunk's work: they fill the cool-down, where ranks otherwise wait."""
    S, pp = P.S, P.pp
    start = P.starts(order)
    shift = P.microbatch_work()
    moved = {3 * (j * S + s) + k for j in range(first, P.m) for s in range(pp) for k in (1, 2)}
    def when(o: int) -> float:
        return start[o] + (shift if o in moved else 0.0)
    return [sorted(ops, key=when) for ops in order]  # stable: ties keep their order


def delay_search(P: Problem, order: List[List[int]], moves: int, tries: int) -> Tuple[List[List[int]], float]:
    """Iterated: from the best order so far, the first chunk's backward delayed from microbatch
    `first` on (delayed()), for `tries` values of `first` spread over the run, each
    delayed order relaxed back under the cap (relax(), `moves` moves); kept when no longer.
    Between V-Half's and V-ZB's caps no local move reaches those orders: each one alone only
    makes the run longer."""
    best, best_ms = order, P.evaluate(order)[0]
    for k in range(tries):
        if best_ms <= P.bound + EPS:
            break
        start = delayed(P, best, k * P.m // tries)
        if P.evaluate(start) is None:
            continue  # only with ops that take no time, tied on every rank of a cycle
        got, ms = relax(P, start, moves, seed=k)
        if ms < best_ms + EPS:
            best, best_ms = got, ms
    return best, best_ms


REFIT_WORK = 300_000  # simulated ops per order brought under a smaller cap (bounds CPU time)


def _overflow(P: Problem, ops: Sequence[int]) -> int:
    """Position of the first F that takes the rank over the cap, or -1."""
    live, S, size, cap = 0.0, P.S, P.size, P.cap + EPS
    for k, o in enumerate(ops):
        if o % 3 == 0:
            live += size[(o // 3) % S]
            if live > cap:
                return k
        elif o % 3 == 2:
            live -= size[(o // 3) % S]
    return -1


def refit(P: Problem, order: List[List[int]], seed: int = 0, work: int = REFIT_WORK) -> Optional[List[List[int]]]:
    """An order made for a larger cap brought under P's by local repair, or None: at a rank's
    first overflow, the F moves after one of the next W's, or a W whose B ran already moves
    before it, or the F a few places later; a move is kept when the memory over the cap
    (summed over ranks) drops, or stays and the makespan does not grow.  At most `work`
    simulated ops (each move a whole run); it gives up after 2 * pp overflows in a row where
    no move helps.  Deterministic."""
    rng = random.Random(seed)
    order = [o[:] for o in order]
    excess = [max(0.0, P.peak(o) - P.cap) for o in order]  # per rank; only a moved rank's changes
    got = P.evaluate(order)
    if got is None:
        return None
    score, tries, failed = (sum(excess), got[0]), 0, 0
    while score[0] > EPS and tries * P.m * 6 * P.pp < work:
        r = rng.choice([q for q in range(P.pp) if excess[q] > EPS])
        ops = order[r]
        k = _overflow(P, ops)
        at = {o: i for i, o in enumerate(ops)}
        moves = [(k, i) for i in [i for i in range(k + 1, len(ops)) if ops[i] % 3 == 2][:4]]
        moves += [(i, k) for i in range(k + 1, len(ops)) if ops[i] % 3 == 2 and at[ops[i] - 1] < k]
        moves += [(k, k + d) for d in (1, 2, 3) if k + d < len(ops)]
        rng.shuffle(moves)
        for i, j in moves:
            tries += 1
            new = ops[:]
            new.insert(j, new.pop(i))
            order[r] = new
            got = P.evaluate(order)
            if got is not None:
                was, excess[r] = excess[r], max(0.0, P.peak(new) - P.cap)
                trial = (sum(excess), got[0])
                if trial[0] < score[0] - EPS or (trial[0] < score[0] + EPS and trial[1] < score[1] + EPS):
                    score = trial
                    break
                excess[r] = was
            order[r] = ops
        else:
            failed += 1
            if failed >= 2 * P.pp:
                return None  # no move helps at any overflow: a local minimum above the cap
            continue
        failed = 0
    return order if score[0] <= EPS else None
