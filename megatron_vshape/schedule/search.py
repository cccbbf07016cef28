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
    paper's V-Min and V-Half blocks and the uniform-offset family (the shortest blocks, and
    in v-auto those of the shortest steady period under the real costs too), warm-up and
    cool-down moved to their earliest free slots under the cap;
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
    kept if shorter than the plan so far; in v-auto then the best of the shortest-period
    blocks likewise), then on the plan, then on that with rules that wait for the op they
    prefer instead of starting another just before it is ready (`hold`);
  * the plan's microbatches relabelled in order on every stage (microbatch_order.py): the
    moves above may leave two ops of a kind out of order, which changes the order gradients
    are added in; relabelled, the plan is no longer and holds the same memory.

Everything is deterministic: the work is bounded by counts of simulated ops, never by the
clock, and the random moves use a fixed seed, so every rank computes the same schedule.
Results are cached per problem in-process.

The cap: `memory_budget` X is peak_vs_1f1b's unit (1F1B's rank 0 with plain stages is 1),
so a rank of the V may hold X * 2 * min(p, m) stage-activations, each weighted by its
stage's size (1 when stages are equal; at m >= p that is floor(X * 2p) plain ones).
"""
from __future__ import annotations

import bisect
import heapq
import math
import random
from functools import lru_cache
from itertools import accumulate
from types import SimpleNamespace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import justify, microbatch_order, slots
from .blocks import EPS, Stuck
from .errors import ConfigError
from .ops import B, F, W, Costs, Op, Placement, Schedule, StageCost, check_no_options, check_sizes, stage_table
from .simulate import one_f_one_b_peak
from .verify import verify

MAX_BUDGET = 2.0
NOT_DONE = math.inf  # run()'s end time of an op that has not run


def min_budget(pp: int) -> float:
    """V-Min's budget, the least the V-shapes serve: ((p+4)//3)/p of 1F1B."""
    return ((pp + 4) // 3) / pp


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


# A priority rule: the order in which a free rank prefers ready ops (B1/B0: backward of its
# chunk 1 / chunk 0, F1/F0 likewise), and how long a wait a W may fill (theta: run a W when
# the next op's input is at least theta * W away; 0 runs W's into any wait).
# reserve: "all" keeps room for the second-chunk F of every microbatch in flight on the
# rank; "one" only for the next one (enough: F's of a stage run in microbatch order, so the
# oldest microbatch can always finish its forwards and free memory through its W's).
# Over the benchmark grid (pp 4..16, m 2p..8p, three cost sets, five budgets) the greedy
# start won only with these two orders ("B0 B1 F1 F0" never did).
RULES: Tuple[Tuple[str, float, str], ...] = tuple(
    (order, theta, reserve) for reserve in ("one", "all")
    for order in ("B1 B0 F1 F0", "F1 B1 F0 B0") for theta in (1.0, 0.0)
)


class _Listed:
    """greedy()'s state part way through a run: each op's end, each rank's next microbatch
    per pass, waiting W's, live and reserved activations, its order so far, free and wake
    times, and the event heap."""

    def __init__(self, P: Problem):
        pp = P.pp
        self.end = P.blank()  # NOT_DONE (inf) for every op, then the sentinel input, done at 0
        self.nxt = [[0, 0, 0, 0] for _ in range(pp)]  # per rank: F of chunk 0, F of chunk 1, B of chunk 0, B of chunk 1
        self.wq: List[List[int]] = [[] for _ in range(pp)]  # W's whose B ran, oldest B first
        self.live = [0.0] * pp
        self.pending = [0.0] * pp  # sizes reserved for second-chunk F's of microbatches already in
        self.out: List[List[int]] = [[] for _ in range(pp)]
        self.free, self.wake, self.done_fb = [0.0] * pp, [0.0] * pp, [0] * pp
        self.heap = [(0.0, r) for r in range(pp)]

    def copy(self) -> "_Listed":
        new = object.__new__(_Listed)
        new.end, new.live, new.pending = self.end[:], self.live[:], self.pending[:]
        new.nxt = [x[:] for x in self.nxt]
        new.wq, new.out = [w[:] for w in self.wq], [o[:] for o in self.out]
        new.free, new.wake, new.done_fb, new.heap = self.free[:], self.wake[:], self.done_fb[:], self.heap[:]
        return new


def kept_prefix(P: Problem, keep: Sequence[Sequence[int]]) -> _Listed:
    """greedy()'s state with `keep`, up to the first moment a rank would apply the rule: the
    same for every rule, so greedy(..., keep=keep, start=kept_prefix(P, keep)) gives what
    greedy(..., keep=keep) gives, without running the shared part again."""
    return greedy(P, "", 0.0, keep=keep, pause=True)


def greedy(P: Problem, order: str, theta: float, reserve: str = "all",
           follow: Optional[Sequence[Sequence[int]]] = None,
           keep: Optional[Sequence[Sequence[int]]] = None, start: Optional[_Listed] = None,
           pause: bool = False, hold: float = 0.0) -> Union[List[List[int]], _Listed]:
    """List-schedule every rank under the cap with one priority rule; raises Stuck if a rank
    can never proceed (only when the cap cannot hold one microbatch's two stages).  With
    `follow`, each rank runs that order's F's and B's in that order instead, and only the
    W's are placed anew by the rule (into waits, or where memory needs them).  With `keep`,
    each rank first runs its prefix keep[r] exactly (it must fit the cap), then the rule;
    `start` resumes from a copy of kept_prefix()'s state for that `keep`, and `pause` (what
    kept_prefix() asks) returns the state at the first decision the rule would make.  With
    `hold` > 0 a rank that could start an F or B does not when an op it prefers is ready
    before hold * that op's duration has passed: it waits for the preferred one (a W may
    fill the wait), as a chain other ranks wait for needs in the cool-down."""
    pp, S, m, cap, size, span = P.pp, P.S, P.m, P.cap + EPS, P.size, P.span
    rank, f_hop, b_hop = P.rank, P.f_hop, P.b_hop
    fb = None if follow is None else [[o for o in ops if o % 3 != 2] for ops in follow]
    state = _Listed(P) if start is None else start.copy()
    end, nxt, wq, live, pending, out = state.end, state.nxt, state.wq, state.live, state.pending, state.out
    free, wake, done_fb, heap = state.free, state.wake, state.done_fb, state.heap
    in1, in2, hop1, hop2 = P.in1, P.in2, P.hop1, P.hop2
    pop, push = heapq.heappop, heapq.heappush
    stages = [(r, S - 1 - r) for r in range(pp)]
    # The rule's preferences in order, as indexes into nxt; per rank, each as (index into nxt,
    # stage, slot, chunk, the op id of microbatch 0, the room an F there needs besides the reserve).
    prefs = [(k[0] == B) * 2 + int(k[1]) for k in order.split()]
    choices = [[(i, s, i // 2, i % 2, 3 * s + i // 2, size[s1] if i % 2 else size[s0] + size[s1])
                for i in prefs for s in (s1 if i % 2 else s0,)] for s0, s1 in stages]
    S3 = 3 * S
    reserving = reserve == "all"
    total = 6 * m
    inf = math.inf
    kept_len = [0] * pp if keep is None else [len(k) for k in keep]
    while heap:
        t, r = pop(heap)
        done = len(out[r])
        if t != wake[r] or done == total:
            continue
        s0, s1 = stages[r]
        best, soonest, mem_blocked = -1, inf, False
        kept = done < kept_len[r]
        if pause and not kept:
            push(heap, (t, r))  # this rank decides by the rule from here
            return state
        due = t + EPS
        if kept:
            o = keep[r][done]
            ready = end[in1[o]] + hop1[o]  # inf until both inputs are done
            b = end[in2[o]] + hop2[o]
            if b > ready:
                ready = b
            if ready <= due:
                best = o
            soonest = ready
        elif fb is None:
            nx, lr = nxt[r], live[r]
            for i, s, slot, chunk, base, need in choices[r]:
                j = nx[i]
                if j >= m:
                    continue
                o = base + S3 * j
                if slot == 0:
                    ready = end[o - 3] + f_hop[s] if s else 0.0
                    if reserving and not chunk:
                        need = size[s0] + pending[r] + size[s1]  # summed in this order: other orders round differently
                    if lr + need > cap:
                        if ready <= due:
                            mem_blocked = True
                        continue
                else:
                    ready = end[o - 1]
                    if ready == NOT_DONE:
                        continue
                    if s < S - 1:
                        e = end[o + 3] + b_hop[s]
                        if e > ready:
                            ready = e
                if ready <= due:
                    if hold and soonest < t + hold * span[o] - EPS:
                        break  # a preferred op is ready before this one would end: wait for it
                    best = o
                    break
                if ready < soonest:
                    soonest = ready
        elif done_fb[r] < len(fb[r]):
            o = fb[r][done_fb[r]]
            ready = end[in1[o]] + hop1[o]
            b = end[in2[o]] + hop2[o]
            if b > ready:
                ready = b
            if o % 3 == 0 and live[r] + size[(o // 3) % S] > cap:
                if ready <= due:
                    mem_blocked = True
            elif ready <= due:
                best = o
            else:
                soonest = ready
        if best < 0 and not kept and wq[r]:
            w = wq[r][0]
            if mem_blocked or soonest == inf or soonest - t >= theta * span[w] - EPS:
                best = w
        if best < 0:
            wake[r] = soonest
            if soonest < inf:
                push(heap, (soonest, r))
            continue
        slot, s = best % 3, (best // 3) % S
        chunk = 0 if s == s0 else 1
        finish = t + span[best]
        end[best] = finish
        out[r].append(best)
        if slot != 2:
            done_fb[r] += 1
        if slot == 0:
            live[r] += size[s]
            pending[r] += size[s1] if chunk == 0 else -size[s1]
            nxt[r][chunk] += 1
        elif slot == 1:
            wq[r].append(best + 1)
            nxt[r][2 + chunk] += 1
        else:
            live[r] -= size[s]
            wq[r].remove(best)  # the oldest, unless a kept prefix ran another
        wake[r] = free[r] = finish
        push(heap, (finish, r))
        if slot != 2:  # wake the neighbour whose op consumes this output
            n = s + 1 if slot == 0 else s - 1
            if 0 <= n < S and rank[n] != r:
                q = rank[n]
                at = max(finish + (f_hop[n] if slot == 0 else b_hop[n]), free[q])
                if at < wake[q]:
                    wake[q] = at
                    push(heap, (at, q))
    if pause:
        return state
    if any(len(o) != total for o in out):
        raise Stuck(f"greedy {order}: ranks cannot proceed under cap {P.cap:g}")
    return out


RELIST_BACK = 3  # relist() re-plans from after each rank's last F of a chunk, or up to this many microbatches earlier
RELIST_WORK = 20_000  # greedy ops one relist() may spend, counting its shared kept prefix each time (a plan relists up to a dozen orders)
# greedy()'s (order, theta, reserve, hold) for relist(): the list rules, and (HOLD_RULES, tried
# on the final plans after them) the same rules waiting for the op they prefer.
RELIST_RULES = tuple(rule + (0.0,) for rule in RULES if rule[2] == "one")  # "all" won 2 of 290 relists (40 random points)
HOLD_RULES = tuple(rule[:3] + (1.0,) for rule in RELIST_RULES)
RELIST_SHARE = 4  # the relisted start's improve() gets 1/RELIST_SHARE of one start's work


def relist(P: Problem, order: List[List[int]], work: int = RELIST_WORK,
           rules: Sequence[Tuple[str, float, str, float]] = RELIST_RULES,
           prefixes: Optional[Dict[Tuple[int, int], _Listed]] = None) -> Tuple[Optional[Tuple[float, float, float]], List[List[int]]]:
    """The cool-down list-scheduled anew under the real costs: each rank keeps `order` up to
    its F of microbatch m-1-k (k = 0..RELIST_BACK) in chunk 0, then in chunk 1, and a greedy
    rule runs the rest.  Blocks squeezed on unit slots, and local moves, leave W's in the
    cool-down where they delay the B's and second-chunk F's the other ranks wait for; a list
    scheduler lets W's fill waits only.  From the chunk-1 F on, only backward work is left
    to place: with few microbatches (m close to p) the run ends on that chain.  (score,
    order) of the shortest that fits, `order` itself if none is shorter; at most `work`
    greedy ops, each keep point with every rule of `rules` ((priority, theta, reserve, hold)).
    `prefixes` keeps each keep point's kept_prefix() state for another relist of the same
    order (with other rules): the same result, without running the prefixes again."""
    best = (P.evaluate(order), order)
    prefixes = {} if prefixes is None else prefixes
    n = 6 * P.pp * P.m
    for chunk in (0, 1):
        for k in range(min(P.m, RELIST_BACK + 1)):
            mb = P.m - 1 - k
            keep = [ops[:ops.index(3 * (mb * P.S + (P.S - 1 - r if chunk else r))) + 1] for r, ops in enumerate(order)]
            shared = prefixes.get((chunk, k))
            for priority, theta, reserve, hold in rules:
                work -= n
                if work < 0:
                    return best
                try:
                    shared = shared or prefixes.setdefault((chunk, k), kept_prefix(P, keep))
                    got = greedy(P, priority, theta, reserve, keep=keep, start=shared, hold=hold)
                except Stuck:
                    continue
                score = P.evaluate(got)
                if score is not None and best[0] is not None and score[:2] < best[0][:2] and P.fits(got):
                    best = (score, got)
    return best


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


class _Rerun:
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
    sim = _Rerun(P, order)
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
    sim = _Rerun(P, order)
    over = [_overflow_area(P, o) for o in order]
    lives = [list(P.live(o)) for o in order]  # of the current order, for _area_after
    mean_op = sum(map(sum, P.dur)) / (3 * len(P.dur))
    lam = RELAX_PRICE * mean_op  # time charged per stage-activation over the cap
    value = sim.score[0] + lam * sum(over)
    best, best_ms = [o[:] for o in order], (math.inf if sum(over) else sim.score[0])
    for move in range(moves):
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
        start = delayed(P, best, k * P.m // tries)
        if P.evaluate(start) is None:
            continue  # only with ops that take no time, tied on every rank of a cycle
        got, ms = relax(P, start, moves, seed=k)
        if ms < best_ms + EPS:
            best, best_ms = got, ms
    return best, best_ms


# Ops simulated by the search for one problem (selection plus improvement): bounds CPU time.
RULE_WORK = 30_000  # greedy ops (each costs several simulated ones)
IMPROVE_WORK = 2_000_000
IMPROVE_STARTS = 3
RETIME_THETAS = (0.0, 0.5, 1.0)  # W placements tried on the best order at the end
STALE_KICKS = 5  # kicks in a row without a new best end the improvement
MAX_SWEEPS = 100  # moves per op (6 distances) an improvement tries at most
IMPROVE_FULL_OPS = 2000  # runs up to this many ops get all of IMPROVE_WORK
RELAX_OPS = 400  # runs of up to this many ops get relax() (where: see _plan)
# relax()'s moves for one plan, up to RELAX_FULL_OPS ops (beyond, fewer by the square): a named
# V-shape's plan gets RELAX_MOVES_NAMED, and v-auto's own relax() gets the rest of its share,
# the named plan it includes having spent those.  v-auto's own share is half of what it was
# before justify_search (run after relax) took that time: it finds more per second there
# (docs/planner.md, "Justification").
RELAX_MOVES_NAMED = 15_000
RELAX_MOVES = 30_000  # with m <= p (improve()'s refit starts need time there)
RELAX_MOVES_MANY = 46_500  # with m > p, between V-Min's and V-Half's caps
RELAX_MOVES_ABOVE = 32_500  # with m > p above V-ZB's cap (moves cost more where the cap rarely binds)
RELAX_FULL_OPS = 200
RELAX_SHARE = 2  # with m > p, v-auto's improve() gets 1/RELAX_SHARE of its work when relax() runs
RELAX_PRICE = 1.0  # lam's start: this many mean ops' time per stage-activation over the cap
RELAX_ADAPT, RELAX_RISE, RELAX_FALL = 200, 1.3, 1.15  # lam's update: every so many moves
STEPS = (-3, -2, -1, 1, 2, 3)  # how far improve() and relax() move an op on its rank
RELAX_CHAIN = 0.3  # the share of relax()'s moves that are chain moves (_chain_move)
DELAY_MOVES = 6_000  # relax()'s moves after each delay (fewer by the square beyond RELAX_FULL_OPS ops)
JUSTIFY_TRIES = 150  # justify_search()'s restarts at up to RELAX_FULL_OPS ops (fewer by ops beyond, to RELAX_OPS)
JUSTIFY_LONG_WORK = 4_000  # beyond RELAX_OPS ops: restarts x ops
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
    from . import vshape  # late: vshape asks this module to plan

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
PERIOD_OPS = BLOCK_OPS // 2  # the same for the blocks of the shortest real-cost periods (a last start)
PERIOD_STRETCHED = 2
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


def _top_blocks(P: Problem, by_period: bool) -> Tuple[List[Tuple[str, slots.Block]], List[Tuple[str, slots.Block]]]:
    """The uniform-offset blocks that use the most memory the cap allows (the steady state's
    bubble falls as blocks hold more), shortest first, within BLOCK_OPS squeezed ops; and
    with `by_period`, those with the shortest steady period under the real costs
    (slots.steady_period, on as many microbatches as squeezing them takes; ties shortest
    first) that the first list leaves out, within PERIOD_OPS."""
    peaks = [(peak, max(max(r) for r in b), b) for peak, b in zip(_steady_peaks(P.pp, tuple(P.size)), _uniform_blocks(P.pp))]
    top = max((x[0] for x in peaks if x[0] <= P.cap + EPS), default=0.0)
    fitting = sorted((n, b) for peak, n, b in peaks if top - EPS <= peak <= P.cap + EPS)

    def within(ranked, work):
        out = []
        for _, block in ranked:
            work -= 6 * P.S * min(P.m, slots.small_m(block))
            if work < 0:
                break
            out.append((f"uniform block {block[0]}/{block[1]}", block))
        return out
    shortest = within(fitting, BLOCK_OPS)
    if not by_period or not fitting:
        return shortest, []
    m_r = min(P.m, max(slots.small_m(b) for _, b in fitting))
    R = P if m_r == P.m else Problem(P.pp, m_r, P.costs, P.table, P.cap)
    taken = {b for _, b in shortest}
    rest = sorted((slots.steady_period(R, b), n, b) for n, b in fitting if b not in taken)
    period = {b: t for t, _, b in rest}
    return shortest, [(f"{name} (period {period[b]:g})", b) for name, b in within([(n, b) for _, n, b in rest], PERIOD_OPS)]


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
        blocks = _paper_blocks(P.pp) + _top_blocks(P, False)[0]
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


REFIT_WORK = 300_000  # simulated ops per order brought under a smaller cap (bounds CPU time)
REFIT_OPS = 400  # runs of up to this many ops get refit candidates (planning time)


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


NAMED_BUDGETS = (("v-min", lambda p: ((p + 4) // 3) / p), ("v-half", lambda p: ((p + 2) // 2) / p), ("v-zb", lambda p: 1.0))
NAMED_BELOW_OPS = 3_000  # above this many ops v-auto skips it (planning time: 2 s at pp <= 16, m <= 128)


def _named_below(name: str, pp: int, m: int, budget: float) -> Optional[Tuple[str, float]]:
    """For v-auto: the named V-shape with the largest budget <= `budget` (None if none)."""
    if name != "v-auto":
        return None
    fits = [(n, b(pp)) for n, b in NAMED_BUDGETS if b(pp) <= budget + 1e-12]
    return max(fits, key=lambda x: x[1]) if fits else None


@lru_cache(maxsize=256)
def _plan(name: str, pp: int, m: int, costs: Costs, table: Tuple[StageCost, ...], budget: float) -> Tuple[Tuple[Tuple[int, ...], ...], str]:
    cap = check_budget(name, pp, m, budget, table)
    P = Problem(pp, m, costs, table, cap)
    n_ops = 6 * pp * m
    cands: List[Tuple[Tuple[float, float], int, List[List[int]], str]] = []
    for k, s in enumerate(_legacy(name, pp, m, costs, cap)):
        order = P.encode(s.ranks)
        got = P.evaluate(order)
        if got is not None and P.fits(order):
            cands.append((got, k, order, f"blocks {s.meta.get('candidate')}"))
    below = _named_below(name, pp, m, budget)
    if below is not None and 6 * pp * m <= NAMED_BELOW_OPS:
        # The V-shape named for the largest budget <= this one fits too: v-auto is never slower
        # than it, and never slower as the budget passes V-Min's, V-Half's and V-ZB's.
        try:
            order, how = _plan(below[0], pp, m, costs, table, below[1])
            cands.append((P.evaluate([list(o) for o in order]), -1, [list(o) for o in order], f"{below[0]}'s plan: {how}"))
        except (ConfigError, Stuck):
            pass  # too few microbatches for that budget's cap: nothing to include
    # Squeezed blocks: the paper's, then the shortest at the cap.  On runs over RELAX_OPS ops
    # (not on short ones, where relax() runs: there these shortened no grid plan and cost
    # 0.25 s) each is relisted too, a start tried last (below).  In v-auto's own plans the
    # blocks of the shortest real-cost periods, relisted, are one more start, tried after
    # that one (in the named plans they shortened no grid row: their caps are the ones the
    # paper's blocks were built for).
    shortest, periodic = _top_blocks(P, by_period=n_ops > RELAX_OPS and name not in dict(NAMED_BUDGETS))
    relisted = []
    for order, how in _squeezed_candidates(P, _paper_blocks(P.pp) + shortest, relisted=n_ops > RELAX_OPS):
        cands.append((P.evaluate(order), 50 + len(cands), order, how))
        got, better = relist(P, order) if n_ops > RELAX_OPS else (None, None)
        if got is not None and got[:2] < cands[-1][0][:2]:
            relisted.append((got, len(relisted), better, how + ", cool-down relisted"))
    by_period = []
    for order, how in _squeezed_candidates(P, periodic, PERIOD_STRETCHED, whole=False, relisted=True):
        got, better = relist(P, order)
        by_period.append((got, len(by_period), better, how + ", cool-down relisted"))
    for order, how in _greedy_candidates(P):
        got = P.evaluate(order)
        if got is not None:
            cands.append((got, 100 + len(cands), order, how))
    refits = []
    if n_ops <= REFIT_OPS:  # short runs, where the planning time allows it
        for score, order, how in _refit_candidates(P):
            refits.append((score, 200 + len(refits), order, how))
    if not cands + refits:
        raise Stuck(f"{name}: no candidate fits cap {cap:g} at pp={pp}, microbatches={m}")
    cands.sort(key=lambda c: (c[0][:2], c[1]))
    # Improve the best few distinct starts (different basins), sharing IMPROVE_WORK, and the
    # refit ones (other basins again).
    starts = [c for k, c in enumerate(cands) if k == 0 or c[0][:2] != cands[k - 1][0][:2]][:IMPROVE_STARTS]
    starts += [c for c in refits if all(c[0][:2] != s[0][:2] for s in starts)]
    work = int(IMPROVE_WORK * min(1.0, IMPROVE_FULL_OPS / n_ops))  # long runs: fewer, costlier moves
    if any(c[1] == -1 for c in cands):
        work //= 2  # half the work was spent improving the named plan included above
    # Short runs get relax() too: the named V-shapes' (their blocks are built for equal
    # stages and costs, and elsewhere improve() stops up to 8% above the optimum); between
    # V-Min's and V-Half's caps, where their blocks leave memory unused and the tight cap
    # stalls improve(); above V-ZB's, where no block was built for the cap; and with m <= p
    # (all warm-up and cool-down) between any two.  Between V-Half's and V-ZB's with m > p,
    # relax() alone found nothing shorter on the instances with proven optima:
    # delay_search() runs there instead.
    half_cap, zb_cap = (cap_of(pp, m, b(pp), table) for _, b in NAMED_BUDGETS[1:])
    between = n_ops <= RELAX_OPS and below is not None and cap > cap_of(pp, m, below[1], table) + EPS
    delaying = between and m > pp and half_cap + EPS < cap < zb_cap - EPS
    named = name in dict(NAMED_BUDGETS)
    relaxing = (between and not delaying) or (named and n_ops <= RELAX_OPS and RELAX_MOVES_NAMED > 0)
    if relaxing and m > pp and not named:
        # The time goes to relax().  Not with m <= p, where improve()'s refit starts need it,
        # nor in a named plan, whose relax() is short (v-half's proven optimum at pp=4, m=8
        # needs its whole improve()).
        work //= RELAX_SHARE
    fewer = min(1.0, RELAX_FULL_OPS / n_ops) ** 2  # relax()'s moves beyond RELAX_FULL_OPS ops
    results, left = [], 0
    for k, (score, _, order, how) in enumerate(starts):
        better, unused = improve(P, [o[:] for o in order], work // len(starts), seed=k)
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
    if relaxing:
        if named:
            moves = RELAX_MOVES_NAMED
        else:
            moves = RELAX_MOVES if m <= pp else RELAX_MOVES_ABOVE if cap > zb_cap + EPS else RELAX_MOVES_MANY
            moves -= RELAX_MOVES_NAMED if any(c[1] == -1 for c in cands) else 0
        got, ms = relax(P, [list(o) for o in best], int(moves * fewer), seed=len(starts))
        if ms < score[0] - EPS:
            how += f" + relaxed across the cap ({score[0]:g} -> {ms:g})"
            score, best = P.evaluate(got), got
    if n_ops <= IMPROVE_FULL_OPS:
        left += work // len(starts)  # short runs: time for one more start's share
    if left:
        # Improve the best once more, ties of makespan broken the other way (F's and B's
        # early, W's late): that leaves plateaus the first pass could not.
        better, _ = improve(P, [o[:] for o in best], left, seed=len(starts), tie=2)
        got = P.evaluate(better)
        if got[0] < score[0] - EPS:
            score, best, how = got, better, how + f" + improve, W's late on ties ({score[0]:g} -> {got[0]:g})"
    if delaying:
        got, ms = delay_search(P, [list(o) for o in best], int(DELAY_MOVES * fewer), min(m, DELAY_TRIES))
        if ms < score[0] - EPS:
            how += f" + first chunk's backward delayed ({score[0]:g} -> {ms:g})"
            score, best = P.evaluate(got), got
    finalists = []
    # Justified (list-scheduled backward, then forward), with random restarts around the
    # plan: on short runs as many as take about the time of JUSTIFY_TRIES at 200 ops, on long
    # ones a few (JUSTIFY_LONG_WORK ops of list scheduling), then none.  The plan itself is
    # justified in two rounds, beyond that in one: a third gained nothing at pp=16, m=20 to
    # 128, and a second costs what the first did and gained nothing at pp=16, m=128 or pp=32,
    # m=256.
    tries = int(JUSTIFY_TRIES * min(1.0, RELAX_FULL_OPS / n_ops)) if n_ops <= RELAX_OPS else JUSTIFY_LONG_WORK // n_ops
    got, ms = justify.justify_search(P, [list(o) for o in best], tries, seed=len(starts),
                                     rounds=2 if tries else 1, kicks=int(tries * JUSTIFY_KICKS) if delaying else 0)
    plain = score  # a late start below that would have displaced the plan is relisted too
    if ms < score[0] - EPS:
        if n_ops > RELAX_OPS:  # long runs: relisted at the end too, it may relist shorter
            finalists.append((score, best, how))
        how += f" + justified ({score[0]:g} -> {ms:g})"
        score, best = P.evaluate(got), got
    if (relaxing or delaying) and n_ops > RELAX_FULL_OPS:
        # Beyond RELAX_FULL_OPS ops the moves above fall as the square of RELAX_FULL_OPS / ops,
        # and the planning time with them: from pp=5 on (m near p) that left plans up to 3%
        # above the best known, which more moves reach.  So one more relax() from the best,
        # with the moves that bring the total to RELAX_FULL_OPS / ops of the full count
        # (about the same planning time at every size): kept if shorter, and the plan it
        # displaces is relisted at the end too (a relist may shorten it more).
        full = moves if relaxing else DELAY_MOVES * min(m, DELAY_TRIES)
        more = full * (RELAX_FULL_OPS / n_ops - fewer)
        got, ms = relax(P, [list(o) for o in best], int(more), seed=len(starts) + 1)
        if ms < score[0] - EPS:
            finalists.append((score, best, how))
            how += f" + relaxed again ({score[0]:g} -> {ms:g})"
            score, best = P.evaluate(got), got
    for k, late in enumerate((relisted, by_period)):
        if not late:
            continue
        # The best relisted block, then the best of the shortest periods, each improved with a
        # quarter of one start's share (planning time), kept if shorter: starts in their own
        # basins, tried after the rest so that they never displace them.
        got, _, order, why = min(late, key=lambda c: (c[0][:2], c[1]))
        order, _ = improve(P, order, work // (RELIST_SHARE * len(starts)), seed=len(starts) + 1 + k)
        why += f" + improve ({got[0]:g} -> {P.evaluate(order)[0]:g})"
        got = P.evaluate(order)
        if got[0] < score[0] - EPS:
            finalists.append((score, best, how))
            score, best, how = got, order, why
        elif got[0] < plain[0] - EPS:
            finalists.append((got, order, why))
        plain = min(plain, got, key=lambda c: c[0])
    # The plan is relisted last, and so is each plan a late start displaced (it may relist
    # shorter): each plan is at most as long as without the late starts.
    ends = []
    for k, (was, order, why) in enumerate(finalists + [(score, best, how)]):
        prefixes: Dict[Tuple[int, int], _Listed] = {}
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
    _, _, best, how = min(ends, key=lambda e: e[:2])
    # Moves of single ops may leave two of a kind out of microbatch order on a stage; in
    # order, gradients add up as in the non-pipelined model (never longer, same memory).
    best = P.encode(microbatch_order.relabel([[P.op(i) for i in o] for o in best]))
    return tuple(tuple(o) for o in best), how


def plan(name: str, pp: int, microbatches: int, costs: Optional[Costs], budget: float,
         stage_costs: Optional[Sequence[StageCost]] = None) -> Schedule:
    """The best verified V-shape schedule found under `budget` (peak_vs_1f1b units), with
    `costs` as users give them (per rank) and `stage_costs` per stage when unequal."""
    check_sizes(name, pp, microbatches)
    costs = (costs or Costs()).per_stage(2)
    if stage_costs is not None:
        from .stage_costs import fit

        stage_costs = fit(stage_costs, 2 * pp, f"{name} at pp={pp}")
    table = stage_table(costs, 2 * pp, stage_costs)
    order, how = _plan(name, pp, microbatches, costs, table, float(budget))
    P = Problem(pp, microbatches, costs, table, cap_of(pp, microbatches, budget, table))
    s = P.schedule(name, order, float(budget), stage_costs, {"plan": how, "makespan": P.evaluate(order)[0]})
    return verify(s)


DEFAULT_BUDGET = 1.0  # v-auto without a budget: the fastest V within 1F1B's activation memory


def v_auto(pp: int, microbatches: int, costs: Costs = Costs(), memory_budget: Optional[float] = None,
           stage_costs: Optional[Sequence[StageCost]] = None, **options) -> Schedule:
    """V-Auto: the fastest V-shape schedule found within `memory_budget` (a fraction of 1F1B's
    activation memory, from V-Min's ((p+4)//3)/p to 2.0; default 1.0)."""
    check_no_options("v-auto", options)
    budget = DEFAULT_BUDGET if memory_budget is None else memory_budget
    return plan("v-auto", pp, microbatches, costs, budget, stage_costs)
