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
from typing import Dict, List, Optional, Sequence, Tuple

from .ops import B, BW, F, W, Costs, Op, Placement, Schedule
from .comm import input_message, is_remote, local_predecessor

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
        back = B if any(k == B for k, _ in self.start) else BW
        for (kind, stage), t in self.start.items():
            op = Op(kind, 0, stage)
            inputs = [((k, stage), 0.0) for k in local_predecessor(op) or () if (k, stage) in self.start]
            msg = input_message(op, pl.num_stages)
            if msg is not None:
                src = (F if kind == F else back, msg.src_stage)
                inputs.append((src, c.C if is_remote(msg, pl) else 0.0))
            for (dkind, dstage), hop in inputs:
                ready = self.end(dkind, dstage) + hop
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


class Stuck(RuntimeError):
    """The reorder step found no op that can run on any rank (its memory caps are too tight)."""


def reorder(
    block: Block,
    microbatches: int,
    caps: Sequence[int],
    name: str,
    reserve: Optional[Sequence[int]] = None,
    safe: bool = False,
    window: int = 48,
) -> Schedule:
    """List-schedule every rank under its memory cap, preferring ops in the order of the
    repeated block (copy k of an op is preferred at its offset + k * interval).

    Whenever a rank is free it runs the most preferred op whose inputs have arrived and that
    keeps its live activations within `caps[rank]`.  An F may run ahead of preferred F's
    that are not ready only if memory stays reserved for them (for at most `reserve[rank]`
    of them when given).  With `safe`, a rank instead starts a new microbatch only if memory
    stays reserved for every later-chunk F of the microbatches it has started; then no rank
    can wait for memory forever (caps >= chunks per rank), whatever the preferences.  In the
    steady state this keeps the block's order; in warm-up and cool-down it pulls ops into the
    idle time the repeated block leaves, without exceeding the cap (so without raising peak
    memory when the cap is the block's peak).  Each decision looks at the first `window`
    not-yet-run ops of the rank's preference order (keeps a decision cheap; `safe` looks at all).  The block only sets preferences here: its offsets may collide, the
    list scheduler resolves that.  Times follow simulate's rules (an op starts when its rank
    is free and its inputs have arrived, plus C across ranks), so the result's eager
    timeline is the one built here.  Raises Stuck when no rank can make progress.
    """
    pl, costs, T, m = block.placement, block.costs, block.interval, microbatches
    pp, S, C = pl.pp, pl.num_stages, block.costs.C
    kinds = sorted({k for k, _ in block.start}, key=(F, B, W, BW).index)
    split = B in kinds
    rank = [pl.rank_of(s) for s in range(S)]
    # Ops are integers: 3 * (mb * S + stage) + slot, slot 0 = F, 1 = B or BW, 2 = W.
    slot_of = {F: 0, B: 1, BW: 1, W: 2}
    dur = [costs.F, costs.B if split else costs.of(BW), costs.W]
    todo: List[List[int]] = [[] for _ in range(pp)]
    for (kind, s), off in block.start.items():
        r, slot = rank[s], slot_of[kind]
        todo[r].extend((off + k * T, slot != 2, 3 * (k * S + s) + slot) for k in range(m))
    for r in range(pp):
        todo[r] = [op for _, _, op in sorted(todo[r])]
    end = [-1.0] * (3 * m * S)
    order: List[List[int]] = [[] for _ in range(pp)]
    live, head, pending = [0] * pp, [0] * pp, [0] * pp
    first = [min(pl.stages_of(r)) for r in range(pp)]  # where a microbatch enters each rank
    later = pl.chunks - 1  # F's it still needs on the rank after entering
    if safe:
        window = 1 << 30
    wake = [0.0] * pp  # when each rank next looks for work; inf while it waits for an input
    free = [0.0] * pp  # when each rank's current op ends
    heap = [(0.0, r) for r in range(pp)]
    inf = math.inf
    # Per stage: the hop cost of its forward input and of its backward input (inf: none).
    f_hop = [inf] + [C if rank[s - 1] != rank[s] else 0.0 for s in range(1, S)]
    b_hop = [C if rank[s + 1] != rank[s] else 0.0 for s in range(S - 1)] + [inf]
    while heap:
        t, r = heapq.heappop(heap)
        if t != wake[r]:
            continue  # superseded wake-up
        ops = todo[r]
        n, h = len(ops), head[r]
        while h < n and end[ops[h]] >= 0:
            h += 1
        head[r] = h
        chosen, soonest, skipped_f, seen, i = -1, inf, 0, 0, h
        room = caps[r] - live[r] - 1  # F's this rank may still start
        limit = t + EPS
        while i < n and seen < window:
            op = ops[i]
            i += 1
            if end[op] >= 0:
                continue
            seen += 1
            slot = op % 3
            # Inputs, as in comm.py: F needs F of the previous stage; B (or BW) needs its own
            # F and the backward of the next stage; W needs its own B.
            if slot == 0:
                s = (op // 3) % S
                if s == 0:
                    ready = 0.0
                else:
                    e = end[op - 3]
                    ready = e + f_hop[s] if e >= 0 else inf
                if safe:
                    fits = (pending[r] + later if s == first[r] else 0) <= room
                else:
                    fits = (skipped_f if reserve is None else min(skipped_f, reserve[r])) <= room
                skipped_f += 1
            else:
                ready = end[op - 1]
                if ready < 0:
                    ready = inf
                elif slot == 1:
                    s = (op // 3) % S
                    if s < S - 1:
                        e = end[op + 3]
                        ready = inf if e < 0 else max(ready, e + b_hop[s])
                fits = True
            if fits:
                if ready <= limit:
                    chosen = op
                    break
                if ready < soonest:
                    soonest = ready
        if chosen < 0:
            wake[r] = soonest
            if soonest < inf:
                heapq.heappush(heap, (soonest, r))
            continue
        slot, s = chosen % 3, (chosen // 3) % S
        finish = t + dur[slot]
        end[chosen] = finish
        order[r].append(chosen)
        live[r] += 1 if slot == 0 else -1 if (slot == 2 or not split) else 0
        if slot == 0:
            pending[r] += later if s == first[r] else -1
        wake[r] = free[r] = finish
        heapq.heappush(heap, (finish, r))
        # Only the consumer of this op's output on a neighbouring stage can become ready.
        nxt = s + 1 if slot == 0 else s - 1 if slot == 1 else -1
        if 0 <= nxt < S and rank[nxt] != r:
            q = rank[nxt]
            at = max(finish, free[q])
            if at < wake[q]:
                wake[q] = at
                heapq.heappush(heap, (at, q))
    names = (F, B if split else BW, W)
    ranks = [[Op(names[op % 3], op // (3 * S), (op // 3) % S) for op in ops] for ops in order]
    stalled = [f"rank {q}" for q in range(pp) if len(order[q]) < len(todo[q])]
    if stalled:
        raise Stuck(f"{name}: {', '.join(stalled[:6])} cannot proceed under memory caps {list(caps)}")
    return Schedule(name, pl, m, costs, ranks, {"interval": T, "makespan": max(free)})
