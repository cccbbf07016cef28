"""Every megatron-core difference the runtime adapts to, in one place.

Adapted by feature (a signature, an attribute), never by version string; each difference names the
release that brought it.  The version is read only to refuse a release nobody has tested, at
start-up (executor construction, the driver, install()), in one line.

  release  difference                                                     adapted in
  -------  -------------------------------------------------------------  ---------------------------
  0.17.0   pipeline_parallel.schedules.backward_step drops `model_type`   backward_step()
           (input_tensor, output_tensor, output_tensor_grad, config)
  0.19.0   the tensor-parallel linear function takes `gtp_remat_size`      linear_options() (wgrad)
           (default 1: no rematerialisation)
  0.20.0*  it also takes `output_dtype` (default None: the input's dtype)   linear_options() (wgrad)
  * 0.20.0 as Megatron-LM main carries it (commit d98e8a6); not on the package index yet.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Optional, Tuple

from ..schedule.errors import ConfigError

# Releases the tests have run on: 0.16.1, 0.17.1, 0.18.2, 0.19.2 from the package index (0.16.1 and
# 0.19.2 on every CI run), 0.16.0 to 0.20.0 as the Megatron-LM tags of README's table carry them.
TESTED_FIRST, TESTED_LAST = (0, 16, 0), (0, 20, 0)
TESTED_RANGE = "0.16.0 to 0.20.0"

# Keywords of forward_step the executor relies on: the stage that computes the loss is decided by the
# schedule (rank 0 in the V), not by parallel_state, so is_last_stage must be passable; cp_group_size
# comes with it (megatron-core asserts both or neither).  All present since 0.16.0.
FORWARD_STEP_KEYWORDS = ("cp_group_size", "collect_non_loss_data", "is_first_microbatch", "current_microbatch",
                         "is_last_stage")
_BACKWARD_STEP_ARGS = ("input_tensor", "output_tensor", "output_tensor_grad", "config")


def release() -> str:
    from megatron.core.package_info import __version__

    return __version__


def _parse(version: str) -> Optional[Tuple[int, int, int]]:
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in found.groups()) if found else None


def check_release(version: Optional[str] = None) -> str:
    """The installed megatron-core release; ConfigError in one line when it is outside the tested range."""
    version = version or release()
    parsed = _parse(version)
    if parsed is None or not TESTED_FIRST <= parsed <= TESTED_LAST:
        raise ConfigError(f"megatron-core {version} is outside the range megatron_vshape is tested with "
                          f"({TESTED_RANGE}); install one of those (e.g. pip install megatron-core==0.19.2)")
    return version


@functools.lru_cache(maxsize=None)
def megatron_steps():
    """megatron-core's (forward_step, backward_step, check_first_val_step), their signatures checked up front;
    the backward_step returned takes (input, output, grad, model_type, config) on every release."""
    from megatron.core.pipeline_parallel import schedules

    version = check_release()
    params = inspect.signature(schedules.forward_step).parameters
    missing = [k for k in FORWARD_STEP_KEYWORDS if k not in params]
    backward = list(inspect.signature(schedules.backward_step).parameters)
    takes_model_type = backward[:3] + backward[4:] == list(_BACKWARD_STEP_ARGS) and backward[3:4] == ["model_type"]
    if missing or not (takes_model_type or backward == list(_BACKWARD_STEP_ARGS)):
        raise ConfigError(f"megatron-core {version}: pipeline_parallel.schedules.forward_step takes "
                          f"{', '.join(params)} and backward_step {', '.join(backward)}; megatron_vshape needs "
                          f"forward_step keywords {', '.join(FORWARD_STEP_KEYWORDS)} (tested: {TESTED_RANGE})")
    if takes_model_type:  # before 0.17.0
        backward_step = schedules.backward_step
    else:  # 0.17.0 and later: model_type is gone
        def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
            return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)
    linear_defaults()  # the linear function's signature, checked now rather than inside a B
    return schedules.forward_step, backward_step, schedules.check_first_val_step


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """megatron-core's backward_step on any tested release (model_type is dropped from 0.17.0 on)."""
    return megatron_steps()[1](input_tensor, output_tensor, output_tensor_grad, model_type, config)


@functools.lru_cache(maxsize=None)
def linear_defaults() -> dict:
    """Defaults of megatron-core's linear_with_grad_accumulation_and_async_allreduce's keywords."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce as linear

    return {k: p.default for k, p in inspect.signature(linear).parameters.items()
            if p.default is not inspect.Parameter.empty}


def linear_options(call: dict, implemented) -> dict:
    """The options of one call of the linear function that the B/W split does not implement and that
    change its result: those not in `implemented`, passed with a value other than megatron-core's default
    (None means the default everywhere).  gtp_remat_size=1 (0.19.0) and output_dtype=None (0.20.0) pass."""
    defaults = linear_defaults()
    return {k: v for k, v in call.items()
            if k not in implemented and v is not None and not (k in defaults and v == defaults[k])}
