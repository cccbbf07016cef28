"""What the driver builds on GPUs, as a function of flags and of what is importable, and the
fp16 wiring of megatron-core's optimizer (its loss scale reaches backward_step)."""
from __future__ import annotations

import argparse
import itertools

import pytest
import torch

from megatron_vshape.integration import gpu_defaults
from megatron_vshape.integration.gpu_defaults import KERNELS, OFF, config_options, transformer_impl

ALL = sorted({m for mods in KERNELS.values() for m in mods})


def _args(rope=False):
    return argparse.Namespace(position_embedding_type="rope" if rope else "learned_absolute")


def test_cpu_keeps_every_fusion_off_whatever_is_installed():
    for rope in (False, True):
        assert config_options(_args(rope), gpu=False, has=lambda m: True) == OFF


@pytest.mark.parametrize("present", [set(c) for n in range(len(ALL) + 1) for c in itertools.combinations(ALL, n)])
def test_gpu_turns_on_each_fusion_exactly_where_its_kernels_exist(present):
    opts = config_options(_args(rope=True), gpu=True, has=present.__contains__)
    assert opts["bias_dropout_fusion"] and opts["bias_activation_fusion"] and opts["deallocate_pipeline_outputs"]
    softmax = {"scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"}
    assert opts["masked_softmax_fusion"] == (softmax <= present)
    assert opts["persist_layer_norm"] == ("apex.contrib.layer_norm.layer_norm" in present)
    assert opts["apply_rope_fusion"] == ("transformer_engine" in present)
    assert opts["gradient_accumulation_fusion"] == ("fused_weight_gradient_mlp_cuda" in present)
    # RoPE fusion only with rotary embeddings.
    assert not config_options(_args(rope=False), gpu=True, has=present.__contains__)["apply_rope_fusion"]


def test_the_options_build_a_transformer_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    for gpu in (False, True):  # none of the kernels here: what a GPU without TE/apex gets
        cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2,
                                **config_options(_args(), gpu, has=gpu_defaults.importable))
        assert cfg.deallocate_pipeline_outputs == gpu and not cfg.gradient_accumulation_fusion


def test_transformer_impl_default():
    two_three = (2, 3)
    assert transformer_impl("local", True, (2, 8), True, two_three) == "local"  # a flag is kept
    assert transformer_impl("transformer_engine", False, None, False, two_three) == "transformer_engine"
    assert transformer_impl(None, False, (2, 8), False, two_three) == "local"  # CPU
    assert transformer_impl(None, True, None, False, two_three) == "local"  # no TE
    assert transformer_impl(None, True, (2, 8), True, two_three) == "transformer_engine"
    assert transformer_impl(None, True, (2, 1), True, two_three) == "local"  # too old to split
    assert transformer_impl(None, True, (2, 1), False, two_three) == "transformer_engine"


class _ScaledOptimizer:
    """Test double of megatron-core's MegatronOptimizer for what the wiring uses: its real
    scale_loss (loss times get_loss_scale()), with the scale of a dynamic fp16 scaler."""

    def __init__(self, scale):
        self.scale = torch.tensor([scale])

    def get_loss_scale(self):
        return self.scale


def test_megatron_optimizer_wiring_scales_the_loss_in_backward_step():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from megatron.core.pipeline_parallel.schedules import backward_step

    from megatron_vshape.integration.train import use_megatron_optimizer

    _ScaledOptimizer.scale_loss = MegatronOptimizer.scale_loss
    chunk = torch.nn.Linear(3, 1)
    chunk.no_sync = lambda: None
    optimizer, grads = _ScaledOptimizer(2.0 ** 16), []
    config = ModelParallelConfig()
    use_megatron_optimizer(config, [chunk], optimizer, finalize_model_grads=print)
    assert config.grad_scale_func == optimizer.scale_loss and config.no_sync_func is chunk.no_sync
    for cfg in (ModelParallelConfig(), config):  # unscaled, then wired
        chunk.zero_grad()
        loss = chunk(torch.ones(1, 3)).sum()
        backward_step(None, loss, None, None, cfg)  # what the executor calls for the last stage
        grads.append(chunk.weight.grad.clone())
    assert torch.equal(grads[1], grads[0] * 2.0 ** 16)


# ---- flags the GPU path cannot honour: refused at validation, naming the value and the fix ----

def _pipeline_args(schedule, **megatron):
    from megatron_vshape.integration.args import add_pipeline_arguments

    ns = add_pipeline_arguments(argparse.ArgumentParser()).parse_args(["--pipeline-schedule", schedule])
    sizes = dict(num_layers=8, pipeline_model_parallel_size=2, tensor_model_parallel_size=2, micro_batch_size=1,
                 global_batch_size=8, world_size=4, transformer_impl="local")
    for k, v in {**sizes, **megatron}.items():
        setattr(ns, k, v)
    return ns


@pytest.mark.parametrize("schedule, flags, env, words", [
    ("v-half", dict(timing_log_level=2), "1", ["--timing-log-level=2", "hangs", "--timing-log-level 1"]),
    ("1f1b", dict(timing_log_level=2), "1", ["--timing-log-level=2"]),
    ("zb-h1", dict(tp_comm_overlap=True), "1", ["--tp-comm-overlap", "W ops", "unset --tp-comm-overlap"]),
    ("1f1b", dict(sequence_parallel=True), None, ["CUDA_DEVICE_MAX_CONNECTIONS=unset", "--sequence-parallel",
                                                  "export CUDA_DEVICE_MAX_CONNECTIONS=1"]),
    ("v-zb", dict(sequence_parallel=True), "8", ["CUDA_DEVICE_MAX_CONNECTIONS=8"]),
    ("v-half", dict(check_for_nan_in_loss_and_grad=True, distributed_backend="nccl"), "1",
     ["--check-for-nan-in-loss-and-grad", "hangs", "pass --no-check-for-nan-in-loss-and-grad"]),
    ("1f1b", dict(check_for_spiky_loss=True, distributed_backend="nccl"), "1",
     ["--check-for-spiky-loss", "unset --check-for-spiky-loss"]),
])
def test_gpu_flag_combinations_are_refused(monkeypatch, schedule, flags, env, words):
    from megatron_vshape.integration.args import validate_pipeline_args
    from megatron_vshape.schedule.errors import ConfigError

    if env is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", env)
    with pytest.raises(ConfigError) as e:
        validate_pipeline_args(_pipeline_args(schedule, **flags))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_gpu_flag_combinations_that_are_fine(monkeypatch):
    from megatron_vshape.integration.args import validate_pipeline_args

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert validate_pipeline_args(_pipeline_args("v-half", sequence_parallel=True, timing_log_level=1))
    assert validate_pipeline_args(_pipeline_args("1f1b", tp_comm_overlap=True))  # no W: TE's overlap applies
    # gloo (Megatron-LM's --distributed-backend gloo on CPU) has no posted receive kernels to wait for
    assert validate_pipeline_args(_pipeline_args("v-half", check_for_nan_in_loss_and_grad=True,
                                                 distributed_backend="gloo"))
    # the driver (no distributed_backend): its own check reads the loss after the step
    assert validate_pipeline_args(_pipeline_args("v-half", check_for_nan_in_loss_and_grad=True))
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert validate_pipeline_args(_pipeline_args("v-half", tensor_model_parallel_size=1, world_size=2,
                                                 sequence_parallel=True))
