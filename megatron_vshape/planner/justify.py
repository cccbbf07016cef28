"""Justification: re-timing a V-shape plan by list scheduling it backward, then forward.

A plan is one order of ops per rank; the simulator runs each op as early as its inputs and
its rank allow.  `justify` re-times it the way forward-backward improvement does for
resource-constrained project scheduling:

  * backward: every op as late as possible before the plan's end, taken by decreasing end
    time, each into the latest gap of its rank where it fits (the mirror problem: the
    dependencies reversed, a W takes memory and an F frees it);
  * forward: every op as early as possible, taken by increasing start in that backward
    schedule, each into the earliest gap of its rank where it fits;

each op going into a gap where it fits in time and keeps its rank's memory under the cap at
every later position.  An op can only land earlier than where the order it came from had it
(the last position of its rank is always free in time and memory, see `schedule`), so a
justified plan is never longer, and the gaps it fills change the order: an op moved into a
wait on another rank's behalf, which no single move of the local searches reaches.

`justify_search` perturbs the start times in a random window of the plan with seeded noise,
list-schedules the ops in that order, justifies, and keeps the result when it is no longer:
random restarts around the plan, each one landing on a justified (locally tight) schedule.  On the planner's weakest
instances (pp=4 between V-Min's and V-Half's budgets, m 9..12, a hop latency or unequal F, B,
W) it reaches schedules that `relax`'s moves did not within many times the work.  Its
kicked restarts, which also delay the first chunk's backward by part of a microbatch, reach
the shape of the optima between V-Half's and V-ZB's caps.

Pure Python and deterministic (seeded; the work is a count of list-scheduled ops), so every
rank computes the same plan.
"""
from __future__ import annotations

import bisect
import heapq
import math
import random
from typing import List, Optional, Sequence, Tuple

from ..schedule.blocks import EPS

REACH = 64  # how many positions of its rank an op may pass (bounds the work per op on long runs)


class Graph:
    """A problem's dependencies both ways, with the hop after each: `ahead[o]` the ops `o`
    waits for, `behind[o]` those that wait for it; and the memory step of each op forward
    (an F takes its stage's size, a W frees it) and in the mirror problem (the other way)."""

    def __init__(self, P):
        n = P.n
        self.ahead: List[List[Tuple[int, float]]] = [P.inputs(o) for o in range(n)]
        self.behind: List[List[Tuple[int, float]]] = [[] for _ in range(n)]
        for o in range(n):
            for d, hop in self.ahead[o]:
                self.behind[d].append((o, hop))
        self.step = list(P.delta)
        self.mirror_step = [-x for x in P.delta]


def schedule(P, g: Graph, key: Sequence[float], backward: bool = False) -> Optional[Tuple[List[List[int]], List[float]]]:
    """Serial list scheduling with insertion: the op of least `key` whose inputs are placed
    goes into the earliest gap of its rank where it fits in time and where its memory step
    keeps its rank under the cap at its own and every later position (later ops only add
    frees below it).  An op that fits nowhere waits until its rank frees memory.  `backward`
    schedules the mirror problem (see Graph).  Returns each rank's order by start time and
    every op's end time, or None when every op left waits for memory.

    When `key` lists the ops by start time in a plan that fits the cap, each op's rank holds
    exactly the ops that started before it there, so the rank's last position has the plan's
    memory at that point (under the cap), and every op ends no later than in that plan."""
    ahead, step = (g.behind, g.mirror_step) if backward else (g.ahead, g.step)
    after = g.ahead if backward else g.behind
    n, pp, cap, span, rank = P.n, P.pp, P.cap + EPS, P.span, P.op_rank
    starts: List[List[float]] = [[] for _ in range(pp)]
    ends: List[List[float]] = [[] for _ in range(pp)]
    ops: List[List[int]] = [[] for _ in range(pp)]
    held: List[List[float]] = [[] for _ in range(pp)]  # memory after each position
    end = [0.0] * n
    waiting = [len(a) for a in ahead]
    heap = [(key[o], o) for o in range(n) if not waiting[o]]
    heapq.heapify(heap)
    parked: List[List[int]] = [[] for _ in range(pp)]
    placed = 0
    pop, push, insort = heapq.heappop, heapq.heappush, bisect.bisect_left
    while heap:
        _, o = pop(heap)
        r, d, dm = rank[o], span[o], step[o]
        ready = 0.0
        for a, hop in ahead[o]:
            t = end[a] + hop
            if t > ready:
                ready = t
        st, en, hd = starts[r], ends[r], held[r]
        k = len(st)
        i = insort(st, ready + d - EPS)  # an op of this rank starting sooner leaves it no room
        if i < k - REACH:
            i = k - REACH
        if dm > 0:
            # It raises the memory at its own position and every later one: it goes after the
            # last position that would overflow (hd[-1], before any op, is 0).
            j = k - 1
            while j >= i - 1 and (hd[j] if j >= 0 else 0.0) + dm <= cap:
                j -= 1
            if j + 2 > i:
                i = j + 2
        at = -1
        while i <= k:
            free = en[i - 1] if i else 0.0
            t = ready if ready > free else free
            if i == k or t + d <= st[i] + EPS:
                at = i
                break
            i += 1
        if at < 0:
            parked[r].append(o)
            continue
        st.insert(at, t)
        en.insert(at, t + d)
        ops[r].insert(at, o)
        hd.insert(at, (hd[at - 1] if at else 0.0) + dm)
        if dm:
            for j in range(at + 1, k + 1):
                hd[j] += dm
        end[o] = t + d
        placed += 1
        for s, _ in after[o]:
            waiting[s] -= 1
            if not waiting[s]:
                push(heap, (key[s], s))
        if dm < 0 and parked[r]:
            for q in parked[r]:
                push(heap, (key[q], q))
            parked[r] = []
    if placed < n:
        return None
    return ops, end


def justify(P, g: Graph, order: List[List[int]], score: Tuple[float, float, float],
            rounds: int = 4) -> Tuple[List[List[int]], Tuple[float, float, float]]:
    """Backward, then forward list scheduling (see the module docstring), repeated while the
    makespan drops (at most `rounds` times); the order kept if no shorter one fits."""
    best, best_score = order, score
    for _ in range(rounds):
        got = schedule(P, g, [-e for e in P.ends(best)[:P.n]], backward=True)
        if got is None:
            break
        late = got[1]
        horizon = max(late)
        got = schedule(P, g, [horizon - e for e in late])
        if got is None:
            break
        new = got[0]
        new_score = P.evaluate(new, best_score[0] + EPS)
        if new_score is None or new_score[0] > best_score[0] - EPS or not P.fits(new):
            if new_score is not None and new_score[:2] < best_score[:2] and P.fits(new):
                best, best_score = new, new_score  # as long, but ranks finish sooner
            break
        best, best_score = new, new_score
    return best, best_score


WINDOW = 0.35  # the share of the makespan a plain restart perturbs
WINDOW_NOISE = 1.0  # in mean ops, inside that window


def justify_search(P, order: List[List[int]], tries: int, seed: int = 0, noise: float = 0.5,
                   rounds: int = 4, kicks: int = 0) -> Tuple[List[List[int]], float]:
    """The plan justified (up to `rounds` rounds), then `tries` random restarts around it:
    the start times of the ops in a random window of the current plan (WINDOW of its
    makespan) plus Gaussian noise (WINDOW_NOISE mean ops), the rest as they were,
    list-scheduled in that order and justified once (a second round rarely gains there); a
    result no longer than the current plan becomes the current plan (so plateaus are
    crossed).  Noise on a window rebuilds one stretch of the plan at a time: over the
    planner's weakest instances it gained about what twice the restarts with noise on every
    op (`noise` mean ops) did.  Then `kicks` restarts
    more that also push the first chunk's backward (its B's and W's on every rank) of the
    microbatches from a random one on later, by a random fraction of one microbatch's work on
    a rank: the shape of the proven optima between V-Half's and V-ZB's caps (local.delayed()
    moves a whole microbatch's work), which independent noise per op almost never draws.
    Returns the shortest order that fits and its makespan (the start's if none is shorter)."""
    rng = random.Random(seed)
    g = Graph(P)
    mean_op = sum(P.span) / P.n
    sigma, inside = noise * mean_op, WINDOW_NOISE * mean_op
    if kicks:
        S, shift = P.S, P.microbatch_work()
        first_back = [o % 3 != 0 and (o // 3) % S < P.pp for o in range(P.n)]  # first chunk's B's and W's
    score = P.evaluate(order)
    if score is None or not P.fits(order):
        return order, math.inf
    cur, cur_score = justify(P, g, order, score, rounds)
    best, best_ms = cur, cur_score[0]
    starts = P.starts(cur)  # of the current plan
    gauss = rng.gauss
    for k in range(tries + kicks):
        if best_ms <= P.bound + EPS:
            break  # nothing is shorter than the lower bound
        if k < tries:
            lo = rng.random() * cur_score[0] - WINDOW * cur_score[0] / 2
            hi = lo + WINDOW * cur_score[0]
            key = [t + gauss(0.0, inside) if lo <= t <= hi else t for t in starts]
        else:  # microbatches from op id `late` on, by `by`
            late, by = rng.randrange(P.m) * 3 * S, rng.random() * shift
            key = [t + gauss(0.0, sigma) for t in starts]
            key = [t + by if o >= late and first_back[o] else t for o, t in enumerate(key)]
        got = schedule(P, g, key)
        if got is None:
            continue
        new_score = P.evaluate(got[0])
        if new_score is None or not P.fits(got[0]):
            continue
        new, new_score = justify(P, g, got[0], new_score, rounds=1)
        if new_score[0] < cur_score[0] + EPS:
            cur, cur_score = new, new_score
            starts = P.starts(cur)
            if new_score[0] < best_ms - EPS:
                best, best_ms = new, new_score[0]
    return best, best_ms
