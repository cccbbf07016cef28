"""Checks that a schedule is complete, correctly placed, ordered and deadlock-free."""
from __future__ import annotations

from collections import Counter
from typing import List

from .errors import ConfigError
from .comm import MAX_CHANNEL_STREAMS, channel_streams, device_stall, local_predecessor
from .ops import B, BW, F, OP_KINDS, W, Op, Schedule
from .simulate import Deadlock, peak_vs_1f1b, run_lists

# Slack for float sums of stage sizes when checking a memory budget.
BUDGET_EPS = 1e-9


class InvalidSchedule(ConfigError):
    """The op lists cannot be executed correctly; the message lists the problems."""


# Op kind -> the kinds of the same (stage, microbatch) that must come earlier on the rank
# (comm's rule depends on the kind only; looked up per kind to keep the check fast).
_MUST_FOLLOW = {kind: local_predecessor(Op(kind, 0, 0)) or () for kind in OP_KINDS}


def problems(schedule: Schedule, forward_only: bool = False) -> List[str]:
    """Every problem found, as readable lines (empty when the schedule is valid)."""
    pl, S, m = schedule.placement, schedule.num_stages, schedule.microbatches
    out: List[str] = []
    if len(schedule.ranks) != pl.pp:
        return [f"{len(schedule.ranks)} op lists for pp={pl.pp}"]
    counts: Counter = Counter()
    rank_of = [pl.rank_of(s) for s in range(S)]
    for rank, ops in enumerate(schedule.ranks):
        seen = set()
        for op in ops:
            key = (op.kind, op.microbatch, op.stage)
            if not (0 <= op.stage < S and 0 <= op.microbatch < m):
                out.append(f"rank {rank}: {op} is outside stages 0..{S - 1} / microbatches 0..{m - 1}")
                continue
            if rank_of[op.stage] != rank:
                out.append(f"rank {rank}: {op} belongs to rank {rank_of[op.stage]}")
            if forward_only and op.kind != F:
                out.append(f"rank {rank}: {op} in a forward-only schedule")
            for before in _MUST_FOLLOW[op.kind]:
                if (before, op.microbatch, op.stage) not in seen:
                    out.append(f"rank {rank}: {op} comes before {before}{op.microbatch}@{op.stage}")
            seen.add(key)
            counts[key] += 1
    for s in range(S):
        for mb in range(m):
            f, b, w, bw = (counts[(k, mb, s)] for k in (F, B, W, BW))
            if f != 1:
                out.append(f"F{mb}@{s} appears {f} times, expected once")
            if forward_only:
                continue
            if not ((b == 1 and w == 1 and bw == 0) or (b == 0 and w == 0 and bw == 1)):
                out.append(f"microbatch {mb} stage {s}: B x{b}, W x{w}, BW x{bw}; expected one B and one W, or one BW")
    if out:
        return out
    # Completeness above guarantees every needed message is produced by some op; what is
    # left is whether the lists can run under the matching rule, which run_lists decides.
    try:
        run_lists(schedule)
    except Deadlock as exc:
        out.append(f"deadlock under the matching rule: {exc}")
    else:
        if channel_streams(schedule) is None:
            stalled = device_stall(schedule, MAX_CHANNEL_STREAMS)
            out.append(f"deadlock under NCCL's ordering (sends complete only when received, one device queue) "
                       f"with up to {MAX_CHANNEL_STREAMS} communicators per channel: {'; '.join(stalled[:8])}")
    if schedule.memory_budget is not None and not forward_only:
        for rank, peak in enumerate(peak_vs_1f1b(schedule)):
            if peak > schedule.memory_budget + BUDGET_EPS:
                out.append(f"rank {rank}: peak activations {peak:.4g} of 1F1B exceed the memory budget {schedule.memory_budget:g}")
    return out


def forwards_out_of_order(schedule: Schedule) -> List[str]:
    """Where a stage's forwards run out of microbatch order (valid, but not how generators lay them
    out: a hand-edited or solver-made order).  Megatron's forward_step_func reads data in call
    order; the runtime binds item k of each chunk's data iterator to microbatch k
    (runtime.microbatch_data), so such an order trains on the right data all the same."""
    out = []
    for rank, ops in enumerate(schedule.ranks):
        last: dict = {}
        for op in ops:
            if op.kind != F:
                continue
            before = last.get(op.stage)
            if before is not None and op.microbatch < before:
                out.append(f"rank {rank}: F{op.microbatch}@{op.stage} runs after F{before}@{op.stage}")
            last[op.stage] = max(op.microbatch, before if before is not None else -1)
    return out


def verify(schedule: Schedule, forward_only: bool = False) -> Schedule:
    """Return `schedule` unchanged if valid; raise InvalidSchedule listing the problems."""
    found = problems(schedule, forward_only)
    if found:
        head = "\n  ".join(found[:20])
        more = f"\n  ... and {len(found) - 20} more" if len(found) > 20 else ""
        raise InvalidSchedule(f"schedule {schedule.name!r} (pp={schedule.pp}, microbatches={schedule.microbatches}) is invalid:\n  {head}{more}")
    return schedule


def forward_only_order(schedule: Schedule, microbatches: int) -> Schedule:
    """Forward ops only, for `microbatches` microbatches on `schedule`'s placement, each rank's in the
    order they would start in a pipeline of equal forward times (microbatch + stage, then stage):
    evaluation at a count the training schedule cannot run (too few microbatches for its memory
    limit, or an order planned for one count).  Every op waits only for ops of a smaller
    microbatch + stage, and each channel carries its messages in that order, so it cannot deadlock;
    forward-only holds no activation from one op to the next, so no memory limit applies."""
    placement = schedule.placement
    ranks: List[List[Op]] = [[] for _ in range(placement.pp)]
    for mb in range(microbatches):
        for stage in range(placement.num_stages):
            ranks[placement.rank_of(stage)].append(Op(F, mb, stage))
    for ops in ranks:
        ops.sort(key=lambda op: (op.microbatch + op.stage, op.stage))
    meta = {**schedule.meta, "forward_only": True, "plan": "forward ops in pipeline order"}
    return Schedule(schedule.name, placement, microbatches, schedule.costs, ranks, meta, schedule.stage_costs,
                    schedule.memory_budget)


def forward_only_view(schedule: Schedule) -> Schedule:
    """The same schedule with backward ops removed (evaluation runs forward ops only).
    meta["forward_only"] marks it, so an export of it reads back as forward-only."""
    ranks = [[op for op in ops if op.kind == F] for ops in schedule.ranks]
    meta = {**schedule.meta, "forward_only": True}
    return Schedule(schedule.name, schedule.placement, schedule.microbatches, schedule.costs, ranks, meta,
                    schedule.stage_costs, schedule.memory_budget)
