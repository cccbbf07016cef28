"""Justification (planner/justify.py): list scheduling a plan backward then forward never
lengthens it, keeps every rank under the cap, and the random restarts around it reach what
the local moves did not."""
import pytest

from megatron_vshape.planner import justify, search

from megatron_vshape.schedule import registry
from megatron_vshape.schedule.ops import Costs, StageCost, stage_table
from megatron_vshape.planner.problem import Problem
from megatron_vshape.schedule.simulate import simulate
from megatron_vshape.schedule.verify import verify

HOP = Costs(2, 2, 2, 0.25)
SKEWED = Costs(2, 2.2, 1.6, 0.05)


def problem(pp, m, costs, budget, table=None):
    costs = costs.per_stage(2)
    table = table or stage_table(costs, 2 * pp, None)
    return Problem(pp, m, costs, table, search.cap_of(pp, m, budget, table))


def unequal(pp):
    """A heavier embedding stage and a heavier output-and-loss stage, with sizes that are not
    whole numbers (the cap is then X * 2p itself)."""
    table = [StageCost(1, 1.1, 0.8, 1.0)] * (2 * pp)
    table[0], table[-1] = StageCost(1.5, 1.5, 1.2, 1.3), StageCost(2.5, 2.6, 1.4, 1.5)
    return table


def greedy_start(P):
    """A plan that fits: the best of the greedy list schedules."""
    orders = [o for o, _ in search._greedy_candidates(P)]
    return min(orders, key=lambda o: P.evaluate(o)[0])


def eager(P, order):
    return P.ends(order)[:P.n]


CASES = [(4, 9, HOP, 0.625, None), (3, 7, SKEWED, 0.667, None), (5, 6, Costs(1, 2, 1, 0.1), 0.8, None),
         (4, 10, SKEWED, 0.7, "unequal")]


@pytest.mark.parametrize("pp, m, costs, budget, stages", CASES)
def test_in_the_plans_start_order_every_op_lands_no_later(pp, m, costs, budget, stages):
    P = problem(pp, m, costs, budget, unequal(pp) if stages else None)
    order = greedy_start(P)
    end = eager(P, order)
    g = justify.Graph(P)
    ranks, got = justify.schedule(P, g, P.starts(order))
    assert sorted(o for r in ranks for o in r) == list(range(P.n))
    assert all(got[o] <= end[o] + 1e-9 for o in range(P.n))
    assert P.fits(ranks)
    assert P.evaluate(ranks)[0] <= max(got) + 1e-9 <= P.evaluate(order)[0] + 1e-9


@pytest.mark.parametrize("pp, m, costs, budget, stages", CASES)
def test_the_backward_schedule_mirrors_the_plan_within_its_span_and_cap(pp, m, costs, budget, stages):
    P = problem(pp, m, costs, budget, unequal(pp) if stages else None)
    order = greedy_start(P)
    end = eager(P, order)
    start = P.starts(order)
    ranks, late = justify.schedule(P, justify.Graph(P), [-e for e in end], backward=True)
    horizon = max(end)
    # Mirrored, each op ends no later than its start in the plan, seen from the plan's end.
    assert all(late[o] <= horizon - start[o] + 1e-9 for o in range(P.n))
    forward = [r[::-1] for r in ranks]  # the mirror's order, run forward
    assert P.fits(forward)
    assert P.evaluate(forward)[0] <= horizon + 1e-9


def test_an_op_that_fits_nowhere_waits_for_its_rank_to_free_memory():
    # Every F listed before every B and W: beyond the cap the F's must wait for W's.
    P = problem(4, 8, HOP, 0.625)
    key = [(o % 3) * P.n + o for o in range(P.n)]
    ranks, _ = justify.schedule(P, justify.Graph(P), key)
    assert P.fits(ranks) and P.evaluate(ranks) is not None
    # With no room for even one microbatch's two F's on a rank, nothing can be placed.
    P.cap = 1
    assert justify.schedule(P, justify.Graph(P), key) is None


@pytest.mark.parametrize("pp, m, costs, budget, stages", CASES)
def test_justify_never_lengthens_a_plan_and_keeps_it_verified(pp, m, costs, budget, stages):
    table = unequal(pp) if stages else None
    P = problem(pp, m, costs, budget, table)
    order = greedy_start(P)
    score = P.evaluate(order)
    new, new_score = justify.justify(P, justify.Graph(P), order, score)
    assert new_score == P.evaluate(new)
    assert new_score[0] <= score[0] + 1e-9 and P.fits(new)
    verify(P.schedule("v-auto", new, budget, table, {}))


def test_justify_search_is_seeded_and_never_longer():
    P = problem(4, 9, HOP, 0.625)
    order = greedy_start(P)
    a = justify.justify_search(P, [o[:] for o in order], 20, seed=3)
    b = justify.justify_search(P, [o[:] for o in order], 20, seed=3)
    assert a == b
    assert a[1] == P.evaluate(a[0])[0] <= P.evaluate(order)[0] and P.fits(a[0])



def test_kicked_restarts_continue_from_the_plain_ones_and_reach_the_delayed_shape(monkeypatch):
    # Between V-Half's and V-ZB's caps (pp=3, cap 5), from the plan without them: the plain
    # restarts stay at 42; the kicks, which delay the first chunk's backward, reach 41.5 (the
    # proven optimum is 41; docs/planner.md, "Against the exact reference").
    P = problem(3, 6, HOP, 5 / 6)
    monkeypatch.setattr(search, "JUSTIFY_KICKS", 0)
    search._plan.cache_clear()
    try:
        order = P.encode(registry.build("v-auto", 3, 6, HOP, memory_budget=5 / 6).ranks)
    finally:
        search._plan.cache_clear()  # no plan without kicks stays cached for other tests
    assert P.evaluate(order)[0] == 42
    plain = justify.justify_search(P, [o[:] for o in order], 150, seed=5)
    kicked = justify.justify_search(P, [o[:] for o in order], 150, seed=5, kicks=75)
    assert kicked == justify.justify_search(P, [o[:] for o in order], 150, seed=5, kicks=75)
    assert plain[1] == 42 and kicked[1] <= plain[1] and kicked[1] == P.evaluate(kicked[0])[0] and P.fits(kicked[0])
    assert kicked[1] <= 41.5 + 1e-9
    verify(P.schedule("v-auto", kicked[0], 5 / 6, None, {}))

# CP-SAT's best schedules in 100 s (hinted with the plan) at pp=4, budget 0.625 (5
# stage-activations per rank), where the planner was furthest off before justify_search (2.70%
# above them on average, 3.65% at most; docs/planner.md, "Against the exact reference").
BEST_KNOWN = {(HOP, 9): 68.5, (HOP, 10): 75, (HOP, 11): 82, (HOP, 12): 88.5,
              (SKEWED, 9): 63.7, (SKEWED, 10): 70.2, (SKEWED, 11): 76.3, (SKEWED, 12): 82.9}


def test_v_auto_comes_within_2_percent_of_the_best_known_schedules_below_v_half():
    gaps = [simulate(registry.build("v-auto", 4, m, costs, memory_budget=0.625)).makespan / best - 1
            for (costs, m), best in BEST_KNOWN.items()]
    # Each within 2%, the exact reference's bar (the largest 1.70%, the mean 0.66%; 2.51% and
    # 1.17% before justify_search's window restarts took half of relax()'s moves there).
    assert sum(gaps) / len(gaps) <= 0.01, gaps
    assert max(gaps) <= 0.02, gaps
