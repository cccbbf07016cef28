"""The paper's repeat-squeeze-reorder framework for a building block (its Section 3 and
Appendix), as a start for the search.

slots.py squeezes a repeated block by pulling each warm-up and cool-down op to its earliest
free slot.  The paper reorders those phases into fixed shapes instead, which leave fewer
bubbles on long runs: on rank i the warm-up holds min(i+1, peak/2) second-chunk F's and fills
the rest of the peak with first-chunk F's, then alternates B, W, F; the cool-down places
(peak+1)/2 first-chunk B's and min(i+1, the rest) second-chunk B's on alternate slots, as
tight as their dependencies allow, with the W's after them.  Then each empty slot, left to
right, takes the first later op of its rank that may move there (its input done, the peak not
raised).  This is what the paper's released scheduler (v_auto_schedule) runs on each block.
At pp=10, m=23, costs 2,2.2,1.6,0.05, cap 18 the best of the blocks at the cap gives 148.15
(the released scheduler's plan there) where slots.py's squeeze of the same block gives 151.0.

Work is on a grid of unit slots per rank holding passes (below); a pass's microbatch is its
count among the same passes of its rank, as the phases keep each pass in microbatch order.
Only for stages of equal size (the phases' counts are in activations).  Pure Python.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from . import slots

# Passes of a rank: chunk-0 F, chunk-1 F, chunk-1 B, chunk-0 B, chunk-1 W, chunk-0 W.
F0, F1, B1, B0, W1, W0 = range(6)
EMPTY = -1
Grid = List[List[int]]


def repeated(block: slots.Block, m: int) -> Optional[Grid]:
    """The block repeated m times (copy k PERIOD*k slots later), or None if two passes meet."""
    rows = []
    for passes in block:
        at = [*passes, *slots.w_slots(passes)]  # microbatch 0's slots, by pass
        row = [EMPTY] * (max(at) + slots.PERIOD * m + 1)
        for k in range(m):
            for kind, t in enumerate(at):
                if row[t + slots.PERIOD * k] != EMPTY:
                    return None
                row[t + slots.PERIOD * k] = kind
        rows.append(row)
    return rows


def _input(p: int, r: int, kind: int):
    """(rank, pass) whose same microbatch `kind` on rank r waits for (None: rank 0's chunk-0
    F, the V's first pass)."""
    if kind == F0:
        return (r - 1, F0) if r else None
    if kind == F1:
        return (r + 1, F1) if r < p - 1 else (r, F0)
    if kind == B1:
        return (r - 1, B1) if r else (r, F1)
    if kind == B0:
        return (r + 1, B0) if r < p - 1 else (r, B1)
    return r, (B1 if kind == W1 else B0)


def _inputs(p: int):
    """_input of every rank and pass."""
    return [[_input(p, r, kind) for kind in range(6)] for r in range(p)]


def squeeze(grid: Grid) -> Optional[Grid]:
    """Every pass at its earliest slot with each rank's order kept (one pass a slot, an input
    one slot before, a pass on its own rank's input only after it); None on deadlock.  Taken
    slot by slot (the passes that go up the V rank by rank up, the others down), which meets
    every input first when the grid is itself a legal one; else rank by rank as inputs allow."""
    p, lanes = len(grid), 2 * len(grid)
    inputs = _inputs(p)
    keys = []  # slot, then the sweep: up the V for F0, B1, W1, down for the others
    for r, row in enumerate(grid):
        up, down = r, lanes - 1 - r
        for t, kind in enumerate(row):
            if kind != EMPTY:
                keys.append(((t * lanes + (down if kind in (F1, B0, W0) else up)) << 3) | kind)
    keys.sort()
    done = [[[] for _ in range(6)] for _ in range(p)]  # slot of each pass's microbatches so far
    free = [0] * p
    for key in keys:
        kind, lane = key & 7, (key >> 3) % lanes
        r = lane if lane < p else lanes - 1 - lane
        if not _place(done, inputs, free, r, kind):
            return _squeeze_any(grid)
    return _rows(done, max(free))


def _place(done: List[List[List[int]]], inputs, free: List[int], r: int, kind: int) -> bool:
    """The next `kind` pass of rank r at its earliest slot: after the rank's last pass, and
    one slot after its input on another rank (on its own rank, after it); False, placing
    nothing, while that input is not placed yet."""
    mine, src, at = done[r][kind], inputs[r][kind], free[r]
    if src is not None:
        got = done[src[0]][src[1]]
        if len(got) <= len(mine):
            return False
        if src[0] != r:
            at = max(at, got[len(mine)] + 1)
    mine.append(at)
    free[r] = at + 1
    return True


def _rows(done: List[List[List[int]]], width: int) -> Grid:
    """The grid `width` slots wide whose rank r holds pass k at the slots done[r][k]."""
    out = [[EMPTY] * width for _ in done]
    for row, passes in zip(out, done):
        for kind, at in enumerate(passes):
            for t in at:
                row[t] = kind
    return out


def _padded(rows: Grid) -> Grid:
    """Rows of different lengths made as long as the longest, with empty slots."""
    width = max(len(row) for row in rows)
    return [row + [EMPTY] * (width - len(row)) for row in rows]


def _squeeze_any(grid: Grid) -> Optional[Grid]:
    """squeeze() of a grid whose passes may precede their inputs (the cool-down's)."""
    p = len(grid)
    inputs = _inputs(p)
    order = [[k for k in row if k != EMPTY] for row in grid]
    done = [[[] for _ in range(6)] for _ in range(p)]
    pos, free = [0] * p, [0] * p
    left = sum(len(o) for o in order)
    while left:
        moved = False
        for r in range(p):
            while pos[r] < len(order[r]):
                if not _place(done, inputs, free, r, order[r][pos[r]]):
                    break
                pos[r], left, moved = pos[r] + 1, left - 1, True
        if not moved:
            return None
    return _rows(done, max(free))


LIVE = (1, 1, 0, 0, -1, -1, 0)  # live activations a pass adds, by pass (EMPTY last)


def peaks(grid: Grid) -> List[int]:
    """Each rank's most live activations (an F adds one, a W frees one)."""
    out = []
    for row in grid:
        live = top = 0
        for kind in row:
            live += LIVE[kind]
            if live > top:
                top = live
        out.append(top)
    return out


def _put(row: List[int], t: int, kind: int, over: Sequence[int] = ()) -> bool:
    """`kind` into slot t if it is empty (or holds a pass of `over`); False if not."""
    if t < 0:
        return False
    if t >= len(row):
        row.extend([EMPTY] * (t + 1 - len(row)))
    if row[t] != EMPTY and row[t] not in over:
        return False
    row[t] = kind
    return True


def warm_up(grid: Grid, m: int) -> Optional[Grid]:
    """The warm-up (each rank's passes before its first chunk-0 B) laid out anew: first-chunk
    F's from slot r on, one every slot while the V's lower ranks still fill, then F's of both
    chunks in turn (rank r holds min(r+1, peak/2) second-chunk F's before its first B), then
    B, W, F in turn (second-chunk F's first) until the phase's passes are placed."""
    p = len(grid)
    peak = min(max(peaks(grid)), 2 * p)
    out = []
    for r, row in enumerate(grid):
        first_b0 = row.index(B0)
        count = [0] * 6
        for kind in row[:first_b0]:
            if kind != EMPTY:
                count[kind] += 1
        if count[W0] or count[B0]:
            return None
        want_f1 = min(r + 1, peak // 2, m)
        want_f0 = min(peak - want_f1, m)
        new = [EMPTY] * first_b0 + row[first_b0:]
        used = [0] * 6
        t = r

        def place(kind, limit):
            nonlocal t
            if used[kind] < limit and _put(new, t, kind) is False:
                return False
            used[kind] += used[kind] < limit
            t += 1
            return True
        for _ in range(2 * (p - 1 - r)):
            if not place(F0, min(want_f0, count[F0])):
                return None
        for _ in range(r + 1):
            if not (place(F0, min(want_f0, count[F0])) and place(F1, min(want_f1, count[F1]))):
                return None
        while used[:4] != count[:4] or used[W1] != count[W1]:
            third = F1 if used[F1] < count[F1] else F0
            if not (place(B1, count[B1]) and place(W1, count[W1]) and place(third, count[third])):
                return None
        out.append(new)
    return _padded(out)


def drop_extra(grid: Grid, m: int) -> Grid:
    """Only the first m microbatches of every pass (the block was repeated for more)."""
    out = []
    for row in grid:
        seen, new = [0] * 6, []
        for kind in row:
            if kind != EMPTY:
                seen[kind] += 1
                if seen[kind] > m:
                    kind = EMPTY
            new.append(kind)
        out.append(new)
    return out


def release_ws(grid: Grid, peak: int) -> Grid:
    """Few microbatches (m <= p): each rank's earliest W's moved to its end while its peak
    stays under `peak`, so the warm-up uses the memory the block leaves free."""
    out = []
    for row, top in zip(grid, peaks(grid)):
        row, moved = list(row), []
        for t, kind in enumerate(row):
            if top + len(moved) >= peak:
                break
            if kind in (W1, W0):
                moved.append(kind)
                row[t] = EMPTY
        out.append(row + moved)
    return _padded(out)


def cool_down(grid: Grid, m: int) -> Optional[Grid]:
    """The cool-down's last B's laid out anew, as tight as the chain through the ranks allows:
    (peak+1)/2 chunk-0 B's and min(r+1, the rest) chunk-1 B's on each rank r, on alternate
    slots counted from rank 0's last second-chunk F; the W's at the end taken out and put
    back into the first empty slots after the last W kept, each the W of the chunk whose B's
    are owed one (chunk 1 first)."""
    p = len(grid)
    peak = max(peaks(grid))
    want_b0 = min((peak + 1) // 2, m)
    want_b1 = min(peak - want_b0, m)
    rows = [list(row) for row in grid]
    start = None
    for r, row in enumerate(rows):
        n1 = n0 = 0
        for t in range(len(row) - 1, -1, -1):
            if row[t] == B1 and n1 < min(r + 1, want_b1):
                row[t], n1 = EMPTY, n1 + 1
            elif row[t] == B0 and n0 < want_b0:
                row[t], n0 = EMPTY, n0 + 1
        w1 = w0 = 0
        for t in range(len(row) - 1, -1, -1):
            if w1 >= n1 and w0 >= n0 and w1 + w0 >= peak:
                break
            if row[t] in (W1, W0):
                w1, w0 = w1 + (row[t] == W1), w0 + (row[t] == W0)
                row[t] = EMPTY
        if start is None:
            start = max(t for t, kind in enumerate(row) if kind == F1)
        if not all(_put(row, start - r + 2 * p - 2 * k, B0) for k in range(n0)):
            return None
        # A W in the way is taken out too: the W's are counted and put back below.
        if not all(_put(row, start + 1 + r - 2 * k, B1, over=(W1, W0)) for k in range(n1)):
            return None
    for row in rows:
        last_w = max((t for t, kind in enumerate(row) if kind in (W1, W0)), default=-1)
        owed = {W1: 0, W0: 0}
        for t in range(len(row)):
            kind = row[t]
            if kind in (B1, B0):
                owed[W1 if kind == B1 else W0] += 1
            elif kind in (W1, W0):
                owed[kind] -= 1
            elif kind == EMPTY and t > last_w:
                for w in (W1, W0):
                    if owed[w] > 0:
                        row[t], owed[w] = w, owed[w] - 1
                        break
        row.extend([W1] * owed[W1] + [W0] * owed[W0])
    return squeeze(rows)


def fill(grid: Grid) -> Grid:
    """Each empty slot, left to right and rank by rank, takes the first later pass of each
    kind on its rank that may run there: its input done in an earlier slot (on another rank)
    or counted before it (on its own), and, for an F, the rank's peak not raised."""
    p = len(grid)
    rows = [list(row) for row in grid]
    width = len(rows[0])
    peak = max(peaks(rows))
    inputs = _inputs(p)
    last = []
    for row in rows:
        at = [-1] * 6
        for t, kind in enumerate(row):
            if kind != EMPTY:
                at[kind] = t
        last.append(at)
    done = [[[] for _ in range(6)] for _ in range(p)]  # slot of each pass's microbatches so far
    live = [0] * p
    for t in range(width):
        for r in range(p):
            row, mine = rows[r], done[r]
            if row[t] == EMPTY:
                kinds = {k for k in range(6) if last[r][k] > t}
                delta = top = 0
                for u in range(t + 1, width):
                    if not kinds:
                        break
                    kind = row[u]
                    before = top
                    delta += LIVE[kind]
                    if delta > top:
                        top = delta
                    if kind not in kinds:
                        continue
                    kinds.discard(kind)
                    if LIVE[kind] > 0 and live[r] + before >= peak:
                        continue
                    mb, src = len(mine[kind]), inputs[r][kind]
                    if src is not None:
                        got = done[src[0]][src[1]]
                        if len(got) <= mb or (src[0] != r and got[mb] >= t):
                            continue
                    row[t], row[u] = kind, EMPTY
                    break
            kind = row[t]
            if kind != EMPTY:
                mine[kind].append(t)
                live[r] += LIVE[kind]
    return rows


def orders(grid: Grid, p: int) -> List[List[int]]:
    """Each rank's ops in slot order, as problem.Problem's op ids; a W's microbatch and chunk
    are those of the oldest B of its rank whose W has not run (the phases may swap which
    chunk's W a slot holds)."""
    S, out = 2 * p, []
    for r, row in enumerate(grid):
        stage = (r, S - 1 - r, S - 1 - r, r)  # of F0, F1, B1, B0
        seen, waiting, ids = [0] * 4, [], []
        for kind in row:
            if kind == EMPTY:
                continue
            if kind >= W1:
                ids.append(waiting.pop(0))
                continue
            o = 3 * (seen[kind] * S + stage[kind]) + (kind >= B1)
            seen[kind] += 1
            if kind >= B1:
                waiting.append(o + 1)
            ids.append(o)
        out.append(ids)
    return out


def _periodic_cut(grid: Grid) -> Optional[int]:
    """A slot in the middle of the steady phase: where every rank has repeated the same
    period for two periods before and after (None if the run has no such stretch)."""
    p, width, P = len(grid), len(grid[0]), slots.PERIOD
    ok = [all(row[t] == row[t + P] for row in grid) for t in range(width - P)]
    run, cuts = 0, []
    for t, same in enumerate(ok):
        run = run + 1 if same else 0
        if run >= 4 * P:
            cuts.append(t - 2 * P + 1)
    if not cuts:
        return None
    cut = cuts[len(cuts) // 2]
    return cut if all(sorted(row[cut:cut + P]) == list(range(6)) for row in grid) else None


def framework(block: slots.Block, m: int, cap: int, short: Optional[int] = None) -> Optional[List[List[int]]]:
    """The block repeated, squeezed and reordered (warm-up, cool-down, then empty slots
    filled), as each rank's op ids (problem.Problem's); None where the block does not fit `cap` activations or a
    phase's shape does not fit its slots.  Built on max(m, 2p) microbatches (the warm-up's
    shape needs 2p) and cut to m.  With `short` (>= 2p) and m beyond it, built on `short`
    microbatches and the steady phase's period repeated for the rest (the phases are where
    the steps change anything: the steady phase has no empty slot)."""
    p = len(block)
    if short is not None and m > short >= 2 * p:
        grid = _grid(block, short, cap)
        cut = None if grid is None else _periodic_cut(grid)
        if cut is not None:
            period = [row[cut:cut + slots.PERIOD] for row in grid]
            return orders([row[:cut] + run * (m - short) + row[cut:] for row, run in zip(grid, period)], p)
    grid = _grid(block, m, cap)
    return None if grid is None else orders(grid, p)


def _grid(block: slots.Block, m: int, cap: int) -> Optional[Grid]:
    """framework()'s grid."""
    p = len(block)
    cap = min(cap, 2 * p)
    big = max(m, 2 * p)
    grid = repeated(block, big)
    if grid is None:
        return None
    start = max(peaks(grid))
    if (big == m and start > cap) or start > 2 * p:
        return None
    grid = squeeze(grid)
    grid = grid and warm_up(grid, big)
    grid = grid and squeeze(grid)
    peak = None if grid is None else max(peaks(grid))
    if peak is None or peak > start:
        return None
    if m < big:
        grid = drop_extra(grid, m)
        if m <= p and 2 * m <= cap:
            grid = release_ws(grid, min(2 * p, peak))
        grid = squeeze(grid)
        start = None if grid is None else max(peaks(grid))
        if start is None or start > cap:
            return None
    grid = cool_down(grid, m)
    if grid is None:
        return None
    grid = fill(grid)
    return None if max(peaks(grid)) > start else grid
