"""scripts/bench/vs_official.py's grid (the comparison itself needs the paper's released scheduler,
which this repository does not ship): pp 4..16, m p..8p, every cap from V-Min's to 2p."""
from bench_scripts import load_bench

from megatron_vshape.planner import search

bench = load_bench("vs_official")


def test_the_grid_spans_every_microbatch_count_and_cap_from_v_mins():
    grid = list(bench.points(range(4, 17), 128, bench.COST_SETS))
    for pp in range(4, 17):
        low = search.budget_steps(pp, pp, high=2.0)[0][0]
        mine = [(m, c, cap) for p, m, c, cap in grid if p == pp]
        assert {m for m, _, _ in mine} == set(range(pp, 8 * pp + 1))
        assert {cap for _, _, cap in mine} == set(range(low, 2 * pp + 1))
        assert len(mine) == len(set(mine)) == (7 * pp + 1) * len(bench.COST_SETS) * (2 * pp + 1 - low)


def test_min_m_and_max_m_cut_the_grid_and_keep_its_order():
    whole = list(bench.points(range(4, 17), 128, bench.COST_SETS))
    band = list(bench.points(range(4, 17), 64, bench.COST_SETS, min_m=33))
    assert band == [p for p in whole if 33 <= p[1] <= 64]
    assert band and min(p[1] for p in band) == 33 and max(p[1] for p in band) == 64
    assert len(whole) == 39_417  # the grid's size docs/planner.md quotes
