"""Eager timeline of a schedule under its costs, and the figures derived from it.

Each rank runs its list in order; an op starts when its rank is free and its inputs have
arrived.  A hop between ranks costs C; a hand-over on the same rank (the V's turn on rank
p-1) costs nothing.  All ranks start together at t=0 (one synchronous iteration).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from .comm import ACT, input_message, is_remote, local_predecessor
from .ops import B, BW, F, OP_KINDS, RELEASE_KINDS, W, Op, Schedule

Key = Tuple[str, int, int]  # ("F" | "G" (B or BW) | "W", microbatch, stage)
# B and BW share "G": either one produces the input gradient a backward op waits for.
_KEY_KIND = {F: "F", B: "G", BW: "G", W: "W"}


class Deadlock(RuntimeError):
    """Some rank waits forever: the op lists cannot run under the matching rule."""


def _key(op: Op) -> Key:
    return (_KEY_KIND[op.kind], op.microbatch, op.stage)


def _input_table(schedule: Schedule) -> Dict[Tuple[str, int], Tuple[Tuple[str, int, bool], ...]]:
    """Per (op kind, stage): (producer's key kind, producer's stage, crosses ranks?) for each
    input of such an op, derived once from comm's rule so simulator and runtime agree."""
    pl, S = schedule.placement, schedule.num_stages
    table = {}
    for stage in range(S):
        for kind in OP_KINDS:
            op = Op(kind, 0, stage)
            deps = []
            msg = input_message(op, S)
            if msg is not None:
                deps.append((_KEY_KIND[F if msg.kind == ACT else B], msg.src_stage, is_remote(msg, pl)))
            for before in local_predecessor(op) or ():
                deps.append((_KEY_KIND[before], stage, False))
            table[(kind, stage)] = tuple(deps)
    return table


def run_lists(schedule: Schedule) -> List[List[Tuple[Op, float, float]]]:
    """Execute every rank's list eagerly; return (op, start, end) per rank, or raise Deadlock."""
    costs, pp = schedule.costs, schedule.pp
    end: Dict[Key, float] = {}
    timeline: List[List[Tuple[Op, float, float]]] = [[] for _ in range(pp)]
    pos, free = [0] * pp, [0.0] * pp
    waiters: Dict[Key, List[int]] = {}
    queue = deque(range(pp))
    inputs = _input_table(schedule)
    table = schedule.stage_table()
    kind_cost = {(k, st): table[st].of(k) for k in (F, B, W, BW) for st in range(schedule.num_stages)}
    while queue:
        r = queue.popleft()
        ops = schedule.ranks[r]
        while pos[r] < len(ops):
            op = ops[pos[r]]
            start, blocked = free[r], None
            for src_kind, src_stage, remote in inputs[(op.kind, op.stage)]:
                key = (src_kind, op.microbatch, src_stage)
                if key not in end:
                    blocked = key
                    break
                start = max(start, end[key] + (costs.C if remote else 0.0))
            if blocked is not None:
                waiters.setdefault(blocked, []).append(r)
                break
            finish = start + kind_cost[(op.kind, op.stage)]
            key = _key(op)
            if key in end:
                raise Deadlock(f"rank {r}: {op} runs a second time")
            end[key] = finish
            free[r] = finish
            timeline[r].append((op, start, finish))
            pos[r] += 1
            queue.extend(waiters.pop(key, ()))
    stuck = [f"rank {r} waits at {schedule.ranks[r][pos[r]]}" for r in range(pp) if pos[r] < len(schedule.ranks[r])]
    if stuck:
        raise Deadlock("; ".join(stuck[:8]) + (f" (and {len(stuck) - 8} more)" if len(stuck) > 8 else ""))
    return timeline


def peak_activations(schedule: Schedule, stage_weight: Optional[Mapping[int, float]] = None) -> List[float]:
    """Per rank, the most stage-activations alive at once (+1 at F, -1 when W or BW ends).

    A rank runs its ops one after another, so list order is time order.  Each stage counts
    with its size (Schedule.size: 1 unless the schedule has unequal stage costs), or with
    `stage_weight[s]` when given (e.g. the measured bytes of one activation of stage s).
    """
    if stage_weight is None and schedule.stage_costs is not None:
        stage_weight = [schedule.size(s) for s in range(schedule.num_stages)]
    peaks = []
    for ops in schedule.ranks:
        live = peak = 0
        for op in ops:
            if op.kind == F:
                live += 1 if stage_weight is None else stage_weight[op.stage]
                peak = max(peak, live)
            elif op.kind in RELEASE_KINDS:
                live -= 1 if stage_weight is None else stage_weight[op.stage]
        peaks.append(peak)
    return peaks


def one_f_one_b_peak(pp: int, microbatches: int) -> int:
    """Microbatches alive on 1F1B's rank 0 at its peak: the unit of peak_vs_1f1b."""
    return min(pp, microbatches)


def peak_vs_1f1b(schedule: Schedule, peaks: Optional[List[int]] = None) -> List[float]:
    """Peak activations scaled by layers per stage so that 1F1B's rank 0 (plain stages) is 1.0."""
    peaks = peak_activations(schedule) if peaks is None else peaks
    ref = one_f_one_b_peak(schedule.pp, schedule.microbatches) * schedule.placement.chunks
    return [p / ref for p in peaks]


@dataclass
class SimResult:
    timeline: List[List[Tuple[Op, float, float]]]
    makespan: float
    busy: List[float]
    bubble_rate: float
    span_bubble_rate: float
    peak_activations: List[float]  # ints when stages are equal
    peak_vs_1f1b: List[float]

    def to_dict(self) -> dict:
        return {
            "makespan": self.makespan,
            "bubble_rate": self.bubble_rate,
            "span_bubble_rate": self.span_bubble_rate,
            "peak_activations": self.peak_activations,
            "peak_vs_1f1b": self.peak_vs_1f1b,
        }


def simulate(schedule: Schedule) -> SimResult:
    timeline = run_lists(schedule)
    makespan = max((t[-1][2] for t in timeline if t), default=0.0)
    busy = [sum(e - s for _, s, e in t) for t in timeline]
    top = max(busy)
    bubble = 1.0 - top / makespan if makespan > 0 else 0.0
    # Span bubble: each rank over its own first-start..last-end, worst rank reported.
    spans = [(t[-1][2] - t[0][1]) if t else 0.0 for t in timeline]
    span_bubble = max((1.0 - b / s) for b, s in zip(busy, spans) if s > 0) if any(spans) else 0.0
    peaks = peak_activations(schedule)
    return SimResult(timeline, makespan, busy, bubble, max(span_bubble, 0.0), peaks, peak_vs_1f1b(schedule, peaks))
