"""The baselines reach the figures their papers state (1F1B, Megatron interleaved, ZB-H1, ZB-H2)."""
import pytest

from megatron_vshape.schedule import registry
from megatron_vshape.schedule.baselines import megatron_interleaved_table
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import B, BW, F, W, Costs
from megatron_vshape.schedule.simulate import simulate

SIZES = [(p, m) for p in (2, 3, 4, 7, 8, 16) for m in (1, p - 1, p, 2 * p + 1, 3 * p, 8 * p) if m >= 1]
HOP_FREE_COSTS = [Costs(), Costs(2, 2.2, 1.6, 0), Costs(1, 3, 0.5, 0)]


@pytest.mark.parametrize("p, m", SIZES)
@pytest.mark.parametrize("costs", HOP_FREE_COSTS, ids=str)
def test_1f1b_bubble_is_exactly_the_formula(p, m, costs):
    sim = simulate(registry.build("1f1b", p, m, costs))
    assert sim.bubble_rate == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert sim.peak_vs_1f1b[0] == 1.0
    assert sim.peak_activations == [min(p - r, m) for r in range(p)]


def test_1f1b_is_megatrons_order():
    s = registry.build("1f1b", 4, 6)
    for r, ops in enumerate(s.ranks):
        warm = 4 - 1 - r
        assert [op.kind for op in ops[:warm]] == [F] * warm
        steady = ops[warm : warm + 2 * (6 - warm)]
        assert [op.kind for op in steady] == [F, BW] * (6 - warm)
        assert [op.microbatch for op in steady[1::2]] == list(range(6 - warm))
        assert all(op.kind == BW for op in ops[warm + 2 * (6 - warm) :])


def test_interleaved_table_matches_megatrons_docstring_example():
    # megatron/core/pipeline_parallel/schedules.py: "PP2 N3M5 with VP2".
    table = megatron_interleaved_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_interleaved_table_matches_megatron_core():
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    for m, v, g in [(8, 2, 4), (12, 3, 4), (10, 2, 5), (13, 2, 13), (24, 2, 8)]:
        assert megatron_interleaved_table(m, v, g) == schedules.get_schedule_table(m, v, g)


@pytest.mark.parametrize("p, m, chunks", [(2, 4, 2), (4, 8, 2), (4, 16, 3), (8, 24, 2), (8, 64, 4), (16, 32, 2)])
def test_interleaved_bubble_warmup_and_memory(p, m, chunks):
    s = registry.build("1f1b-interleaved", p, m, chunks=chunks)
    assert s.placement.kind == "loop" and s.placement.chunks == chunks
    sim = simulate(s)
    assert sim.bubble_rate == pytest.approx((p - 1) / (chunks * m + p - 1), abs=1e-12)
    for r, ops in enumerate(s.ranks):
        warm = min(m * chunks, 2 * (p - 1 - r) + (chunks - 1) * p)
        assert all(op.kind == F for op in ops[:warm]) and (warm == m * chunks or ops[warm].kind == F)
        assert ops[warm + 1].kind == BW if warm < m * chunks else True
    assert sim.peak_activations[0] == min(m * chunks, 2 * (p - 1) + (chunks - 1) * p + 1)


def test_interleaved_needs_what_megatron_needs():
    with pytest.raises(ConfigError, match=r"needs microbatches >= 4"):
        registry.build("1f1b-interleaved", 4, 3)
    with pytest.raises(ConfigError, match=r"last group of 1 < pp=4.*group=9"):
        registry.build("1f1b-interleaved", 4, 9)
    registry.build("1f1b-interleaved", 4, 9, group=9)  # one group of all microbatches is allowed
    with pytest.raises(ConfigError, match=r"chunks >= 2"):
        registry.build("1f1b-interleaved", 4, 8, chunks=1)
    with pytest.raises(ConfigError, match=r"group=3.*\[pp=4"):
        registry.build("1f1b-interleaved", 4, 8, group=3)
    with pytest.raises(ConfigError, match=r"group=0.*\[pp=4"):
        registry.build("1f1b-interleaved", 4, 8, group=0)


@pytest.mark.parametrize("p, m", [(p, m) for p, m in SIZES if m >= p])
def test_zb_h1_bubble_and_memory(p, m):
    s = registry.build("zb-h1", p, m)
    sim = simulate(s)
    assert sim.bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert max(sim.peak_vs_1f1b) == 1.0
    assert s.split_backward


@pytest.mark.parametrize("p, m", [(p, m) for p, m in SIZES if m < p])
def test_zb_h1_with_few_microbatches_still_beats_1f1b(p, m):
    sim = simulate(registry.build("zb-h1", p, m))
    assert max(sim.peak_vs_1f1b) <= 1.0
    assert sim.bubble_rate < simulate(registry.build("1f1b", p, m)).bubble_rate


@pytest.mark.parametrize("p, m", SIZES)
def test_zb_h2_memory_and_bubble(p, m):
    h1, h2 = simulate(registry.build("zb-h1", p, m)), simulate(registry.build("zb-h2", p, m))
    assert max(h2.peak_vs_1f1b) <= 2.0
    # With all ranks starting together ZB-H1 is already optimal for m >= p (rank p-1 cannot
    # start before (p-1)F); ZB-H2 removes the start-up idle inside each rank's span.
    assert h2.bubble_rate <= h1.bubble_rate + 1e-12
    assert h2.span_bubble_rate <= h1.span_bubble_rate + 1e-12
    if m >= 2 * p:
        assert h2.span_bubble_rate < h1.span_bubble_rate
        assert h2.span_bubble_rate == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("costs", [Costs(2, 2.2, 1.6, 0.05), Costs(2, 2, 2, 0.25)], ids=str)
def test_zero_bubble_beats_1f1b_on_unequal_costs(costs):
    base = simulate(registry.build("1f1b", 8, 24, costs)).makespan
    h1 = simulate(registry.build("zb-h1", 8, 24, costs)).makespan
    h2 = simulate(registry.build("zb-h2", 8, 24, costs)).makespan
    assert h2 < h1 < base


def test_per_stage_costs_and_kinds():
    c = Costs(2, 2.2, 1.6, 0.05)
    assert registry.build("1f1b", 4, 8, c).costs == c
    assert registry.build("1f1b-interleaved", 4, 8, c).costs == c.per_stage(2)
    assert registry.build("1f1b-interleaved", 4, 8, c, chunks=4).costs == c.per_stage(4)
    kinds = {name: {op.kind for _, op in registry.build(name, 4, 8).ops()} for name in ("1f1b", "zb-h1", "zb-h2")}
    assert kinds == {"1f1b": {F, BW}, "zb-h1": {F, B, W}, "zb-h2": {F, B, W}}


@pytest.mark.parametrize("name", ["1f1b", "1f1b-interleaved", "zb-h1", "zb-h2"])
def test_sizes_and_options_are_checked(name):
    with pytest.raises(ConfigError, match=r"pp >= 2"):
        registry.build(name, 1, 8)
    with pytest.raises(ConfigError, match=r"microbatches >= "):
        registry.build(name, 4, 0)
    with pytest.raises(ConfigError, match=r"unknown option"):
        registry.build(name, 4, 8, colour="red")
