"""The papers' predictions next to the simulated figures: an exact prediction equals the
simulation, a bound holds, and outside a formula's conditions there is no number."""
import pytest

from megatron_vshape.cli import compare_rows
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.ops import Costs
from megatron_vshape.schedule.predictions import Prediction, predict

COSTS = [Costs(), Costs(2, 2.2, 1.6, 0), Costs(2, 2.2, 1.6, 0.05)]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("costs", COSTS, ids=str)
def test_predictions_match_or_bound_the_simulation(p, costs):
    for m in sorted({1, 2, p - 1, p, 2 * p + 1, 3 * p} - {0}):
        # Only the schedules with a figure to check here: planning the others (v-auto) proves nothing.
        names = [n for n in registry.names() if predict(n, p, m, costs) != Prediction()]
        for row in compare_rows(p, m, costs, names=names):
            if "error" in row:
                continue
            pred, where = row["prediction"], (row["schedule"], p, m)
            if pred["bubble_rate"] is not None:
                assert row["bubble_rate"] == pytest.approx(pred["bubble_rate"], abs=1e-9), where
            if pred["peak_vs_1f1b"] is not None:
                if pred["memory_is_bound"]:
                    assert row["peak_vs_1f1b"] <= pred["peak_vs_1f1b"] + 1e-9, where
                else:
                    assert row["peak_vs_1f1b"] == pytest.approx(pred["peak_vs_1f1b"], abs=1e-9), where


def test_v_zb_start_up_bound_needs_as_many_microbatches_as_stages():
    assert predict("v-zb", 8, 7).bubble_rate is None
    assert round(predict("v-zb", 8, 24).bubble_rate * 100, 2) == 4.64
    assert predict("v-zb", 8, 24, Costs(2, 2.2, 1.6, 0.05)).bubble_rate is None
