"""The building-block framework: legality, the lifespan/interval peak relation against the
simulator, and the repeat -> squeeze -> reorder steps."""
import math

import pytest

from megatron_vshape.schedule.blocks import (
    Block,
    Stuck,
    peak_from_lifespan,
    repeat,
    reorder,
    squeeze,
)
from megatron_vshape.schedule.ops import BW, B, F, W, Costs, Op, Placement
from megatron_vshape.schedule.simulate import peak_activations, simulate
from megatron_vshape.schedule.verify import verify
from megatron_vshape.schedule.vshape import _place, v_block


def one_f_one_b_block(p: int) -> Block:
    """1F1B's block: the forward runs down the stages, the combined backward comes straight
    back; with F = 1 and BW = 1 copies every 2 units never collide."""
    costs = Costs(1.0, 0.5, 0.5, 0.0)
    start = {(F, s): float(s) for s in range(p)}
    start.update({(BW, s): float(2 * p - 1 - s) for s in range(p)})
    return Block(Placement("single", p), costs, 2.0, start)


def zb_block(p: int) -> Block:
    """A split-backward block on `single`, each op at the first time its input is there and
    its rank is free modulo the interval; rank 0's W trails by one more interval."""
    costs, T = Costs(1.0, 1.0, 1.0, 0.0), 3.0
    busy = [[] for _ in range(p)]
    start = {}
    for s in range(p):
        start[(F, s)] = _place(busy[s], float(s), 1.0, T)
    for s in reversed(range(p)):
        start[(B, s)] = _place(busy[s], start[(F, s)] + 1 if s == p - 1 else start[(B, s + 1)] + 1, 1.0, T)
    for s in range(p):
        start[(W, s)] = _place(busy[s], start[(B, s)] + 1 + (T if s == 0 else 0), 1.0, T)
    return Block(Placement("single", p), costs, T, start)


def test_peak_from_lifespan():
    assert peak_from_lifespan(6.0, 6.0) == 1
    assert peak_from_lifespan(6.5, 6.0) == 2
    assert peak_from_lifespan(12.0, 2.0) == 6
    assert peak_from_lifespan(0.0, 2.0) == 0
    with pytest.raises(ValueError, match="interval=0.0 must be > 0"):
        peak_from_lifespan(1.0, 0.0)


@pytest.mark.parametrize("p", [2, 4, 7])
def test_1f1b_block_peak_is_lifespan_over_interval(p):
    block = one_f_one_b_block(p)
    assert block.problems() == []
    for s in range(p):
        assert block.lifespan(s) == 2 * p - 2 * s
        assert block.peak_bound(s) == p - s == block.steady_peak(s)
    schedule = verify(squeeze(block, 3 * p, "1f1b-block"))
    assert peak_activations(schedule) == [math.ceil(block.lifespan(s) / block.interval) for s in range(p)]
    # Squeezed 1F1B is 1F1B: bubble (p-1)/(m+p-1).
    assert simulate(schedule).bubble_rate == pytest.approx((p - 1) / (3 * p + p - 1))


@pytest.mark.parametrize("p", [3, 5])
def test_split_block_relation(p):
    block = zb_block(p)
    assert block.problems() == []
    schedule = verify(squeeze(block, 4 * p, "zb-block"))
    peaks = peak_activations(schedule)
    for r in range(p):
        assert peaks[r] == block.steady_peak(r) == peak_from_lifespan(block.lifespan(r), block.interval)


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("costs", [Costs(0.5, 0.5, 0.5, 0.0), Costs(1.0, 1.1, 0.8, 0.05)])
def test_v_block_relation_against_simulator(p, costs):
    """Two stages per rank: the exact steady peak is what the simulator measures, and it is
    at most the paper's sum of ceil(lifespan / interval)."""
    base = 2 * (costs.F + costs.B + costs.W)
    ran = 0
    for stretch, turn, spread in [(1.0, 0.0, 0.0), (1.05, 1.0, 1.0), (1.2, 0.0, 2.0)]:
        try:
            block = v_block(p, costs, base * stretch, turn, spread)
        except ValueError as e:  # no placement of the rank's ops repeats at this interval
            assert "no free slot" in str(e) or "interval too short" in str(e), e
            continue
        ran += 1
        assert block.problems() == []
        life = max(block.lifespan(s) for s in range(2 * p))
        m = math.ceil(life / block.interval) + 3  # long enough to reach the steady state
        schedule = verify(squeeze(block, m, "v-block"))
        peaks = peak_activations(schedule)
        for r in range(p):
            assert peaks[r] == block.steady_peak(r) <= block.peak_bound(r)
            assert block.peak_bound(r) == sum(
                math.ceil(block.lifespan(s) / block.interval - 1e-9) for s in block.placement.stages_of(r)
            )
    assert ran, "no variant built a block: this test would check nothing"


def test_problems_name_collisions_and_early_ops():
    block = one_f_one_b_block(4)
    tight = Block(block.placement, block.costs, 1.5, block.start)
    assert any("take" in line for line in tight.problems())
    shifted = dict(block.start)
    shifted[(BW, 3)] = 4.5  # collides with the copy of F@3 one interval later
    assert any("collide" in line for line in Block(block.placement, block.costs, 2.0, shifted).problems())
    early = dict(block.start)
    early[(F, 2)] = 1.0  # before F@1 has ended
    assert any("before its input" in line for line in Block(block.placement, block.costs, 2.0, early).problems())


def test_repeat_is_timed_and_squeeze_removes_idle():
    costs = Costs(1.0, 1.0, 1.0, 0.0)
    block = v_block(4, costs, 6.0 * 1.2, 1.0, 1.0)  # a stretched interval leaves idle time
    timed = repeat(block, 8)
    for ops in timed:
        starts = [t for t, _ in ops]
        assert starts == sorted(starts)
    timed_end = max(t + costs.of(op.kind) for ops in timed for t, op in ops)
    squeezed = simulate(squeeze(block, 8, "v"))
    assert squeezed.makespan < timed_end
    assert [[op for _, op in ops] for ops in timed] == squeeze(block, 8, "v").ranks


@pytest.mark.parametrize("p,m", [(4, 8), (6, 13), (8, 24)])
def test_reorder_keeps_peak_and_fills_idle(p, m):
    """Reordering under the squeezed schedule's own peak never raises it, and pulls ops into
    the idle time of warm-up and cool-down."""
    costs = Costs(0.5, 0.5, 0.5, 0.0)
    block = v_block(p, costs, 3.0, 0.5, 0.5)
    squeezed = squeeze(block, m, "v")
    peaks = peak_activations(squeezed)
    reordered = verify(reorder(block, m, peaks, "v"))
    assert all(a <= b for a, b in zip(peak_activations(reordered), peaks))
    assert simulate(reordered).makespan < simulate(squeezed).makespan


def test_reorder_reports_impossible_caps():
    costs = Costs(0.5, 0.5, 0.5, 0.0)
    block = v_block(4, costs, 3.0)
    with pytest.raises(Stuck):
        reorder(block, 4, [1] * 4, "v")


def test_reorder_combined_backward_on_single():
    block = one_f_one_b_block(4)
    s = verify(reorder(block, 10, [4, 3, 2, 1], "1f1b"))
    assert peak_activations(s) == [4, 3, 2, 1]
    assert all(op.kind in (F, BW) for ops in s.ranks for op in ops)
    assert Op(BW, 9, 0) in s.ranks[0]


@pytest.mark.parametrize("p", range(2, 17))
def test_v_half_block_lifespans_give_the_papers_memory(p):
    """V-Half's block spaces the chunk-0 forwards and the chunk-1 backwards one op apart; its
    lifespans then sum, per rank, to (p+2)//2 microbatches' worth of 1F1B activations, and the
    squeezed schedule holds exactly what the lifespans say."""
    costs = Costs(1.0, 1.0, 1.0, 0.0)
    legal = []
    for turn in range(6):
        block = v_block(p, costs, 6.0, turn, 1.0, 1.0)
        if not block.problems():
            legal.append(block)
    assert legal
    block = min(legal, key=lambda b: max(b.peak_bound(r) for r in range(p)))
    assert max(block.peak_bound(r) for r in range(p)) == 2 * ((p + 2) // 2)
    schedule = verify(squeeze(block, 3 * p, "v-half-block"))
    assert peak_activations(schedule) == [block.steady_peak(r) for r in range(p)]
