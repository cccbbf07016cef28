"""Greedy list scheduling under the per-rank cap, and the cool-down list-scheduled anew.

`greedy` runs every rank by one priority rule: whenever a rank is free it starts the most
urgent ready op that keeps memory feasible to the end (a microbatch enters a rank only while
room stays reserved for its second chunk), and W's fill waits or run where memory needs
them.  `relist` keeps a plan up to a late F on every rank and lets a rule place the rest
under the real costs.  Both are deterministic.
"""
from __future__ import annotations

import heapq
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..schedule.blocks import EPS, Stuck
from ..schedule.ops import B
from .problem import NOT_DONE, Problem


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


class Listed:
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

    def copy(self) -> "Listed":
        new = object.__new__(Listed)
        new.end, new.live, new.pending = self.end[:], self.live[:], self.pending[:]
        new.nxt = [x[:] for x in self.nxt]
        new.wq, new.out = [w[:] for w in self.wq], [o[:] for o in self.out]
        new.free, new.wake, new.done_fb, new.heap = self.free[:], self.wake[:], self.done_fb[:], self.heap[:]
        return new


def kept_prefix(P: Problem, keep: Sequence[Sequence[int]]) -> Listed:
    """greedy()'s state with `keep`, up to the first moment a rank would apply the rule: the
    same for every rule, so greedy(..., keep=keep, start=kept_prefix(P, keep)) gives what
    greedy(..., keep=keep) gives, without running the shared part again."""
    return greedy(P, "", 0.0, keep=keep, pause=True)


def greedy(P: Problem, order: str, theta: float, reserve: str = "all",
           follow: Optional[Sequence[Sequence[int]]] = None,
           keep: Optional[Sequence[Sequence[int]]] = None, start: Optional[Listed] = None,
           pause: bool = False, hold: float = 0.0) -> Union[List[List[int]], Listed]:
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
    state = Listed(P) if start is None else start.copy()
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


def relist(P: Problem, order: List[List[int]], work: int = RELIST_WORK,
           rules: Sequence[Tuple[str, float, str, float]] = RELIST_RULES,
           prefixes: Optional[Dict[Tuple[int, int], Listed]] = None) -> Tuple[Optional[Tuple[float, float, float]], List[List[int]]]:
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
