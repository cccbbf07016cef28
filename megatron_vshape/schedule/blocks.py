"""The paper's building-block framework: a block, its lifespan and peak memory, and the
three steps that turn it into a schedule (repeat, squeeze, reorder).

A building block lays out one microbatch: for every stage, the start offsets of its F, B and
W.  Repeating it every `interval` time units over m microbatches gives a timed pipeline; the
block is legal when copies never collide on a rank.  A stage holds each microbatch's
activation from the start of its F to the end of its W (the lifespan), so in the steady
state at most ceil(lifespan / interval) copies of it are alive: the lifespan and the
interval decide peak memory.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .ops import B, BW, F, RELEASE_KINDS, W, Costs, Op, Placement, Schedule
from .simulate import _dependencies, _key

EPS = 1e-9
Slot = Tuple[str, int]  # (op kind, global stage)


def peak_from_lifespan(lifespan: float, interval: float) -> int:
    """Most copies of one stage's activation alive at once when a block with this lifespan
    repeats every `interval`: ceil(lifespan / interval) (the paper's relation)."""
    if interval <= 0:
        raise ValueError(f"interval={interval} must be > 0")
    return max(0, math.ceil(lifespan / interval - EPS))


@dataclass(frozen=True)
class Block:
    """One microbatch's ops on every stage, as start offsets, repeated every `interval`.

    `start[(kind, stage)]` is the offset of that op; kinds are F, B, W (split backward) or
    F, BW.  `costs` are per stage.
    """

    placement: Placement
    costs: Costs
    interval: float
    start: Dict[Slot, float]

    def end(self, kind: str, stage: int) -> float:
        return self.start[(kind, stage)] + self.costs.of(kind)

    def release_kind(self, stage: int) -> str:
        return W if (W, stage) in self.start else BW

    def lifespan(self, stage: int) -> float:
        """From the start of F to the end of the op that frees the activation (W or BW)."""
        return self.end(self.release_kind(stage), stage) - self.start[(F, stage)]

    def slots_of(self, rank: int) -> List[Slot]:
        stages = set(self.placement.stages_of(rank))
        return sorted((s for s in self.start if s[1] in stages), key=lambda s: self.start[s])

    def peak_bound(self, rank: int) -> int:
        """The paper's bound for a rank: the sum over its stages of ceil(lifespan / interval)."""
        return sum(peak_from_lifespan(self.lifespan(s), self.interval) for s in self.placement.stages_of(rank))

    def steady_peak(self, rank: int) -> int:
        """Exact steady-state peak of the repeated block on `rank`: the most activations alive
        at any instant, where stage s's copies live on [F + kT, end of W + kT)."""
        T = self.interval
        spans = [(self.start[(F, s)], self.lifespan(s)) for s in self.placement.stages_of(rank)]
        best = 0
        for t0, _ in spans:  # the count only rises at an F start, so check those instants
            alive = 0
            for a, life in spans:
                # copies k with a + kT <= t0 < a + kT + life
                alive += math.floor((t0 - a) / T + EPS) - math.floor((t0 - a - life) / T + EPS)
            best = max(best, alive)
        return best

    def problems(self) -> List[str]:
        """Dependency violations and collisions between repeated copies (empty when legal)."""
        out: List[str] = []
        pl, T, c = self.placement, self.interval, self.costs
        probe = Schedule("block", pl, 1, c, [[] for _ in range(pl.pp)])
        for (kind, stage), t in self.start.items():
            for (dkind, _, dstage), remote in _dependencies(Op(kind, 0, stage), probe):
                dkind = {"G": B if (B, dstage) in self.start else BW}.get(dkind, dkind)
                ready = self.end(dkind, dstage) + (c.C if remote else 0.0)
                if t < ready - EPS:
                    out.append(f"{kind}@{stage} starts at {t:g} before its input is ready at {ready:g}")
        for rank in range(pl.pp):
            spans = sorted((self.start[s] % T, self.costs.of(s[0]), s) for s in self.slots_of(rank))
            if sum(d for _, d, _ in spans) > T + EPS:
                out.append(f"rank {rank}: ops take {sum(d for _, d, _ in spans):g} > interval {T:g}")
                continue
            for (a, da, sa), (b, _, sb) in zip(spans, spans[1:] + [(spans[0][0] + T, 0, spans[0][2])]):
                if a + da > b + EPS:
                    out.append(f"rank {rank}: {sa[0]}@{sa[1]} and {sb[0]}@{sb[1]} collide when repeated every {T:g}")
        return out


def repeat(block: Block, microbatches: int) -> List[List[Tuple[float, Op]]]:
    """The timed pipeline: copy k of every op starts at its offset + k * interval.
    Per rank, (start, op) in time order."""
    pl = block.placement
    timed: List[List[Tuple[float, Op]]] = [[] for _ in range(pl.pp)]
    for (kind, stage), t in block.start.items():
        r = pl.rank_of(stage)
        timed[r].extend((t + k * block.interval, Op(kind, k, stage)) for k in range(microbatches))
    for ops in timed:
        ops.sort(key=lambda x: (x[0], x[1].kind != W))
    return timed


def squeeze(block: Block, microbatches: int, name: str) -> Schedule:
    """Keep the repeated pipeline's order on every rank and drop its timing: executed eagerly
    (simulate), every op starts as soon as its rank and inputs allow, so redundant idle time
    disappears while the order, and hence the peak memory, stays the same."""
    ranks = [[op for _, op in ops] for ops in repeat(block, microbatches)]
    return Schedule(name, block.placement, microbatches, block.costs, ranks, {"interval": block.interval})


def priorities(block: Block, microbatches: int) -> Dict[Op, float]:
    """Each op's time in the repeated block; the reorder step uses it as its preference."""
    return {op: t for ops in repeat(block, microbatches) for t, op in ops}


class Stuck(RuntimeError):
    """The reorder step found no op that can run on any rank (its memory caps are too tight)."""


def reorder(
    placement: Placement,
    microbatches: int,
    costs: Costs,
    priority: Callable[[Op], float],
    caps: Sequence[int],
    name: str,
    split: bool = True,
    window: int = 64,
) -> Schedule:
    """List-schedule every rank under its memory cap, preferring ops in `priority` order.

    Whenever a rank is free it runs the most preferred op whose inputs have arrived and that
    keeps its live activations within `caps[rank]`; an F may run ahead of a preferred F that
    is not ready only if memory stays reserved for that one.  In the steady state this keeps
    the block's order; in warm-up and cool-down it pulls ops into idle time that the
    repeated block leaves, without exceeding the cap (so without raising peak memory when
    the cap is the block's peak).  Times follow simulate's rules, so the result's eager
    timeline is the one built here.  Raises Stuck when no rank can make progress.
    """
    pp, S, m = placement.pp, placement.num_stages, microbatches
    probe = Schedule(name, placement, m, costs, [[] for _ in range(pp)])
    back = (B, W) if split else (BW,)
    todo: List[List[Op]] = [[] for _ in range(pp)]
    for s in range(S):
        r = placement.rank_of(s)
        todo[r].extend(Op(k, mb, s) for mb in range(m) for k in (F,) + back)
    deps = {}
    for ops in todo:
        ops.sort(key=priority)
        for op in ops:
            deps[op] = _dependencies(op, probe)
    end: Dict[tuple, float] = {}
    order: List[List[Op]] = [[] for _ in range(pp)]
    live, head = [0] * pp, [0] * pp
    done = set()
    wake = [0.0] * pp  # when each rank next looks for work; inf while it waits for an input
    free = [0.0] * pp  # when each rank's current op ends
    heap = [(0.0, r) for r in range(pp)]
    C = costs.C
    while heap:
        t, r = heapq.heappop(heap)
        if t != wake[r]:
            continue  # superseded wake-up
        ops = todo[r]
        while head[r] < len(ops) and ops[head[r]] in done:
            head[r] += 1
        chosen, soonest, skipped_f, seen, i = None, math.inf, 0, 0, head[r]
        while i < len(ops) and seen < window:
            op = ops[i]
            i += 1
            if op in done:
                continue
            seen += 1
            ready = 0.0
            for key, remote in deps[op]:
                e = end.get(key)
                if e is None:
                    ready = math.inf
                    break
                ready = max(ready, e + (C if remote else 0.0))
            fits = op.kind != F or live[r] + 1 + skipped_f <= caps[r]
            if ready <= t + EPS and fits:
                chosen = op
                break
            if fits:
                soonest = min(soonest, ready)
            if op.kind == F:
                skipped_f += 1
        if chosen is None:
            wake[r] = soonest
            if soonest < math.inf:
                heapq.heappush(heap, (soonest, r))
            continue
        done.add(chosen)
        finish = t + costs.of(chosen.kind)
        end[_key(chosen)] = finish
        order[r].append(chosen)
        live[r] += 1 if chosen.kind == F else -1 if chosen.kind in RELEASE_KINDS else 0
        wake[r] = free[r] = finish
        heapq.heappush(heap, (finish, r))
        # Only the consumer of this op's output can become ready because of it.
        nxt = chosen.stage + 1 if chosen.kind == F else chosen.stage - 1 if chosen.kind != W else -1
        if 0 <= nxt < S:
            q = placement.rank_of(nxt)
            at = max(finish, free[q])
            if q != r and at < wake[q]:
                wake[q] = at
                heapq.heappush(heap, (at, q))
    stalled = [f"rank {q}: next {todo[q][head[q]]}" for q in range(pp) if len(order[q]) < len(todo[q])]
    if stalled:
        raise Stuck(f"{name}: no rank can proceed under caps {list(caps)}; " + "; ".join(stalled[:6]))
    return Schedule(name, placement, m, costs, order)
