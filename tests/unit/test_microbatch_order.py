"""Microbatches in order on every stage (gradients add up as in the non-pipelined model, bit
for bit): problems() finds where a schedule breaks it, relabel() repairs one without making it
longer or changing its memory, and every registered schedule comes in order, the planner's too,
whose local moves break it under unequal stage costs before it relabels."""
import random

import pytest

from megatron_vshape.planner import listing, local, problem, search

from megatron_vshape.schedule import microbatch_order, registry
from megatron_vshape.schedule.baselines import one_f_one_b
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import B, BW, W, Costs, Op, StageCost, stage_table
from megatron_vshape.schedule.simulate import peak_activations, simulate
from megatron_vshape.schedule.verify import verify


def _split(schedule):
    schedule.ranks = [[x for op in ops for x in ((Op(B, op.microbatch, op.stage), Op(W, op.microbatch, op.stage))
                                                 if op.kind == BW else (op,))] for ops in schedule.ranks]
    return schedule


def test_out_of_order_ws_are_found_and_relabelled():
    s = _split(one_f_one_b(2, 4))
    ops = s.ranks[1]
    ops.remove(Op(W, 1, 1))
    ops.insert(ops.index(Op(W, 2, 1)) + 1, Op(W, 1, 1))  # still complete and deadlock-free, W2 before W1
    verify(s)  # a valid schedule (the runtime runs such orders, equal within rounding)
    found = microbatch_order.problems(s.ranks)
    assert len(found) == 1 and "W1@1 after W2@1" in found[0] and "not bit for bit" in found[0]
    s.ranks = microbatch_order.relabel(s.ranks)
    assert microbatch_order.problems(s.ranks) == []
    verify(s)
    assert [op.microbatch for op in s.ranks[1] if op.kind == W] == [0, 1, 2, 3]


def test_out_of_order_combined_backwards_are_relabelled_too():
    s = one_f_one_b(2, 4)  # BW ops
    ops = s.ranks[0]
    i, j = ops.index(Op(BW, 2, 0)), ops.index(Op(BW, 3, 0))
    ops[i], ops[j] = ops[j], ops[i]  # the last two backwards swapped: valid, not in order
    verify(s)
    assert "BW2@0 after BW3@0" in microbatch_order.problems(s.ranks)[0]
    before = simulate(s).makespan
    s.ranks = microbatch_order.relabel(s.ranks)
    assert microbatch_order.problems(s.ranks) == [] and simulate(verify(s)).makespan <= before


def _raw_search_orders(n):
    """Orders straight out of greedy() + improve() under random unequal stage costs, before
    the planner relabels them (random pp, microbatches, caps)."""
    rng = random.Random(7)
    for _ in range(n):
        pp, m = rng.choice([2, 3, 4]), rng.choice([3, 4, 5, 6, 8])
        costs = Costs(1, 1, 1, 0).per_stage(2)
        table = stage_table(costs, 2 * pp, [StageCost(rng.uniform(1, 10), rng.uniform(0.5, 10), rng.uniform(0.2, 3),
                                                      rng.choice([1.0, 1.0, 1.5])) for _ in range(2 * pp)])
        budget = rng.choice([search.min_budget(pp), 1.0, 1.5])
        P = problem.Problem(pp, m, costs, table, search.cap_of(pp, m, budget, table))
        try:
            order = listing.greedy(P, "F1 B1 F0 B0", 1.0, "one")
        except search.Stuck:
            continue
        order, _ = local.improve(P, order, 20_000, seed=1)
        yield P, budget, order


def test_relabelled_search_orders_are_no_longer_and_hold_the_same_memory():
    broken = 0
    for P, budget, order in _raw_search_orders(24):
        ranks = [[P.op(i) for i in ops] for ops in order]
        before = P.schedule("raw", order, None, P.table, {})
        after = P.schedule("raw", P.encode(microbatch_order.relabel(ranks)), budget, P.table, {})
        assert microbatch_order.problems(after.ranks) == []
        verify(after)  # complete, deadlock-free, within the budget
        assert simulate(after).makespan <= simulate(before).makespan + 1e-9
        assert peak_activations(after) == peak_activations(before)
        broken += bool(microbatch_order.problems(ranks))
    assert broken >= 3, "the local moves should break the order somewhere (else this test proves nothing)"


@pytest.mark.parametrize("name", registry.names())
def test_every_registered_schedule_runs_microbatches_in_order(name):
    rng = random.Random(3)
    for pp, m in ((2, 4), (3, 7), (4, 8), (4, 12)):
        try:
            s = registry.build(name, pp, m, Costs(2, 2.2, 1.6, 0.05))
        except ConfigError:  # sizes this schedule refuses, with the minimum in the message
            continue
        assert microbatch_order.problems(s.ranks) == [], f"{name} pp={pp} m={m}"
        assert microbatch_order.relabel(s.ranks) == s.ranks  # B/W and BW alike: nothing to relabel
    if not registry.plans_for_stage_costs(name):
        return
    for _ in range(3):
        pp, m = rng.choice([2, 3]), rng.choice([3, 4, 6])
        table = [StageCost(rng.uniform(1, 10), rng.uniform(0.5, 10), rng.uniform(0.2, 3), 1.0) for _ in range(2 * pp)]
        s = registry.build(name, pp, m, Costs(1, 1, 1, 0), stage_costs=table)
        assert microbatch_order.problems(s.ranks) == [], f"{name} pp={pp} m={m} {table}"
