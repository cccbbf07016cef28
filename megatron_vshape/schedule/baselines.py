"""Baseline schedules: 1F1B, interleaved 1F1B, ZB-H1, ZB-H2.

Each generator is a pure function (pp, microbatches, costs=Costs(), **options) -> Schedule
with `costs` as users give them (one rank's share of the model); the schedule carries the
per-stage costs and is verified before it is returned.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Dict, List, Optional, Tuple

from .errors import ConfigError
from .ops import B, BW, F, W, Costs, Op, Placement, Schedule, check_no_options, check_sizes
from .verify import verify


def _single(name: str, pp: int, microbatches: int, costs: Costs, ranks: List[List[Op]], **meta) -> Schedule:
    schedule = Schedule(name, Placement("single", pp), microbatches, costs.per_stage(1), ranks, dict(meta))
    return verify(schedule)


def one_f_one_b(pp: int, microbatches: int, costs: Costs = Costs(), **options) -> Schedule:
    """Megatron's 1F1B: rank r runs min(p-1-r, m) warm-up forwards, then one forward and one
    combined backward in turn, then the remaining backwards."""
    check_no_options("1f1b", options)
    check_sizes("1f1b", pp, microbatches)
    ranks = []
    for r in range(pp):
        warm = min(pp - 1 - r, microbatches)
        ops = [Op(F, i, r) for i in range(warm)]
        for i in range(microbatches - warm):
            ops += [Op(F, warm + i, r), Op(BW, i, r)]
        ops += [Op(BW, i, r) for i in range(microbatches - warm, microbatches)]
        ranks.append(ops)
    return _single("1f1b", pp, microbatches, costs, ranks)


def megatron_interleaved_table(microbatches: int, chunks: int, group: int) -> List[Tuple[int, int]]:
    """(microbatch, chunk) of each forward in Megatron-core's interleaved order.

    Microbatches go in groups of `group` (microbatch_group_size_per_vp_stage); each group
    runs through chunk 0, then chunk 1, ...; the last group takes whatever is left.
    """
    table: List[Tuple[int, int]] = []
    for first in range(0, microbatches, group):
        last = microbatches if first + group >= microbatches else first + group
        table += [(mb, c) for c in range(chunks) for mb in range(first, last)]
    return table


def interleaved_1f1b(
    pp: int, microbatches: int, costs: Costs = Costs(), chunks: int = 2, group: Optional[int] = None, **options
) -> Schedule:
    """Megatron-core 0.16's interleaved 1F1B on the loop placement (rank r holds r, r+p, ...).

    `group` is Megatron's microbatch_group_size_per_vp_stage (default pp). Megatron requires
    pp <= group <= microbatches and a last group of 0 or >= pp microbatches; so do we.
    Warm-up on rank r: 2(p-1-r) + (chunks-1)*group forwards; backward k runs the chunks of
    forward k in reverse.
    """
    name = "1f1b-interleaved"
    check_no_options(name, options)
    chunks, group = int(chunks), pp if group is None else int(group)  # group=0 is an error, not the default
    if chunks < 2:
        raise ConfigError(f"{name}: chunks={chunks}; interleaving needs chunks >= 2 (use 1f1b for one chunk)")
    check_sizes(name, pp, microbatches, min_microbatches=pp)
    if not pp <= group <= microbatches:
        raise ConfigError(
            f"{name}: group={group} (Megatron's microbatch_group_size_per_vp_stage) must lie in "
            f"[pp={pp}, microbatches={microbatches}]"
        )
    rest = microbatches % group
    if 0 < rest < pp:
        raise ConfigError(
            f"{name}: microbatches={microbatches} leaves a last group of {rest} < pp={pp} with group={group}; "
            f"Megatron-core rejects that. Use a multiple of {group} (e.g. {microbatches - rest} or "
            f"{microbatches - rest + group}), or pass group={microbatches}"
        )
    table = megatron_interleaved_table(microbatches, chunks, group)
    total = len(table)
    placement = Placement("loop", pp, chunks)

    def fwd(r: int, k: int) -> Op:
        mb, c = table[k]
        return Op(F, mb, placement.stage_of(r, c))

    def bwd(r: int, k: int) -> Op:
        mb, c = table[k]
        return Op(BW, mb, placement.stage_of(r, chunks - 1 - c))

    ranks = []
    for r in range(pp):
        warm = min(total, 2 * (pp - 1 - r) + (chunks - 1) * group)
        ops = [fwd(r, k) for k in range(warm)]
        for k in range(total - warm):
            ops += [fwd(r, warm + k), bwd(r, k)]
        ops += [bwd(r, k) for k in range(total - warm, total)]
        ranks.append(ops)
    schedule = Schedule(name, placement, microbatches, costs.per_stage(chunks), ranks, {"chunks": chunks, "group": group})
    return verify(schedule)


def zb_h1(pp: int, microbatches: int, costs: Costs = Costs(), **options) -> Schedule:
    """ZB-H1: 1F1B's F/B order with each W delayed so the tail bubbles fill with W's.

    Rank r runs W(i) right after B(i+r), so every rank holds at most p activations (1F1B's
    rank-0 peak) and, for m >= p at unit costs, all ranks end at 3m+p-1: bubble (p-1)/(3m+p-1).
    """
    check_no_options("zb-h1", options)
    check_sizes("zb-h1", pp, microbatches)
    m = microbatches
    ranks = []
    for r in range(pp):
        warm, lag = min(pp - 1 - r, m), r
        ops = [Op(F, i, r) for i in range(warm)]
        for i in range(m):
            if warm + i < m:
                ops.append(Op(F, warm + i, r))
            ops.append(Op(B, i, r))
            if i >= lag:
                ops.append(Op(W, i - lag, r))
        ops += [Op(W, i, r) for i in range(max(m - lag, 0), m)]
        ranks.append(ops)
    return _single("zb-h1", pp, m, costs, ranks)


def zb_h2(pp: int, microbatches: int, costs: Costs = Costs(), **options) -> Schedule:
    """ZB-H2: up to twice 1F1B's activations buy a pipeline without a start-up idle.

    Built by list scheduling under the costs: whenever a rank is free it runs, in this
    priority, a B whose gradient has arrived, an F whose input has arrived while fewer than
    2p activations are alive, else its oldest pending W. The extra warm-up forwards fill the
    start-up bubble and the deferred W's fill the cool-down.
    """
    check_no_options("zb-h2", options)
    check_sizes("zb-h2", pp, microbatches)
    ranks = _list_schedule(pp, microbatches, costs.per_stage(1), max_alive=2 * pp)
    return _single("zb-h2", pp, microbatches, costs, ranks, max_alive=2 * pp)


def _list_schedule(pp: int, m: int, costs: Costs, max_alive: int) -> List[List[Op]]:
    """Greedy per-rank order on the single placement (see zb_h2), simulated in time order.

    Ranks are advanced earliest-free first, so every op that ends by a rank's decision time
    is known when it decides; a rank with nothing to do sleeps until another rank acts.
    """
    f_end: List[Dict[int, float]] = [dict() for _ in range(pp)]
    b_end: List[Dict[int, float]] = [dict() for _ in range(pp)]
    next_f, next_b, alive = [0] * pp, [0] * pp, [0] * pp
    pending_w: List[deque] = [deque() for _ in range(pp)]
    ranks: List[List[Op]] = [[] for _ in range(pp)]
    heap = [(0.0, r, 0) for r in range(pp)]
    version = [0] * pp  # a rank's newest heap entry; older ones are stale
    waiting: Dict[int, float] = {}  # idle ranks and since when

    def wake(r: int, t: float) -> None:
        version[r] += 1
        heapq.heappush(heap, (t, r, version[r]))

    def arrival(r: int, kind: str):
        """When the input of rank r's next `kind` op arrives (None: not produced yet)."""
        if kind == F:
            j = next_f[r]
            if j >= m or alive[r] >= max_alive:
                return None
            return 0.0 if r == 0 else (None if j not in f_end[r - 1] else f_end[r - 1][j] + costs.C)
        j = next_b[r]
        if j >= next_f[r]:
            return None
        if r == pp - 1:
            return f_end[r][j]
        return None if j not in b_end[r + 1] else b_end[r + 1][j] + costs.C

    while heap:
        now, r, ver = heapq.heappop(heap)
        if ver != version[r]:
            continue
        ready_b, ready_f = arrival(r, B), arrival(r, F)
        if ready_b is not None and ready_b <= now:
            j = next_b[r]
            next_b[r] += 1
            b_end[r][j] = end = now + costs.B
            pending_w[r].append(j)
            ranks[r].append(Op(B, j, r))
        elif ready_f is not None and ready_f <= now:
            j = next_f[r]
            next_f[r] += 1
            alive[r] += 1
            f_end[r][j] = end = now + costs.F
            ranks[r].append(Op(F, j, r))
        elif pending_w[r]:
            alive[r] -= 1
            end = now + costs.W
            ranks[r].append(Op(W, pending_w[r].popleft(), r))
        else:
            # Idle: look again when a known input arrives, or when any rank runs an op.
            waiting[r] = now
            later = [t for t in (ready_b, ready_f) if t is not None]
            if later:
                wake(r, min(later))
            continue
        waiting.pop(r, None)
        if next_b[r] < m or pending_w[r]:
            wake(r, end)
        for s, since in list(waiting.items()):
            wake(s, max(since, now))
    unfinished = [r for r in range(pp) if next_b[r] < m or pending_w[r]]
    if unfinished:
        raise RuntimeError(f"list scheduling stalled on ranks {unfinished}")  # a bug, not a user error
    return ranks
