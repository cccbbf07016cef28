"""The simulator's timeline and figures on small hand-computed cases."""
import pytest

from megatron_vshape.schedule.ops import B, BW, F, W, Costs, Op, Placement, Schedule
from megatron_vshape.schedule.simulate import Deadlock, run_lists, simulate


def _times(sim):
    return {str(op): (s, e) for row in sim.timeline for op, s, e in row}


def test_hop_cost_between_ranks():
    s = Schedule("two", Placement("single", 2), 1, Costs(1, 1, 1, 0.5), [
        [Op(F, 0, 0), Op(BW, 0, 0)],
        [Op(F, 0, 1), Op(BW, 0, 1)],
    ])
    sim = simulate(s)
    t = _times(sim)
    assert t == {"F0@0": (0, 1), "F0@1": (1.5, 2.5), "BW0@1": (2.5, 4.5), "BW0@0": (5.0, 7.0)}
    assert sim.makespan == 7.0
    assert sim.busy == [3.0, 3.0]
    assert sim.bubble_rate == pytest.approx(1 - 3 / 7)
    assert sim.span_bubble_rate == pytest.approx(max(1 - 3 / 7, 1 - 3 / 4))


def test_v_turn_on_last_rank_is_free():
    # pp=2, V: rank 0 holds stages 0 and 3, rank 1 holds stages 1 and 2 (the turn 1 -> 2 is local).
    s = Schedule("v", Placement("v", 2, 2), 1, Costs(1, 1, 1, 0.5), [
        [Op(F, 0, 0), Op(F, 0, 3), Op(B, 0, 3), Op(B, 0, 0), Op(W, 0, 3), Op(W, 0, 0)],
        [Op(F, 0, 1), Op(F, 0, 2), Op(B, 0, 2), Op(B, 0, 1), Op(W, 0, 2), Op(W, 0, 1)],
    ])
    t = _times(simulate(s))
    assert t["F0@2"] == (2.5, 3.5)  # right after F0@1 on the same rank: no C
    assert t["F0@3"] == (4.0, 5.0)  # a hop back to rank 0 costs C
    assert t["B0@3"] == (5.0, 6.0)  # the last stage's output stays on rank 0
    assert t["B0@2"] == (6.5, 7.5)
    assert t["B0@1"] == (7.5, 8.5)  # local again
    assert t["B0@0"] == (9.0, 10.0)


def test_ops_wait_for_their_rank_and_inputs_in_list_order():
    s = Schedule("order", Placement("single", 2), 2, Costs(1, 2, 1, 0), [
        [Op(F, 0, 0), Op(F, 1, 0), Op(B, 0, 0), Op(B, 1, 0), Op(W, 0, 0), Op(W, 1, 0)],
        [Op(F, 0, 1), Op(B, 0, 1), Op(F, 1, 1), Op(B, 1, 1), Op(W, 0, 1), Op(W, 1, 1)],
    ])
    t = _times(simulate(s))
    assert t["B0@1"] == (2, 4) and t["F1@1"] == (4, 5)  # F1 arrived at 2 but B0 came first in the list
    assert t["B0@0"] == (4, 6) and t["B1@0"] == (7, 9)


def test_peaks():
    s = Schedule("peaks", Placement("single", 2), 3, Costs(), [
        [Op(F, 0, 0), Op(F, 1, 0), Op(F, 2, 0), Op(BW, 0, 0), Op(BW, 1, 0), Op(BW, 2, 0)],
        [Op(F, 0, 1), Op(BW, 0, 1), Op(F, 1, 1), Op(B, 1, 1), Op(F, 2, 1), Op(W, 1, 1), Op(BW, 2, 1)],
    ])
    # Rank 0 holds all three; on rank 1, B1 does not free microbatch 1, its W does (after F2).
    sim = simulate(s)
    assert sim.peak_activations == [3, 2]
    assert sim.peak_vs_1f1b == [3 / 2, 2 / 2]  # 1F1B's rank 0 holds min(p, m) = 2


def test_deadlock_is_reported():
    s = Schedule("stuck", Placement("single", 2), 1, Costs(), [
        [Op(BW, 0, 0), Op(F, 0, 0)],
        [Op(F, 0, 1), Op(BW, 0, 1)],
    ])
    with pytest.raises(Deadlock, match="rank 0 waits at BW0@0"):
        run_lists(s)
