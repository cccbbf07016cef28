"""scripts/bench/cpu_pipeline.py and megatron_vshape/testing/timed_steps.py: a row's figures come
from one step, and a row whose makespan exceeds its step time is refused (it would mean two clocks
were mixed); the simulator's prediction is fed with that step's measured per-stage costs."""
import pytest
from bench_scripts import load_bench

from megatron_vshape.testing import timed_steps


@pytest.fixture(scope="module")
def bench():
    return load_bench("cpu_pipeline")


def test_the_row_uses_the_median_step():
    assert timed_steps.median_step([0.40, 0.30, 0.35]) == 2
    assert timed_steps.median_step([0.30, 0.50, 0.41, 0.35]) == 3  # the lower median of an even count
    # makespan from the same step as the step time: all ops of one step lie inside it
    ops = [[("F", 0, 0, 0.001, 0.100), ("B", 0, 0, 0.150, 0.300)], [("F", 0, 1, 0.100, 0.200)]]
    makespan, bubble = timed_steps.measured(ops)
    assert makespan == pytest.approx(0.299) and bubble == pytest.approx(1 - 0.249 / 0.299)


def _step(schedule, costs, t0=0.0):
    """Every rank's ops of one step of `schedule` run exactly as simulated under per-stage `costs`."""
    import dataclasses

    from megatron_vshape.schedule.simulate import simulate

    sim = simulate(dataclasses.replace(schedule, stage_costs=costs))
    return [[(op.kind, op.microbatch, op.stage, t0 + a, t0 + b) for op, a, b in row] for row in sim.timeline], sim


def test_figures_come_from_the_median_step_and_simulate_its_measured_costs():
    from megatron_vshape.schedule import registry
    from megatron_vshape.schedule.ops import StageCost

    schedule = registry.build("v-zb", 2, 4)
    fast = (StageCost(1.0, 1.0, 1.0),) * 4
    slow = (StageCost(2.0, 1.5, 1.0), StageCost(1.0, 1.0, 1.0), StageCost(1.0, 1.0, 1.0), StageCost(3.0, 3.0, 2.0))
    (ops_fast, _), (ops_slow, sim_slow) = _step(schedule, fast), _step(schedule, slow)
    # rank r's results: step 1 (the median of three) ran under the slow costs
    per_rank = [{"times": [10.0, 20.0, 30.0], "ops": [ops_fast[r], ops_slow[r], ops_fast[r]], "peak": 100 + r}
                for r in range(2)]
    f = timed_steps.figures(per_rank, schedule)
    assert f["step_s"] == 20.0 and f["peak_bytes"] == [100, 101]
    assert [tuple(round(x, 9) for x in (c.F, c.B, c.W)) for c in f["stage_costs"]] == [(c.F, c.B, c.W) for c in slow]
    assert f["sim_s"] == pytest.approx(sim_slow.makespan) == pytest.approx(f["makespan_s"])
    assert f["bubble"] == pytest.approx(sim_slow.bubble_rate) == pytest.approx(f["sim_bubble"])
    other = dict(f, step_s=40.0, bubble=0.5, sim_s=1.0)
    med = timed_steps.median_over([f, other, dict(f, step_s=30.0)])
    assert med["step_s"] == 30.0 and med["launches"] == 3 and med["peak_bytes"] == [100, 101]


def test_rotated_lets_every_case_run_first_once():
    cases = ["1f1b", "v-half", "v-zb"]
    assert [timed_steps.rotated(cases, k)[0] for k in range(3)] == cases
    assert sorted(timed_steps.rotated(cases, 4)) == sorted(cases)


def test_an_inconsistent_row_is_refused(bench):
    row = {"schedule": "v-half", "pp": 2, "step_ms": 354.9, "makespan_ms": 414.9}
    with pytest.raises(RuntimeError, match="makespan 414.9 ms > step 354.9 ms"):
        bench.check_row(row)
    ok = dict(row, makespan_ms=350.0)
    assert bench.check_row(ok) is ok
    assert bench.check_row({"schedule": "torch-zbv", "pp": 2, "step_ms": 10.0}) is not None  # no op times
