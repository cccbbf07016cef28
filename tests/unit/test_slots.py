"""Blocks on a grid of unit slots (planner/slots.py): the uniform-offset family, the steady
peak, and the squeeze (spliced for long runs exactly as if squeezed at full length)."""
import pytest

from megatron_vshape.planner import search, slots
from megatron_vshape.schedule.ops import Costs, stage_table
from megatron_vshape.planner.problem import Problem
from megatron_vshape.schedule.verify import verify

SKEWED = Costs(2, 2.2, 1.6, 0.05)


def problem(pp, m, budget, costs=SKEWED):
    per_stage = costs.per_stage(2)
    return Problem(pp, m, per_stage, stage_table(per_stage, 2 * pp, None), search.cap_of(pp, m, budget))


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
def test_the_papers_blocks_are_in_the_uniform_family(pp):
    family = set(slots.uniform_blocks(pp))
    assert len(family) == len(slots.uniform_blocks(pp))  # distinct
    for kind in ("min", "half"):
        assert tuple(map(tuple, slots.paper_pattern(pp, kind))) in family


def test_steady_peak_is_the_repeated_schedules_peak():
    P = problem(4, 24, 2.0)
    for block in slots.uniform_blocks(4)[::7]:
        at = slots.repeat(P, block)
        assert at is not None
        assert slots.steady_peak(P, block) == max(max(row) for row in slots._Grid(P, at).live)


@pytest.mark.parametrize("kind, pp, m, budget", [("half", 8, 100, 5 / 8), ("min", 7, 60, 3 / 7), ("half", 16, 128, 9 / 16)])
def test_long_runs_splice_the_steady_phase_exactly(kind, pp, m, budget):
    P = problem(pp, m, budget)
    block = slots.paper_pattern(pp, kind)
    spliced = slots.squeezed(P, block)
    whole = [slots.orders(P, at) for at, _, _ in slots.squeeze_block(P, block)]
    assert spliced and all(order in whole for order in spliced)


@pytest.mark.parametrize("kind, pp, m", [("half", 4, 12), ("min", 6, 13), ("half", 5, 7)])
def test_squeezed_orders_are_legal_and_within_the_cap(kind, pp, m):
    budget = {"min": (pp + 4) // 3, "half": (pp + 2) // 2}[kind] / pp
    P = problem(pp, m, budget)
    orders = slots.squeezed(P, slots.paper_pattern(pp, kind))
    assert orders
    for order in orders:
        assert P.fits(order) and P.evaluate(order) is not None
        verify(P.schedule("v-auto", order, budget, None, {}))


def test_the_squeeze_reaches_the_papers_greedy_at_pp4():
    # Unit costs, V-Half's budget: the repeated block squeezed twice runs in 38.5 stage-slots
    # (bubble 6.49%); the block merely repeated and squeezed once takes 40.5.
    P = problem(4, 12, 0.75, Costs(1, 1, 1, 0))
    makespans = sorted(P.evaluate(o)[0] for o in slots.squeezed(P, slots.paper_pattern(4, "half")))
    assert makespans[0] == 38.5 and makespans[-1] == 40.5
