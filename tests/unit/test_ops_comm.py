"""The op model and the communication matching rule shared by runtime and verifier."""
import pytest

from megatron_vshape.schedule.comm import ACT, GRAD, Message, channels, rank_plan
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import B, F, W, Costs, Op, Placement, Schedule


def test_op_text_round_trip():
    for text in ("F3@5", "B0@0", "W12@7", "BW2@1"):
        assert str(Op.parse(text)) == text
    with pytest.raises(ConfigError):
        Op.parse("f3@5")


def test_placements():
    v = Placement("v", 4, 2)
    assert [v.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(v.rank_of(s) == r for r in range(4) for s in v.stages_of(r))
    loop = Placement("loop", 4, 3)
    assert loop.stages_of(1) == [1, 5, 9] and loop.rank_of(9) == 1 and loop.chunk_of(9) == 2
    with pytest.raises(ConfigError):
        Placement("v", 4, 3)


def test_costs_parse_and_per_stage():
    c = Costs.parse("2,2.2,1.6,0.05")
    assert c.per_stage(2) == Costs(1.0, 1.1, 0.8, 0.05)
    for bad in ("1,2", "a,b,c", "0,1,1", "1,1,1,nan", "inf,1,1", "1,1,1,-0.1"):
        with pytest.raises(ConfigError):
            Costs.parse(bad)


def _v_pp2_one_microbatch():
    # rank 0: stages 0 and 3; rank 1: stages 1 and 2 (the turn 1 -> 2 is local).
    r0 = [Op(F, 0, 0), Op(F, 0, 3), Op(B, 0, 3), Op(W, 0, 3), Op(B, 0, 0), Op(W, 0, 0)]
    r1 = [Op(F, 0, 1), Op(F, 0, 2), Op(B, 0, 2), Op(B, 0, 1), Op(W, 0, 2), Op(W, 0, 1)]
    return Schedule("hand", Placement("v", 2, 2), 1, Costs(), [r0, r1])


def test_v_turn_is_local_and_channels_are_directional():
    s = _v_pp2_one_microbatch()
    chans = channels(s)
    assert chans[(0, 1)] == [Message(ACT, 0, 0, 1), Message(GRAD, 0, 3, 2)]
    assert chans[(1, 0)] == [Message(ACT, 0, 2, 3), Message(GRAD, 0, 1, 0)]
    plan = rank_plan(s, 1)
    assert plan[1].local_in == Message(ACT, 0, 1, 2) and plan[1].recvs == []
    assert plan[3].local_in == Message(GRAD, 0, 2, 1)


def test_receiver_takes_channel_order_and_buffers_early_messages():
    # Rank 0 sends act(F1@0) before grad(B0@3); rank 1 needs the gradient first (B0@2),
    # so it must take act1 off the channel first and keep it for F1@1.
    p = Placement("v", 2, 2)
    r0 = [Op(F, 0, 0), Op(F, 0, 3), Op(F, 1, 0), Op(B, 0, 3), Op(W, 0, 3), Op(F, 1, 3), Op(B, 1, 3), Op(W, 1, 3),
          Op(B, 0, 0), Op(W, 0, 0), Op(B, 1, 0), Op(W, 1, 0)]
    r1 = [Op(F, 0, 1), Op(F, 0, 2), Op(B, 0, 2), Op(F, 1, 1), Op(F, 1, 2), Op(B, 1, 2),
          Op(B, 0, 1), Op(W, 0, 2), Op(B, 1, 1), Op(W, 1, 2), Op(W, 0, 1), Op(W, 1, 1)]
    s = Schedule("hand", p, 2, Costs(), [r0, r1])
    plan = {str(step.op): step for step in rank_plan(s, 1)}
    assert plan["B0@2"].recvs == [Message(ACT, 1, 0, 1), Message(GRAD, 0, 3, 2)]
    assert plan["F1@1"].recvs == []
