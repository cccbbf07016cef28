"""The verifier accepts good schedules and names what is wrong with broken ones."""
import copy

import pytest

from megatron_vshape.schedule.baselines import one_f_one_b
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import B, BW, F, W, Costs, Op, Placement, Schedule
from megatron_vshape.schedule.verify import InvalidSchedule, forward_only_view, problems, verify


def _split(schedule):
    """The same order with every BW split into B then W."""
    out = copy.deepcopy(schedule)
    out.ranks = [[x for op in ops for x in ((Op(B, op.microbatch, op.stage), Op(W, op.microbatch, op.stage)) if op.kind == BW else (op,))] for ops in out.ranks]
    return out


def test_valid_schedules_pass():
    for s in (one_f_one_b(2, 2), one_f_one_b(4, 7), _split(one_f_one_b(3, 5))):
        assert problems(s) == []
        assert verify(s) is s


def test_missing_op():
    s = _split(one_f_one_b(3, 4))
    s.ranks[1] = [op for op in s.ranks[1] if op != Op(W, 2, 1)]
    with pytest.raises(InvalidSchedule, match=r"microbatch 2 stage 1: B x1, W x0, BW x0"):
        verify(s)


def test_duplicate_op():
    s = one_f_one_b(2, 2)
    s.ranks[0].append(Op(F, 1, 0))
    assert any("F1@0 appears 2 times" in p for p in problems(s))


def test_op_on_the_wrong_rank():
    s = one_f_one_b(3, 3)
    op = Op(F, 0, 2)
    s.ranks[2].remove(op)
    s.ranks[1].insert(0, op)
    assert any("rank 1: F0@2 belongs to rank 2" in p for p in problems(s))


def test_wrong_local_order():
    s = _split(one_f_one_b(2, 2))
    ops = s.ranks[1]
    i, j = ops.index(Op(B, 0, 1)), ops.index(Op(W, 0, 1))
    ops[i], ops[j] = ops[j], ops[i]
    assert any("W0@1 comes before B0@1" in p for p in problems(s))
    s = one_f_one_b(2, 2)
    s.ranks[0] = [Op(BW, 0, 0)] + [op for op in s.ranks[0] if op != Op(BW, 0, 0)]
    assert any("BW0@0 comes before F0@0" in p for p in problems(s))


def test_deadlock_under_the_matching_rule():
    # Rank 0 waits for gradient 0 before sending activation 1; rank 1 wants activation 1
    # before it sends gradient 0: every op exists exactly once, yet nothing can move.
    s = Schedule("crossed", Placement("single", 2), 2, Costs(), [
        [Op(F, 0, 0), Op(BW, 0, 0), Op(F, 1, 0), Op(BW, 1, 0)],
        [Op(F, 0, 1), Op(F, 1, 1), Op(BW, 0, 1), Op(BW, 1, 1)],
    ])
    found = problems(s)
    assert len(found) == 1 and "deadlock" in found[0]
    assert "rank 0 waits at BW0@0" in found[0] and "rank 1 waits at F1@1" in found[0]


def test_out_of_range_and_wrong_list_count():
    s = one_f_one_b(2, 2)
    s.ranks[0].append(Op(F, 5, 0))
    assert any("outside stages" in p for p in problems(s))
    s = one_f_one_b(2, 2)
    s.ranks.pop()
    assert problems(s) == ["1 op lists for pp=2"]


def test_invalid_schedule_is_a_config_error_with_the_sizes():
    s = one_f_one_b(2, 2)
    s.ranks[0].pop()
    with pytest.raises(ConfigError, match=r"'1f1b' \(pp=2, microbatches=2\) is invalid"):
        verify(s)


def test_forward_only_view():
    s = forward_only_view(one_f_one_b(3, 4))
    assert problems(s, forward_only=True) == []
    assert problems(one_f_one_b(3, 4), forward_only=True) != []


@pytest.mark.parametrize("name", ["1f1b", "1f1b-interleaved", "v-half", "zb-h1"])
def test_forward_only_order_runs_any_count_on_the_schedule_placement(name):
    """Evaluation at a count the training schedule cannot run: every microbatch's forward ops, each rank's in
    pipeline order, verified deadlock-free under the channels' FIFO order, on single, loop and V placements."""
    from megatron_vshape.schedule import registry
    from megatron_vshape.schedule.simulate import simulate
    from megatron_vshape.schedule.verify import forward_only_order

    for pp in (2, 3, 4, 5):
        base = registry.build(name, pp, 4 * pp, Costs(1, 1, 1, 0))
        S = base.placement.num_stages
        one = simulate(forward_only_order(base, 1)).makespan  # one microbatch through the S stages
        for m in (1, 2, pp + 1, 3 * pp):
            s = forward_only_order(base, m)
            assert problems(s, forward_only=True) == [], (pp, m)
            assert s.placement == base.placement and s.microbatches == m
            assert sorted(str(op) for ops in s.ranks for op in ops) == sorted(
                f"F{mb}@{st}" for mb in range(m) for st in range(base.placement.num_stages))
            # a pipeline: with one stage a rank, m + S - 1 forwards long (it fills, then never waits); with c stages
            # a rank, whose ops of one time step take turns, at most c times that
            f, chunks = one / S, base.placement.chunks
            ms = simulate(s).makespan
            assert ms == pytest.approx((m + S - 1) * f) if chunks == 1 else m * chunks * f <= ms <= chunks * (m + S - 1) * f
