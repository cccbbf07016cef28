"""V-shape schedules of the paper: V-ZB, V-Half, V-Min.

Placement `v`: rank r holds stages r and 2p-1-r, so one microbatch's forward runs down the
ranks and back up, and its backward does the same in reverse.  Every schedule here is built
the paper's way: a V-shape building block under the per-stage costs, repeated, squeezed and
reordered under a memory cap.  The caps are the paper's: V-Min (p+4)//3, V-Half (p+2)//2
and V-ZB p microbatches' worth of 1F1B activations per rank.  Which block is best depends on
the costs, so the generator tries a few and keeps the one whose simulated makespan is
shortest (deterministically; ties go to the first tried).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from .blocks import EPS, Block, Stuck, priorities, reorder
from .errors import ConfigError
from .ops import B, F, W, Costs, Op, Placement, Schedule, check_sizes
from .registry import register
from .simulate import run_lists
from .verify import verify


def _place(busy: List[Tuple[float, float]], ready: float, dur: float, T: float) -> float:
    """Earliest start >= ready where [start, start+dur) misses every busy span modulo T."""
    if sum(d for _, d in busy) + dur > T + EPS:
        raise ValueError("interval too short for the rank's ops")
    t = ready
    for _ in range(4 * len(busy) + 4):
        x = t % T
        for a, d in busy:
            if (a - x) % T < dur - EPS or (x - a) % T < d - EPS:
                t += (a + d - x) % T or T
                break
        else:
            busy.append((t % T, dur))
            return t
    raise ValueError("no free slot")


def v_block(pp: int, costs: Costs, interval: float, turn: float = 0.0, spread: float = 0.0, bspread: float = 0.0) -> Block:
    """A V-shape building block placed greedily under real costs.

    The forward runs stage 0..2p-1 (down the ranks and back), then after `turn` the backward
    runs 2p-1..0; each op starts as soon as its input is there (plus `spread` between
    chunk-0 forwards, which lengthens lifespans and frees room) and no earlier copy of the
    block occupies its rank; the W's then take the first free room after their B.
    """
    pl = Placement("v", pp, 2)
    S, C = 2 * pp, costs.C
    busy: List[List[Tuple[float, float]]] = [[] for _ in range(pp)]
    start: Dict[Tuple[str, int], float] = {}
    hop = lambda a, b: C if pl.rank_of(a) != pl.rank_of(b) else 0.0  # noqa: E731
    t = 0.0
    for s in range(S):
        if s:
            t = start[(F, s - 1)] + costs.F + hop(s - 1, s) + (spread if s < pp else 0.0)
        start[(F, s)] = _place(busy[pl.rank_of(s)], t, costs.F, interval)
    t = start[(F, S - 1)] + costs.F + turn
    for s in range(S - 1, -1, -1):
        if s < S - 1:
            t = start[(B, s + 1)] + costs.B + hop(s + 1, s) + (bspread if s >= pp else 0.0)
        start[(B, s)] = _place(busy[pl.rank_of(s)], t, costs.B, interval)
    for r in range(pp):
        for s in (S - 1 - r, r):  # the chunk-1 backward comes first on every rank
            start[(W, s)] = _place(busy[r], start[(B, s)] + costs.B, costs.W, interval)
    return Block(pl, costs, interval, start)


def memory_caps(name: str, pp: int, microbatches: int, per_1f1b: int) -> List[int]:
    """Stage-activations a rank may hold: `per_1f1b` microbatches of 1F1B's rank-0 memory out
    of pp (scaled to min(pp, m) like peak_vs_1f1b), two half-size stage-activations each."""
    ref = min(pp, microbatches)
    cap = (2 * ref * per_1f1b) // pp
    if cap < 2:  # one microbatch holds both of rank 0's stages at once on its way back
        need = next(k for k in range(1, pp + 1) if 2 * k * per_1f1b >= 2 * pp)
        raise ConfigError(
            f"{name}: microbatches={microbatches} is too few for pp={pp}; its memory limit of "
            f"{per_1f1b}/{pp} of 1F1B cannot hold one microbatch's two chunks; use microbatches >= {need}"
        )
    return [cap] * pp


def _makespan(s: Schedule) -> float:
    return max(t[-1][2] for t in run_lists(s) if t)


def _search(name: str, pp: int, m: int, costs: Costs, caps: Sequence[int], turns: Sequence[float],
            spreads: Sequence[float], stretches: Sequence[float]) -> Schedule:
    per_stage = costs.per_stage(2)
    base = 2 * (per_stage.F + per_stage.B + per_stage.W)
    best: Optional[Tuple[float, Schedule]] = None
    tried: List[str] = []
    for stretch in stretches:
        for turn in turns:
            for spread in spreads:
                try:
                    block = v_block(pp, per_stage, base * stretch, turn * per_stage.F, spread * per_stage.F)
                except ValueError:
                    continue
                prio = priorities(block, m)
                try:
                    s = reorder(block.placement, m, per_stage, prio.__getitem__, caps, name)
                except Stuck as exc:
                    tried.append(str(exc))
                    continue
                span = _makespan(s)
                if best is None or span < best[0] - EPS:
                    s.meta.update({"interval": block.interval, "turn": turn, "spread": spread})
                    best = (span, s)
    if best is None:
        raise ConfigError(f"{name}: no V-shape block fits pp={pp}, microbatches={m}: {tried[:1]}")
    return best[1]


def _generate(name: str, pp: int, microbatches: int, costs: Optional[Costs], per_1f1b: int) -> Schedule:
    check_sizes(name, pp, microbatches)
    costs = costs or Costs()
    caps = memory_caps(name, pp, microbatches, per_1f1b)
    s = _search(name, pp, microbatches, costs, caps, turns=(0.0, 1.0), spreads=(0.0, 1.0), stretches=(1.0, 1.05, 1.1))
    return verify(s)


@register("v-min")
def v_min(pp: int, microbatches: int, costs: Costs = Costs()) -> Schedule:
    """V-Min: about 1/3 of 1F1B's activation memory ((p+4)//3 of p microbatches)."""
    return _generate("v-min", pp, microbatches, costs, (pp + 4) // 3)


@register("v-half")
def v_half(pp: int, microbatches: int, costs: Costs = Costs()) -> Schedule:
    """V-Half: about half of 1F1B's activation memory ((p+2)//2 of p microbatches)."""
    return _generate("v-half", pp, microbatches, costs, (pp + 2) // 2)


@register("v-zb")
def v_zb(pp: int, microbatches: int, costs: Costs = Costs()) -> Schedule:
    """V-ZB: 1F1B's activation memory, almost no bubble."""
    return _generate("v-zb", pp, microbatches, costs, pp)
