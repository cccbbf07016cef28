"""The divergence policy's decisions without a run: what stops, what is counted, what the summary's
status says (fp16 loss scaling's skips, which CPU runs cannot produce, included)."""
import json
import math

from megatron_vshape.integration.divergence import Counters, json_safe


def test_checking_stops_on_a_non_finite_loss_before_the_update_and_on_a_non_finite_norm():
    c = Counters(check=True)
    assert c.check_loss(3, 4.2, 1e-3) is None
    message = c.check_loss(3, math.nan, 1e-3)
    assert message.startswith("iteration 3: lm loss is nan (learning rate 0.001): training diverged")
    assert "lower --lr" in message and "--no-check-for-nan-in-loss-and-grad" in message
    assert c.record(4, 4.2, math.inf, False, 1e-3).startswith("iteration 4: grad norm is inf")


def test_fp16_loss_scale_skips_are_counted_not_stopped_on_and_keep_the_status_ok():
    c = Counters(check=True, fp16=True)
    assert c.check_loss(1, math.inf, 1e-4) is None  # an fp16 forward overflow: the loss scaler skips the step
    assert c.record(1, 10.5, None, False, 1e-4) is None  # megatron-core's optimizer: overflow -> (False, None)
    assert c.record(2, 10.4, 1.5, True, 1e-4) is None
    assert (c.skipped, c.nan, c.status()) == (1, 0, "ok")
    assert c.take_window() == (1, 0) and c.take_window() == (0, 0)


def test_without_checking_nan_steps_are_skipped_counted_and_named_in_the_status():
    c = Counters(check=False)
    assert c.check_loss(2, math.nan, 1.0) is None and c.record(2, math.nan, math.nan, False, 1.0) is None
    assert c.record(3, 5.0, 2.0, True, 1.0) is None
    assert c.status() == "ok with 1 skipped and 1 nan iteration(s)"


def test_metrics_are_strict_json():
    record = json_safe({"loss": math.nan, "grad_norm": math.inf, "peak": [1.0, -math.inf], "n": 3})
    assert json.dumps(record, allow_nan=False) == '{"loss": null, "grad_norm": null, "peak": [1.0, null], "n": 3}'
