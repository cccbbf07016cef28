"""V-shape schedules of the paper: V-ZB, V-Half, V-Min.

Placement `v`: rank r holds stages r and 2p-1-r, so one microbatch's forward runs down the
ranks and back up, and its backward does the same in reverse.  Each schedule keeps to the
paper's memory limit per rank: V-Min (p+4)//3, V-Half (p+2)//2 and V-ZB p microbatches'
worth of 1F1B's activations (two half-size stage-activations per microbatch).

V-Min and V-Half are built the paper's way: a V-shape building block laid out under the
real per-stage costs, repeated, and list-scheduled under the memory cap (blocks.reorder:
squeeze and reorder in one pass).  V-ZB uses the paper's round construction (ZB-V): fill
up with forwards, then one backward and one forward per rank per round, W's kept back to
fill waits.  Which block or variant is best depends on the costs, so each generator builds
its few plans, simulates them and keeps the shortest (deterministically; ties go to the
first plan).  The result is verified before it is returned.
"""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .blocks import EPS, Block, Stuck, reorder
from .errors import ConfigError
from .ops import B, F, W, Costs, Op, Placement, Schedule
from .simulate import one_f_one_b_peak


def _place(busy: List[Tuple[float, float]], ready: float, dur: float, T: float) -> float:
    """Earliest start >= ready where [start, start+dur) misses every busy span modulo T."""
    if T == math.inf:
        return ready
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
    of pp (in peak_vs_1f1b's unit), two half-size stage-activations each."""
    ref = one_f_one_b_peak(pp, microbatches)
    cap = (2 * ref * per_1f1b) // pp
    if cap < 2:  # one microbatch holds both of rank 0's stages at once on its way back
        need = next(k for k in range(1, pp + 1) if 2 * k * per_1f1b >= 2 * pp)
        raise ConfigError(
            f"{name}: microbatches={microbatches} is too few for pp={pp}; its memory limit of "
            f"{per_1f1b}/{pp} of 1F1B cannot hold one microbatch's two chunks; use microbatches >= {need}"
        )
    return [cap] * pp


class Candidate(NamedTuple):
    """A V-shape block for the reorder step to follow, and how that step keeps memory."""

    legal: bool  # offsets placed collision-free modulo the interval (else reorder resolves collisions)
    stretch: float  # interval = 2(F+B+W) * stretch
    turn: float  # v_block's turn, spread and bspread, in units of one stage's F
    spread: float
    bspread: float
    w_lag: float  # W's preferred this many intervals later
    reserve: str  # blocks.reorder's reservation: "ahead" (every skipped F), "rank" (2r+1 on rank r), "safe"


# A plan is ("block", Candidate) or ("rounds", fill_b, fill_f).
Plan = tuple


def preference_block(pp: int, costs: Costs, cand: Candidate) -> Block:
    """The block whose repeated order the reorder step follows for candidate `cand`."""
    legal, stretch, turn, spread, bspread, w_lag, _ = cand
    interval = 2 * (costs.F + costs.B + costs.W) * stretch
    block = v_block(pp, costs, interval if legal else math.inf, turn * costs.F, spread * costs.F, bspread * costs.F)
    start = {k: t + (w_lag * interval if k[0] == W else 0.0) for k, t in block.start.items()}
    return Block(block.placement, costs, interval, start)


def _build(name: str, plan: Plan, pp: int, m: int, costs: Costs, caps: Sequence[int]) -> Schedule:
    """One candidate schedule with its makespan in meta; raises Stuck or _Fail if it cannot."""
    if plan[0] == "rounds":
        return zb_v(name, pp, m, costs, caps[0], plan[1], plan[2])
    cand = plan[1]
    block = preference_block(pp, costs, cand)
    reserve = [2 * r + 1 for r in range(pp)] if cand.reserve == "rank" else None
    s = reorder(block, m, caps, name, reserve=reserve, safe=cand.reserve == "safe")
    s.meta["candidate"] = cand
    return s


# Candidates are compared on at most this many ops per rank; for longer runs the winner is
# then built once at full length (the steady state repeats, so the ranking carries over).
SELECT_OPS_PER_RANK = 6 * 48


def legacy_search(name: str, pp: int, m: int, costs: Costs, caps_of, plans: Sequence[Plan]) -> Schedule:
    """The best of `plans` under integer caps (`caps_of(m)`), unverified; search.py keeps it
    among its candidates."""
    per_stage = costs.per_stage(2)
    m_sel = min(m, max(2 * pp + 2, SELECT_OPS_PER_RANK // 6))
    scored = []
    for i, plan in enumerate(plans):
        try:
            s = _build(name, plan, pp, m_sel, per_stage, caps_of(m_sel))
        except (Stuck, _Fail, ValueError):
            continue
        scored.append((s.meta["makespan"], i, plan, s))
    scored.sort(key=lambda x: x[:2])
    for _, _, plan, s in scored:
        if m_sel == m:
            return s
        try:
            return _build(name, plan, pp, m, per_stage, caps_of(m))
        except (Stuck, _Fail, ValueError):
            continue
    # Few microbatches under a tight cap: start a microbatch on a rank only with memory kept
    # for the second chunk of every microbatch it has started, which can never get stuck.
    return _build(name, ("block", SAFE), pp, m, per_stage, caps_of(m))


# The plans each schedule compares: over pp 4..16, m 2p..8p and three cost sets, each of
# these was the best somewhere (V-Min: the first at equal costs, the second when B > F,
# the third at larger pp, the fourth at pp=16 under unequal costs: at m=128 it cuts the
# makespan vs 1F1B from 1.25x to 1.22x at 2,2.2,1.6,0.05 and from 1.38x to 1.21x at
# 2,2,2,0.25; V-Half: the first reaches the paper's bubble at equal costs).
PLANS: Dict[str, List[Plan]] = {
    "v-min": [("block", Candidate(False, 1.0, 0, 0, 2, 3, "rank")), ("block", Candidate(False, 1.05, 2, 1, 0, 0.5, "ahead")),
              ("block", Candidate(False, 1.05, 2, 0, 0, 0.5, "rank")), ("block", Candidate(False, 1.15, 0, 0, 0, 0.5, "ahead"))],
    "v-half": [("block", Candidate(True, 1.0, 4, 1, 2, 3, "ahead")), ("block", Candidate(False, 1.0, 0, 1, 1, 0.5, "ahead"))],
    "v-zb": [("rounds", True, True), ("rounds", True, False)],
}
SAFE = Candidate(False, 1.0, 0, 0, 0, 0, "safe")


class _Rounds:
    """V-ZB's construction (ZB-V, the strategy of the paper's released code, written anew).

    Warm-up: rank r runs chunk-0 forwards while 2 + 2r stage-activations stay free for the
    returning chunk-1 forwards and the first of those has not arrived yet; then ranks catch
    up on forwards so each holds as many as its left neighbour.  Then 2m rounds: every rank
    runs one backward (the one whose input is there, chunk 1 first) and one forward.  A W is
    run before an op when it fits entirely before that op's input arrives, when waiting
    would push this rank's idle time past the worst rank's, or when memory is needed.
    Times are computed as ops are placed (the simulator's rules), so choices see real costs.
    """

    def __init__(self, pp: int, m: int, costs: Costs, cap: int, fill_b: bool, fill_f: bool):
        self.pp, self.m, self.c, self.cap = pp, m, costs, cap
        self.placement = Placement("v", pp, 2)
        self.stages = [self.placement.stages_of(r) for r in range(pp)]  # looked up for every op
        self.fill_b, self.fill_f = fill_b, fill_f
        self.end: Dict[Tuple[str, int, int], float] = {}
        self.cur = [0.0] * pp
        self.mem = [0] * pp
        self.idle = [0.0] * pp
        self.count = [{(F, 0): 0, (F, 1): 0, (B, 0): 0, (B, 1): 0} for _ in range(pp)]
        self.wq: List[List[Tuple[int, int]]] = [[] for _ in range(pp)]
        self.ranks: List[List[Op]] = [[] for _ in range(pp)]

    def stage(self, r: int, chunk: int) -> int:
        return self.stages[r][chunk]

    def source(self, kind: str, r: int, chunk: int, mb: int) -> Optional[Tuple[Tuple[str, int, int], float]]:
        """(key of the op whose output this op needs from a neighbouring stage, hop cost)."""
        s, S = self.stage(r, chunk), 2 * self.pp
        src = s - 1 if kind == F else s + 1
        if not 0 <= src < S:
            return None
        hop = 0.0 if self.placement.rank_of(src) == r else self.c.C  # the V's turn is local
        return (kind, mb, src), hop

    def arrival(self, kind: str, r: int, chunk: int) -> Optional[float]:
        """When the next such op's input arrives, if its producer is placed (None if it needs none)."""
        mb = self.count[r][(kind, chunk)]
        src = self.source(kind, r, chunk, mb)
        if src is None:
            return None
        e = self.end.get(src[0])
        return math.inf if e is None else e + src[1]

    def put(self, r: int, kind: str, chunk: int = 0, mb: int = -1, stage: int = -1) -> None:
        if kind != W:
            mb = self.count[r][(kind, chunk)]
            stage = self.stage(r, chunk)
            if mb >= self.m:
                raise _Fail(f"{kind} of chunk {chunk} on rank {r} beyond microbatch {self.m - 1}")
        start = self.cur[r]
        if kind != W:
            src = self.source(kind, r, chunk, mb)
            if src is not None:
                if src[0] not in self.end:
                    raise _Fail(f"{kind}{mb}@{stage} placed before its input")
                start = max(start, self.end[src[0]] + src[1])
            if kind == B and (F, mb, stage) not in self.end:
                raise _Fail(f"B{mb}@{stage} before its F")
        cost = self.c.of(kind)
        if self.ranks[r]:  # a rank's late start is the pipeline's fill, not its own idle time
            self.idle[r] += start - self.cur[r]
        self.cur[r] = start + cost
        self.end[(kind, mb, stage)] = start + cost
        self.ranks[r].append(Op(kind, mb, stage))
        if kind == F:
            self.mem[r] += 1
            if self.mem[r] > self.cap:
                raise _Fail(f"rank {r} over its memory cap {self.cap}")
        elif kind == W:
            self.mem[r] -= 1
        else:
            self.wq[r].append((mb, stage))
        if kind != W:
            self.count[r][(kind, chunk)] += 1

    def put_w(self, r: int) -> None:
        mb, stage = self.wq[r].pop(0)
        self.put(r, W, mb=mb, stage=stage)

    def budget(self, r: int) -> float:
        """How much more this rank may idle before it exceeds the worst rank so far."""
        return max(self.idle) - self.idle[r]

    def before(self, r: int, kind: str, chunk: int, fill: bool) -> None:
        """Fill the wait for this op's input with W's; give up a W rather than idle past the budget."""
        arrive = self.arrival(kind, r, chunk)
        if arrive is None:
            return
        while self.wq[r] and arrive >= self.cur[r] + self.c.W:
            self.put_w(r)
        if self.wq[r] and arrive - self.cur[r] > self.budget(r) and fill:
            self.put_w(r)

    def build(self) -> List[List[Op]]:
        pp, m, cap = self.pp, self.m, self.cap
        cnt = self.count
        for r in range(pp):
            self.put(r, F, 0)
        for r in range(pp - 1, -1, -1):
            if r < pp - 1:
                back = self.end[(F, 0, 2 * pp - 2 - r)] + self.c.C
                while (self.mem[r] + 2 + 2 * r <= cap and self.cur[r] + self.c.F <= back
                       and cnt[r][(F, 0)] < m - r):
                    for q in range(r + 1):
                        self.put(q, F, 0)
            self.put(r, F, 1)
        chunk = 0
        for r in range(1, pp):
            def behind() -> bool:
                mine, prev = cnt[r][(F, 0)] + cnt[r][(F, 1)], cnt[r - 1][(F, 0)] + cnt[r - 1][(F, 1)]
                return mine < prev or cnt[r][(F, 1)] <= cnt[r - 1][(F, 1)] < m
            while behind():
                for q in range(pp - 1, r - 1, -1):
                    if cnt[q][(F, chunk)] < m:
                        self.put(q, F, chunk)
                chunk = 1 - chunk
        for _ in range(2 * m):
            late, early = [], []  # ranks whose next backward is chunk 0 / chunk 1
            for r in range(pp):
                if cnt[r][(B, 0)] >= cnt[r][(B, 1)]:
                    early.append(r)
                elif r == pp - 1 or cnt[r][(B, 1)] >= m or self.arrival(B, r, 0) < math.inf:
                    late.append(r)
                else:
                    early.append(r)
            for r, ch in [(r, 0) for r in reversed(late)] + [(r, 1) for r in early]:
                if cnt[r][(B, ch)] >= m:
                    continue
                self.before(r, B, ch, self.fill_b or ch == 0)
                self.put(r, B, ch)
            for r in range(pp):
                if cnt[r][(F, 1)] >= m:
                    continue
                ch = None
                if cnt[r][(F, 1)] >= cnt[r][(F, 0)]:
                    ch = 0
                elif r == pp - 1 or self.arrival(F, r, 1) < math.inf:
                    ch = 1
                elif cnt[r][(F, 0)] < m and (r == 0 or self.arrival(F, r, 0) < math.inf):
                    ch = 0
                if ch is None:
                    continue
                while self.mem[r] + 1 > cap:
                    if not self.wq[r]:
                        raise _Fail(f"rank {r} needs memory but has no W to run")
                    self.put_w(r)
                self.before(r, F, ch, self.fill_f)
                self.put(r, F, ch)
        for r in range(pp):
            while self.wq[r]:
                self.put_w(r)
        return self.ranks


class _Fail(Exception):
    """A construction choice that does not work for these sizes; another candidate will."""


def zb_v(name: str, pp: int, m: int, costs: Costs, cap: int, fill_b: bool, fill_f: bool) -> Schedule:
    """The round construction as a schedule, its makespan in meta."""
    r = _Rounds(pp, m, costs, cap, fill_b, fill_f)
    r.build()
    return Schedule(name, r.placement, m, costs, r.ranks, {"makespan": max(r.cur), "candidate": ("rounds", fill_b, fill_f)})
