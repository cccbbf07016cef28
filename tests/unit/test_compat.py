"""runtime.compat on the installed megatron-core (0.16.1 in .venv, 0.19.2 in .venv-mcore019: `make test` runs
this file in both): the release gate, backward_step with or without model_type, the linear function's options."""
from __future__ import annotations

import inspect

import pytest
import torch

from megatron_vshape.runtime import compat
from megatron_vshape.schedule.errors import ConfigError


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", "0.17.1", "0.18.2", "0.19.2", "0.19.2+7543cb3", "0.20.0"])
def test_tested_releases_pass(version):
    assert compat.check_release(version) == version


@pytest.mark.parametrize("version", ["0.15.3", "0.20.1", "0.21.0rc0", "1.0.0", "dev"])
def test_an_untested_release_is_refused_in_one_line_naming_it_and_the_range(version):
    with pytest.raises(ConfigError) as e:
        compat.check_release(version)
    message = str(e.value)
    assert "\n" not in message and f"megatron-core {version} " in message and compat.TESTED_RANGE in message


def test_the_installed_release_is_in_range_and_its_steps_are_adapted():
    from megatron.core.pipeline_parallel import schedules

    compat.check_release()
    forward, backward, _ = compat.megatron_steps()
    assert forward is schedules.forward_step
    # One signature for the executor on every release: model_type is passed, and dropped from 0.17.0 on.
    assert list(inspect.signature(backward).parameters)[3] == "model_type"
    takes_model_type = "model_type" in inspect.signature(schedules.backward_step).parameters
    assert (backward is schedules.backward_step) == takes_model_type


def test_backward_step_runs_megatron_cores_own_on_this_release():
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum()
    compat.backward_step(None, y, None, None, config)  # the last stage: no input gradient to return
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_linear_options_pass_megatron_cores_defaults_and_name_the_rest():
    defaults = compat.linear_defaults()
    implemented = ("input", "weight", "bias")
    assert compat.linear_options({"input": 1, "grad_output_buffer": None}, implemented) == {}
    assert compat.linear_options({"newer_option": 3}, implemented) == {"newer_option": 3}
    if "gtp_remat_size" in defaults:  # megatron-core 0.19.0 and later
        assert compat.linear_options({"gtp_remat_size": 1}, implemented) == {}
        assert compat.linear_options({"gtp_remat_size": 2}, implemented) == {"gtp_remat_size": 2}
