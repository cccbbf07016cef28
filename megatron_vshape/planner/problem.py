"""A planning problem on the V with integer op ids, and its simulator.

An op id is 3 * (microbatch * S + stage) + slot (slot 0 F, 1 B, 2 W; S = 2p stages), so the
search's inner loops index lists instead of hashing ops.  `Problem.run` is the simulator's
rule (simulate.run_lists: every op at its earliest moment in its rank's order, C between
ranks, the V's turn on rank p-1 free) on those ids, and `Rerun` keeps one order's run between
local moves so that a move re-runs only what it can change.  Pure Python, no torch.
"""
from __future__ import annotations

import bisect
import functools
import math
from itertools import accumulate
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ..schedule.blocks import EPS
from ..schedule.ops import B, F, W, Costs, Op, Placement, Schedule, StageCost

NOT_DONE = math.inf  # run()'s end time of an op that has not run


class Problem:
    """One planning problem on the V, with op ids as integers: 3 * (mb * S + stage) + slot
    (slot 0 F, 1 B, 2 W), so the search's inner loops use lists, not dicts."""

    def __init__(self, pp: int, m: int, costs: Costs, table: Sequence[StageCost], cap: float):
        self.pp, self.m, self.S = pp, m, 2 * pp
        self.costs, self.table, self.cap = costs, tuple(table), cap
        self.placement = Placement("v", pp, 2)
        S = self.S
        self.rank = [self.placement.rank_of(s) for s in range(S)]
        self.dur = [(c.F, c.B, c.W) for c in self.table]
        self.size = [c.size for c in self.table]
        C, inf = costs.C, math.inf
        self.f_hop = [inf] + [C if self.rank[s - 1] != self.rank[s] else 0.0 for s in range(1, S)]
        self.b_hop = [C if self.rank[s + 1] != self.rank[s] else 0.0 for s in range(S - 1)] + [inf]
        self.sweep = list(range(pp)) + list(range(pp - 2, 0, -1))  # run()'s rank order: down and back up
        self.op_rank = [self.rank[(o // 3) % S] for o in range(3 * m * S)]
        # run()'s tables, from inputs(): each op's two inputs (the sentinel n, done at 0, where
        # it has fewer), the hops after them, and its duration.
        n = self.n = 3 * m * S
        self.in1, self.in2, self.hop1, self.hop2 = [n] * n, [n] * n, [0.0] * n, [0.0] * n
        for o in range(n):
            for k, (d, h) in enumerate(self.inputs(o)):
                (self.in1, self.in2)[k][o], (self.hop1, self.hop2)[k][o] = d, h
        self.span = [self.dur[(o // 3) % S][o % 3] for o in range(n)]
        # run()'s inner loop reads one tuple per op: its inputs and hops, its duration, and the
        # least time the run goes on after it ends (its microbatch's chain of later ops), so a
        # trial against a limit stops as soon as it surely ends after it.
        tail = self.tails()
        self.spec = [(self.in1[o], self.hop1[o], self.in2[o], self.hop2[o], self.span[o], tail[(o // 3) % S][o % 3])
                     for o in range(n)]
        self.delta = [(self.size[(o // 3) % S], 0.0, -self.size[(o // 3) % S])[o % 3] for o in range(n)]  # live()'s steps

    @functools.cached_property
    def bound(self) -> float:
        """A makespan no order can beat (the memory cap aside).  Each op has a head (its
        microbatch's chain from the first F to its start) and a tail (the chain after its end,
        tails()); a rank runs one op at a time, so for any set of its ops the run lasts at
        least the least head in it, plus their durations, plus the least tail in it.  Taken
        over every union of a rank's six groups (its two stages' F's, B's and W's of all
        microbatches, which share head and tail).  The searches stop once a plan reaches it:
        nothing is shorter (one microbatch, or balanced stages with budget to spare)."""
        S, dur, m, tail = self.S, self.dur, self.m, self.tails()
        head = [[0.0, 0.0, 0.0] for _ in range(S)]
        for s in range(1, S):
            head[s][0] = head[s - 1][0] + dur[s - 1][0] + self.f_hop[s]
        head[S - 1][1] = head[S - 1][0] + dur[S - 1][0]
        for s in range(S - 2, -1, -1):
            head[s][1] = max(head[s][0] + dur[s][0], head[s + 1][1] + dur[s + 1][1] + self.b_hop[s])
        for s in range(S):
            head[s][2] = head[s][1] + dur[s][1]
        bound = 0.0
        for r in range(self.pp):
            groups = [(head[s][k], m * dur[s][k], tail[s][k]) for s in (r, S - 1 - r) for k in range(3)]
            for mask in range(1, 1 << len(groups)):
                chosen = [g for i, g in enumerate(groups) if mask >> i & 1]
                bound = max(bound, min(g[0] for g in chosen) + sum(g[1] for g in chosen) + min(g[2] for g in chosen))
        return bound

    def tails(self) -> List[Tuple[float, float, float]]:
        """Per stage, for its F, B and W: the longest chain of the ops that wait for it (with
        their hops), from its end to its microbatch's last op: F@s feeds F@s+1 and B@s, B@s
        feeds B@s-1 and W@s."""
        S, dur = self.S, self.dur
        b = [0.0] * S
        for s in range(S):
            b[s] = max(dur[s][2], self.b_hop[s - 1] + dur[s - 1][1] + b[s - 1] if s else 0.0)
        f = [0.0] * S
        for s in range(S - 1, -1, -1):
            f[s] = max(dur[s][1] + b[s], self.f_hop[s + 1] + dur[s + 1][0] + f[s + 1] if s < S - 1 else 0.0)
        return [(f[s], b[s], 0.0) for s in range(S)]

    def op(self, i: int) -> Op:
        return Op((F, B, W)[i % 3], i // (3 * self.S), (i // 3) % self.S)

    def futile(self, ops: Sequence[int], i: int, j: int) -> bool:
        """Whether moving ops[i] to position j surely cannot help: it would pass an op of its
        own rank that it feeds or is fed by (a deadlock), or put it before one of the same
        kind and stage of a lower microbatch or after a higher one (never needed:
        microbatches are interchangeable, see optimal.py)."""
        o, kinds, in1, in2 = ops[i], 3 * self.S, self.in1, self.in2
        kind = o % kinds
        if j < i:
            a, b = in1[o], in2[o]
            for x in ops[j:i]:
                if x == a or x == b or (x < o and x % kinds == kind):
                    return True
            return False
        for x in ops[i + 1:j + 1]:
            if (x > o and x % kinds == kind) or in1[x] == o or in2[x] == o:
                return True
        return False

    def encode(self, ranks: Sequence[Sequence[Op]]) -> List[List[int]]:
        slot = {F: 0, B: 1, W: 2}
        return [[3 * (o.microbatch * self.S + o.stage) + slot[o.kind] for o in ops] for ops in ranks]

    def schedule(self, name: str, order: Sequence[Sequence[int]], budget: Optional[float],
                 stage_costs: Optional[Sequence[StageCost]], meta: dict) -> Schedule:
        ranks = [[self.op(i) for i in ops] for ops in order]
        return Schedule(name, self.placement, self.m, self.costs, ranks, meta,
                        None if stage_costs is None else tuple(stage_costs), budget)

    def evaluate(self, order: Sequence[Sequence[int]], limit: float = math.inf) -> Optional[Tuple[float, float, float]]:
        """(makespan, sum of rank finish times, sum of the F's and B's end times) of the
        eager run, or None on deadlock (or as soon as it surely ends after `limit`).  The
        simulator's rules (simulate.run_lists), on integer ops.  The two sums break ties of
        makespan: the first favours ranks that finish early, the second the ops other ranks
        wait for (a W waits for nobody)."""
        return self.run(order, limit, self.blank(), [0] * self.pp, [0.0] * self.pp)

    def microbatch_work(self) -> float:
        """One microbatch's work (every stage's F, B and W) divided over the ranks: how far
        delayed() and justify_search()'s kicks push the first chunk's backward."""
        return sum(self.span[:3 * self.S]) / self.pp

    def ends(self, order: Sequence[Sequence[int]]) -> List[float]:
        """Every op's end time in the eager run of `order` (blank()'s layout: NOT_DONE for
        an op a deadlock left unrun)."""
        end = self.blank()
        self.run(order, math.inf, end, [0] * self.pp, [0.0] * self.pp)
        return end

    def starts(self, order: Sequence[Sequence[int]]) -> List[float]:
        """Every op's start time in the eager run of `order` (ends() less each op's span)."""
        return [e - s for e, s in zip(self.ends(order), self.span)]

    def blank(self) -> List[float]:
        """run()'s `end` before any op ran: NOT_DONE for every op, then the sentinel input,
        done at 0."""
        return [NOT_DONE] * self.n + [0.0]

    def run(self, order: Sequence[Sequence[int]], limit: float, end: List[float], pos: List[int],
            free: List[float]) -> Optional[Tuple[float, float, float]]:
        """evaluate() from a given state: `end` of every op done (NOT_DONE if not; blank()'s
        layout), each rank's next position and its free time.  Fills `end` in place.  None as
        soon as an op's end plus its chain of later ops passes `limit`: the run ends after it."""
        spec = self.spec
        lens = [len(o) for o in order]
        moved = True
        while moved:
            moved = False
            for r in self.sweep:
                i, n = pos[r], lens[r]
                if i == n:
                    continue
                ops, t = order[r], free[r]
                start_i = i
                while i < n:
                    o = ops[i]
                    d1, h1, d2, h2, span, tail = spec[o]
                    # An input not done yet is NOT_DONE (inf), and so is its ready time: one
                    # test finds both inputs done (the search's innermost loop).
                    a = end[d1] + h1
                    b = end[d2] + h2
                    if b > a:
                        a = b
                    if a == NOT_DONE:
                        break
                    if a > t:
                        t = a
                    t += span
                    if t + tail > limit:
                        return None
                    end[o] = t
                    i += 1
                if i != start_i:
                    moved = True
                    pos[r], free[r] = i, t
        if pos != lens:
            return None
        makespan = max(free)
        if makespan > limit:
            return None  # a rank given all its ops (a trial's far one) ends past the limit
        n = self.n
        return makespan, sum(free), sum(end[0:n:3]) + sum(end[1:n:3])

    def inputs(self, o: int) -> List[Tuple[int, float]]:
        """The ops `o` waits for, each with the hop after it (the simulator's rules)."""
        slot, s = o % 3, (o // 3) % self.S
        if slot == 0:
            return [(o - 3, self.f_hop[s])] if s else []
        if slot == 1 and s < self.S - 1:
            return [(o - 1, 0.0), (o + 3, self.b_hop[s])]
        return [(o - 1, 0.0)]

    def live(self, ops: Sequence[int]) -> Iterator[float]:
        """The weighted activations a rank holds after each of its ops."""
        return accumulate(map(self.delta.__getitem__, ops))

    def peak(self, ops: Sequence[int]) -> float:
        return max(self.live(ops), default=0.0)

    def fits(self, order: Sequence[Sequence[int]]) -> bool:
        return all(self.peak(ops) <= self.cap + EPS for ops in order)




class Rerun:
    """The eager run of the order being improved, kept between moves so that a move re-runs
    only what it can change.  On a moved rank r nothing from its first changed position on
    starts before t0 (the end of the op before it), in either order.  A change reaches a
    rank d ranks away only through d hops between neighbours, each after an F or B at
    least `reach` = C + the shortest F or B long, so by induction on start times every op
    whose times change starts, in both orders, at T_q = t0 + d * reach or later.  So each
    rank resumes at its first op that started at T_q or later (EPS below: zero-cost ops
    start exactly there), and the moved rank at its first changed position at the latest."""

    def __init__(self, P: Problem, order: List[List[int]]):
        self.P = P
        self.reach = P.costs.C + min(min(f, b) for f, b, _ in P.dur)
        self.reset(order)

    def reset(self, order: List[List[int]]) -> Tuple[float, float, float]:
        P = self.P
        self.end = P.blank()
        self.score = P.run(order, math.inf, self.end, [0] * P.pp, [0.0] * P.pp)
        self.starts = [self._starts(ops) for ops in order]
        return self.score

    def _starts(self, ops: Sequence[int]) -> List[float]:
        end, span = self.end, self.P.span
        return [end[o] - span[o] for o in ops]

    def trial(self, order: List[List[int]], lows: Dict[int, int], limit: float) -> Optional[Tuple[float, float, float]]:
        """The score of `order`, which differs from the last committed one only on the ranks
        in `lows`, each from its position there; commit() keeps it."""
        old, reach = self.end, self.reach
        froms = [(r, (old[order[r][lo - 1]] if lo else 0.0) - EPS) for r, lo in lows.items()]
        end = old[:]
        keep, free = [], []
        for q, ops in enumerate(order):
            at = min(t0 + abs(q - r) * reach for r, t0 in froms)
            k = bisect.bisect_left(self.starts[q], at)
            lo = lows.get(q)
            if lo is not None and k > lo:
                k = lo
            for o in ops[k:]:
                end[o] = NOT_DONE
            keep.append(k)
            free.append(old[ops[k - 1]] if k else 0.0)
        got = self.P.run(order, limit, end, list(keep), free)
        self._pending = (keep, got, end)
        return got

    def commit(self, order: List[List[int]]) -> None:
        keep, self.score, self.end = self._pending
        for q, k in enumerate(keep):
            self.starts[q][k:] = self._starts(order[q][k:])
