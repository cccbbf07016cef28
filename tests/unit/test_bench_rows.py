"""scripts/bench/cpu_pipeline.py: a row's figures come from one step, and a row whose makespan
exceeds its step time is refused (it would mean two clocks were mixed)."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cpu_pipeline", os.path.join(ROOT, "scripts", "bench", "cpu_pipeline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_row_uses_the_median_step(bench):
    assert bench.median_step([0.40, 0.30, 0.35]) == 2
    assert bench.median_step([0.30, 0.50, 0.41, 0.35]) == 3  # the lower median of an even count
    # makespan from the same step as the step time: all ops of one step lie inside it
    ops = [[("F", 0, 0, 0.001, 0.100), ("B", 0, 0, 0.150, 0.300)], [("F", 0, 1, 0.100, 0.200)]]
    makespan, bubble, mean = bench._measured(ops)
    assert makespan == pytest.approx(0.299) and 0 < bubble < 1 and set(mean) == {"F", "B"}


def test_an_inconsistent_row_is_refused(bench):
    row = {"schedule": "v-half", "pp": 2, "step_ms": 354.9, "makespan_ms": 414.9}
    with pytest.raises(RuntimeError, match="makespan 414.9 ms > step 354.9 ms"):
        bench.check_row(row)
    ok = dict(row, makespan_ms=350.0)
    assert bench.check_row(ok) is ok
    assert bench.check_row({"schedule": "torch-zbv", "pp": 2, "step_ms": 10.0}) is not None  # no op times
