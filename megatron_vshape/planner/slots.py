"""Repeat and squeeze a V-shape building block on a grid of unit slots.

The paper's framework (Section 3 and its Appendix) builds a schedule by repeating a block,
squeezing out the empty slots of the warm-up and cool-down, and reordering.  Here a block
gives, for every rank of the V, the slots of microbatch 0's four passes (chunk-0 F, chunk-1 F,
chunk-1 B, chunk-0 B) in a period of 6 slots; copy k sits 6k slots later and each W takes the
first slot after its B that the period leaves free.  Squeezing then moves every op of the
warm-up and the cool-down to the earliest free slot its inputs allow (one op per slot, hops
free, the turn on rank p-1 too), never past the memory cap; the steady phase between keeps the
block's order, which is what makes it bubble-free.  A second pass squeezes the cool-down again
with every W lifted out and put back into the first free slots, since W's left in the
cool-down block the B's the previous rank waits for.

Slots only fix an order per rank: the search times that order with the real costs and
improves it.  Op ids are problem.Problem's integers.
"""
from __future__ import annotations

from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

from ..schedule.blocks import EPS

PERIOD = 6  # slots per microbatch and rank: F, F, B, B, W, W
Block = Sequence[Tuple[int, int, int, int]]  # per rank: slots of chunk-0 F, chunk-1 F, chunk-1 B, chunk-0 B


def paper_pattern(pp: int, kind: str) -> Block:
    """The paper's V-Min ("min") or V-Half ("half") block (its Appendix), in slots."""
    p = pp
    if kind == "min":
        gap = 2 if p % 3 == 0 else 0
        return [(i, 2 * p - i - 1, 2 * p + gap + i, 4 * p + gap - i - 1) for i in range(p)]
    gap = 3 if p % 2 == 0 else 0
    return [(2 * i, 3 * p - i - 2, 3 * p + gap + 2 * i - 1, 6 * p + gap - i - 2) for i in range(p)]


def uniform_blocks(pp: int) -> List[Tuple[Tuple[int, int, int, int], ...]]:
    """The V-shape blocks of the paper's uniform offsets (its Section 3.1): rank 0's four
    passes at any distinct residues of the period (its chunk-0 F at 0); going up the V each
    chunk-0 F and chunk-1 B comes d slots after the rank below (d from 1 to 5, switching once
    from d to a smaller d' part way up), each chunk-1 F and chunk-0 B one slot before the
    rank above; every pass as early as its input allows.  Distinct blocks only."""
    p, seen, out = pp, set(), []

    def after(t: int, residue: int) -> int:  # first slot > t with this residue
        return t + 1 + (residue - t - 1) % PERIOD

    for f1, b1, b0 in ((a, b, c) for a in range(1, 6) for b in range(1, 6) for c in range(1, 6) if len({a, b, c}) == 3):
        clash = (0, PERIOD - b1)
        for d in range(1, PERIOD):
            for d2 in range(1, d + 1):
                for switch in range(1, p if d2 < d else 2):
                    step = [d if i < switch else d2 for i in range(p - 1)]
                    f0s = [0]
                    for x in step:
                        f0s.append(f0s[-1] + x)
                    # Rank i's residues: chunk-0 F c, chunk-1 B b1 + c, chunk-1 F f1 - i,
                    # chunk-0 B b0 - i (c its F's offset): all four must differ.
                    if any((c - f1 + i) % PERIOD in clash or (c - b0 + i) % PERIOD in clash for i, c in enumerate(f0s)):
                        continue
                    top_f1 = after(f0s[-1], (f1 - (p - 1)) % PERIOD)
                    f1s = [top_f1 + (p - 1 - i) for i in range(p)]
                    b1s = [after(f1s[0], b1)]
                    for x in step:
                        b1s.append(b1s[-1] + x)
                    top_b0 = after(b1s[-1], (b0 - (p - 1)) % PERIOD)
                    b0s = [top_b0 + (p - 1 - i) for i in range(p)]
                    block = tuple(zip(f0s, f1s, b1s, b0s))
                    if block not in seen:
                        seen.add(block)
                        out.append(block)
    return out


def steady_peak(P, block: Block) -> float:
    """The most weighted activations any rank holds once `block` repeats without end: a
    stage's copies live from their F's slot through their W's, so at a slot of residue u a
    stage living L slots from slot f holds L // 6 copies, one more where (u - f) % 6 < L % 6."""
    top = 0.0
    for r, (f0, f1, b1, b0) in enumerate(block):
        w1, w0 = w_slots(block[r])
        (q1, e1), (q0, e0) = divmod(w1 - f1 + 1, PERIOD), divmod(w0 - f0 + 1, PERIOD)
        z1, z0 = P.size[P.S - 1 - r], P.size[r]
        for u in range(PERIOD):
            top = max(top, z1 * (q1 + ((u - f1) % PERIOD < e1)) + z0 * (q0 + ((u - f0) % PERIOD < e0)))
    return top


def steady_period(P, block: Block) -> float:
    """The time one more microbatch adds once `block` repeats, under P's real costs: the eager
    run of the repeated order (not squeezed), from microbatch m/3 to 2m/3, at rank 0's last op
    of each (inf if the order deadlocks; 0 with too few microbatches to tell).  Slot lengths
    count every pass as one slot: with unequal F, B and W the shortest blocks can leave a
    bubble in every period that a longer one avoids."""
    at = repeat(P, block)
    k1, k2 = P.m // 3, 2 * P.m // 3
    if at is None or k2 <= k1:
        return 0.0
    end = P.blank()
    if P.run(orders(P, at), float("inf"), end, [0] * P.pp, [0.0] * P.pp) is None:
        return float("inf")
    return (end[3 * k2 * P.S + 1] - end[3 * k1 * P.S + 1]) / (k2 - k1)


def _w_after(b: int, taken: set) -> int:
    w = next(b + k for k in range(1, PERIOD + 1) if (b + k) % PERIOD not in taken)
    taken.add(w % PERIOD)
    return w


def w_slots(row: Tuple[int, int, int, int]) -> Tuple[int, int]:
    """The slots of a block row's chunk-1 and chunk-0 W's: each the first slot after its B
    whose residue no pass of the row has taken (chunk 1's first)."""
    _, _, b1, b0 = row
    taken = {x % PERIOD for x in row}
    return _w_after(b1, taken), _w_after(b0, taken)


def repeat(P, block: Block, check: bool = True) -> Optional[List[int]]:
    """The slot of every op when `block` repeats every PERIOD slots, or None when the block
    is not legal (two passes of a rank share a slot residue, or an op precedes its input)."""
    S, m = P.S, P.m
    at = [0] * (3 * m * S)
    for r, (f0, f1, b1, b0) in enumerate(block):
        if len({x % PERIOD for x in (f0, f1, b1, b0)}) != 4:
            return None
        w1, w0 = w_slots((f0, f1, b1, b0))
        s0, s1 = r, S - 1 - r
        for k in range(m):
            d = PERIOD * k
            for s, f, b, w in ((s0, f0, b0, w0), (s1, f1, b1, w1)):
                o = 3 * (k * S + s)
                at[o], at[o + 1], at[o + 2] = f + d, b + d, w + d
    if check and any(at[o] < lo for o in range(len(at)) for lo in _inputs(P, at, o)):
        return None
    return at


def _inputs(P, at: List[int], o: int) -> List[int]:
    """Earliest slots `o` may take: one after each input, and after the same pass of the
    previous microbatch (passes of a stage keep microbatch order)."""
    S, slot, s = P.S, o % 3, (o // 3) % P.S
    out = []
    if slot == 0:
        if s:
            out.append(at[o - 3] + 1)
    else:
        out.append(at[o - 1] + 1)
        if slot == 1 and s < S - 1:
            out.append(at[o + 3] + 1)
    if o >= 3 * S:
        out.append(at[o - 3 * S] + 1)
    return out


class _Grid:
    """Who holds each slot of each rank, and the weighted activations alive in it."""

    def __init__(self, P, at: List[int], with_w: bool = True):
        self.P, self.at = P, at
        n = max(at) + 2 * PERIOD * P.pp + 2
        self.occ = [[-1] * n for _ in range(P.pp)]
        self.live = [[0.0] * n for _ in range(P.pp)]
        for o, t in enumerate(at):
            r, slot = P.rank[(o // 3) % P.S], o % 3
            if with_w or slot != 2:
                self.occ[r][t] = o
            if slot == 0:  # alive from its F's slot through its W's: a difference array
                size = P.size[(o // 3) % P.S]
                self.live[r][t] += size
                self.live[r][at[o + 2] + 1] -= size
        self.live = [list(accumulate(row)) for row in self.live]

    def move_earlier(self, o: int, lo: int, cap: float) -> None:
        """Take the earliest free slot in [lo, now) that keeps the rank within `cap`."""
        P, at = self.P, self.at
        s, slot = (o // 3) % P.S, o % 3
        r, old = P.rank[s], at[o]
        occ, live, size = self.occ[r], self.live[r], P.size[s]
        if slot == 0:  # downwards, while the F's activation fits in every slot it would add to
            best, top, over = old, 0.0, cap + EPS
            for t in range(old - 1, lo - 1, -1):
                if live[t] > top:
                    top = live[t]
                if top + size > over:
                    break
                if occ[t] < 0:
                    best = t
        else:
            best = next((t for t in range(lo, old) if occ[t] < 0), old)
        if best == old:
            return
        if occ[old] == o:
            occ[old] = -1
        occ[best] = o
        at[o] = best
        if slot == 0:
            for u in range(best, old):
                live[u] += size
        elif slot == 2:
            for u in range(best + 1, old + 1):
                live[u] -= size

    def squeeze(self, which, cap: float) -> None:
        """Move the ops `which(o)` selects earliest first, each as early as it may go."""
        P, at = self.P, self.at
        op_rank = P.op_rank
        for o in sorted(range(len(at)), key=lambda o: (at[o], op_rank[o])):
            if which(o):
                self.move_earlier(o, max(_inputs(P, at, o), default=0), cap)

    def put_ws(self) -> None:
        """Each rank's W's, in the order of their B's, into the first free slots after them."""
        P, at = self.P, self.at
        for r in range(P.pp):
            occ = self.occ[r]
            ws = sorted((o for o in range(2, len(at), 3) if P.rank[(o // 3) % P.S] == r), key=lambda o: at[o - 1])
            t = 0
            for o in ws:
                t = max(t, at[o - 1] + 1)
                while occ[t] >= 0:
                    t += 1
                occ[t] = o
                at[o] = t


def orders(P, at: Sequence[int]) -> List[List[int]]:
    """Each rank's ops in slot order."""
    out: List[List[int]] = [[] for _ in range(P.pp)]
    op_rank = P.op_rank
    for o in sorted(range(len(at)), key=at.__getitem__):
        out[op_rank[o]].append(o)
    return out


class _LazyW:
    """One rank's F's and B's by slot with its W's left out: each W runs in the first empty
    slot after its B, in the order of the B's.  Keeps the state (live activations, W's
    waiting) before every slot, so trying a move re-runs only the slots after it.  `row`: the
    op in each slot (-1: none), W's left out."""

    def __init__(self, P, row: List[int]):
        self.P, self.row = P, row
        self.state: List[Tuple[float, Tuple[float, ...]]] = [(0.0, ())] * (len(row) + 1)
        self.rerun(0)

    def rerun(self, start: int, cap: float = float("inf"), until: int = -1) -> float:
        """Recompute the states from `start`; the peak from there (stops early past `cap`, or
        once past `until` the state is the one stored, since all after it is unchanged)."""
        size, S, row, state = self.P.size, self.P.S, self.row, self.state
        live, queue = state[start]
        queue, head, top = list(queue), 0, live
        for t in range(start, len(row)):
            now = (live, tuple(queue[head:]))
            if t > until >= 0 and now == state[t]:
                return top
            state[t] = now
            o = row[t]
            if o < 0:
                if head < len(queue):
                    live -= queue[head]
                    head += 1
            elif o % 3 == 0:
                live += size[(o // 3) % S]
                if live > top:
                    top = live
                    if top > cap + EPS:
                        return top
            else:
                queue.append(size[(o // 3) % S])
        return top

    def try_move(self, o: int, old: int, new: int, cap: float) -> bool:
        row = self.row
        row[old], row[new] = -1, o
        if self.rerun(new, cap, old) <= cap + EPS:
            return True
        row[old], row[new] = o, -1
        self.rerun(new, until=old)
        return False


def _squeeze_cooldown(P, at: List[int], after: int) -> None:
    """Second pass: with the W's lifted out (run lazily in empty slots), move every F and B
    past slot `after` to its earliest free slot that keeps the rank within the cap; then
    put the W's back where they run."""
    n = max(at) + 2 * PERIOD * P.pp + 2
    rows = [[-1] * n for _ in range(P.pp)]
    for o, t in enumerate(at):  # one pass over the ops for every rank's row
        if o % 3 != 2:
            rows[P.op_rank[o]][t] = o
    lazy = [_LazyW(P, row) for row in rows]
    ops = sorted((o for o in range(len(at)) if o % 3 != 2 and at[o] > after),
                 key=lambda o: (at[o], P.rank[(o // 3) % P.S]))
    for o in ops:
        lane, old = lazy[P.rank[(o // 3) % P.S]], at[o]
        for t in range(max(_inputs(P, at, o)), old):
            if lane.row[t] < 0 and lane.try_move(o, old, t, P.cap):
                at[o] = t
                break
    grid = _Grid(P, at, with_w=False)
    grid.put_ws()


# Which ops the first pass moves: those of the warm-up and cool-down only (the paper's rule:
# the steady phase is already bubble-free), or every op (a cap above the block's peak then
# pulls forwards into the warm-up).
MODES = ("steady", "all")


def squeeze_block(P, block: Block, modes: Sequence[str] = MODES) -> List[Tuple[List[int], bool, str]]:
    """Slots of every op after each mode's first pass and its second (when within the cap),
    each with whether its W's were put back lazily (the second pass) and how it was made."""
    was = repeat(P, block)
    if was is None or max(max(row) for row in _Grid(P, was).live) > P.cap + EPS:
        return []
    first_b, last_f = was[1], was[3 * (P.m - 1) * P.S]  # rank 0's first chunk-0 B, its last chunk-0 F
    edge = lambda o: was[o] < first_b or was[o] > last_f  # noqa: E731
    out = []
    for mode in modes:
        at = list(was)
        grid = _Grid(P, at)
        grid.squeeze(edge if mode == "steady" else (lambda o: True), P.cap)
        out.append((list(at), False, f"{mode}, pass 1"))
        _squeeze_cooldown(P, at, last_f)
        if P.fits(orders(P, at)):
            out.append((at, True, f"{mode}, pass 2"))
    return out


def _stretch(P, Q, base: List[int], at_q: List[int], lazy_w: bool, cut: int) -> Optional[List[int]]:
    """P's slots from Q's (the same block with fewer microbatches): before `cut` as in Q,
    the extra microbatches' periods of the steady phase as repeated, the rest as Q's
    shifted by them (W's put back lazily again where Q's were).  None when Q's squeeze
    touched the steady phase near the cut."""
    S3, extra = 3 * P.S, P.m - Q.m
    shift = PERIOD * extra
    near = range(cut - 2 * PERIOD, cut + 2 * PERIOD)
    if any(base[o] != at_q[o] for o in range(len(at_q)) if base[o] in near and not (lazy_w and o % 3 == 2)):
        return None
    at = list(base)
    for o, b in enumerate(base):
        if b < cut:
            at[o] = at_q[o]
        elif b >= cut + shift:
            at[o] = at_q[o - S3 * extra] + shift
    if lazy_w:
        _Grid(P, at, with_w=False).put_ws()
    return at


def small_m(block: Block) -> int:
    """Microbatches enough to squeeze this block: its warm-up, a steady stretch, its cool-down."""
    return (_cut(block) + 4 * PERIOD) // PERIOD + 2


def _cut(block: Block) -> int:
    """A period boundary past every op of microbatch 0 (W's included): where to splice."""
    return PERIOD * ((max(max(r) for r in block) + 2 * PERIOD) // PERIOD + 1)


def stretched(P, Q, block: Block, at_q: List[int], lazy_w: bool) -> Optional[List[List[int]]]:
    """P's order from Q's squeeze of `block` (Q: the same problem with m >= small_m(block),
    fewer microbatches than P): only the warm-up and cool-down move, so the extra
    microbatches' steady periods are spliced in unchanged.  None when Q's squeeze also
    reshuffled the steady phase (not periodic: it does not carry over)."""
    if Q.m == P.m:
        return orders(P, at_q)
    at = _stretch(P, Q, repeat(P, block, check=False), at_q, lazy_w, _cut(block))
    if at is None:
        return None
    order = orders(P, at)
    return order if P.fits(order) and P.evaluate(order) is not None else None


def squeezed(P, block: Block) -> List[List[List[int]]]:
    """Orders from repeating `block` and squeezing it, for every mode, after the first pass
    and after the second (squeezed on small_m microbatches, stretched to P's)."""
    Q = P if P.m <= small_m(block) else type(P)(P.pp, small_m(block), P.costs, P.table, P.cap)
    got = (stretched(P, Q, block, at_q, lazy_w) for at_q, lazy_w, _ in squeeze_block(Q, block))
    return [order for order in got if order is not None]
