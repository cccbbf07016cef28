"""The paper's repeat-squeeze-reorder framework (planner/reorder.py): legal orders under the
cap, the squeeze's rule, the long-run splice, and the released scheduler's figures.

The figures are those of `v_auto_schedule.schedule` in sail-sg/zero-bubble-pipeline-parallelism
at that point, replayed in this project's simulator (`scripts/bench/vs_official.py --points
PP:M:CAP --costs C`): the released scheduler runs this framework on every block and keeps one,
so the best block here must give its makespan."""
import pytest

from megatron_vshape.planner import reorder, search, slots
from megatron_vshape.planner.problem import Problem
from megatron_vshape.schedule.ops import Costs, stage_table
from megatron_vshape.schedule.verify import verify


def problem(pp, m, cap, costs):
    c = Costs.parse(costs).per_stage(2)
    return Problem(pp, m, c, stage_table(c, 2 * pp, None), cap)


def blocks(P):
    return [b for _, b in search._fitting_blocks(P)]


@pytest.mark.parametrize("pp, m, cap, costs, official", [
    (10, 23, 18, "2,2.2,1.6,0.05", 148.15),  # m >= 2p: the warm-up, cool-down and fill
    (6, 9, 8, "1,1,1,0", 32.5),  # m < 2p: built on 2p microbatches and cut to m
    (8, 8, 10, "2,2,2,0.25", 75.5),  # m <= p with memory to spare: the warm-up's W's released
])
def test_the_best_block_gives_the_released_schedulers_figure(pp, m, cap, costs, official):
    P = problem(pp, m, cap, costs)
    got = [reorder.framework(b, m, cap) for b in blocks(P)]
    scores = [P.evaluate(o)[0] for o in got if o is not None]
    assert len(scores) >= len(got) // 2
    assert min(scores) == pytest.approx(official, abs=1e-9)


@pytest.mark.parametrize("pp, m, cap", [(4, 12, 6), (6, 9, 8), (5, 30, 10), (8, 20, 13)])
def test_every_order_is_legal_and_within_the_cap(pp, m, cap):
    P = problem(pp, m, cap, "2,2.2,1.6,0.05")
    built = 0
    for block in blocks(P):
        order = reorder.framework(block, m, cap)
        if order is None:
            continue
        built += 1
        assert sorted(o for row in order for o in row) == list(range(P.n))
        assert P.evaluate(order) is not None and P.fits(order)
        verify(P.schedule("v-auto", order, cap / (2 * pp), None, {}))
    assert built


def test_squeeze_puts_every_pass_at_its_earliest_slot_in_its_ranks_order():
    P = problem(6, 14, 9, "1,1,1,0")
    for block in blocks(P)[:6]:
        grid = reorder.repeated(block, 14)
        got = reorder.squeeze(grid)
        inputs = reorder._inputs(6)
        done = [[[] for _ in range(6)] for _ in range(6)]
        for r in range(6):
            assert [k for k in got[r] if k != reorder.EMPTY] == [k for k in grid[r] if k != reorder.EMPTY]
        for t in range(len(got[0])):  # slot by slot: every input ran in an earlier slot
            for r, row in enumerate(got):
                if row[t] != reorder.EMPTY:
                    done[r][row[t]].append(t)
        for r, row in enumerate(got):
            prev = -1
            for t, kind in enumerate(row):
                if kind == reorder.EMPTY:
                    continue
                mb, src = done[r][kind].index(t), inputs[r][kind]
                earliest = prev + 1
                if src is not None and src[0] != r:
                    earliest = max(earliest, done[src[0]][src[1]][mb] + 1)
                elif src is not None:
                    assert done[r][src[1]][mb] < t
                assert t == earliest
                prev = t


def test_a_long_run_repeats_the_steady_period_of_a_shorter_one_exactly():
    # Built on `short` microbatches and spliced: the same orders as built whole, for less work.
    P = problem(6, 40, 9, "2,2,2,0.25")
    spliced = 0
    for block in blocks(P)[:8]:
        short = max(12, slots.small_m(block)) + 4
        whole = reorder.framework(block, 40, 9)
        assert reorder.framework(block, 40, 9, short) == whole
        spliced += whole is not None and reorder._periodic_cut(reorder._grid(block, short, 9)) is not None
    assert spliced


@pytest.mark.parametrize("pp, m, cap, official", [(10, 23, 18, 148.15), (15, 56, 14, 428.2), (5, 12, 8, 78.2)])
def test_v_auto_is_no_longer_than_the_released_scheduler_where_it_lost(pp, m, cap, official):
    # The points v-auto lost before it took the reordered blocks as starts (148.4, 428.5:
    # its squeezed blocks' warm-up and cool-down left more bubble than these shapes; 78.3 at
    # pp=5, m=12, a short run of 360 ops, where it took them on long runs only).  Which start
    # wins may change as starts are added (at pp=15, m=56 the second-best improved start,
    # justified, now ends at 421); the bound is the released scheduler's.
    P = problem(pp, m, cap, "2,2.2,1.6,0.05")
    search._plan.cache_clear()
    order, how = search._plan("v-auto", pp, m, P.costs, P.table, cap / (2 * pp))
    assert P.evaluate([list(o) for o in order])[0] <= official + 1e-9
