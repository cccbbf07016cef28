"""The Megatron-LM hook's get_model under a split schedule with Transformer Engine layers (#35 item 1).

Megatron-LM builds each chunk's TransformerConfig from args (megatron-core 0.16 refuses
delay_wgrad_compute there without MoE overlap), calls the model provider, and then copies args into
the DistributedDataParallelConfig.  This test stands in for that sequence of Megatron-LM's get_model
(the real one needs CUDA) and checks what the hook arranges: TE layers are built from a config that
says delay_wgrad_compute, no config is ever constructed from args that say it, DDP's config says it,
and args are left as they were.
"""
import argparse
import sys
import types

import pytest

from megatron_vshape.integration import megatron_lm
from megatron_vshape.integration.args import add_pipeline_arguments, validate_pipeline_args


def _plan(name):
    args = add_pipeline_arguments(argparse.ArgumentParser()).parse_args(["--pipeline-schedule", name])
    for k, v in dict(num_layers=8, pipeline_model_parallel_size=2, micro_batch_size=1, global_batch_size=4,
                     world_size=2).items():
        setattr(args, k, v)
    return validate_pipeline_args(args)


@pytest.fixture
def megatron_lm_like(monkeypatch):
    """Megatron-LM's args, config-from-args (refusing delay_wgrad_compute as megatron-core 0.16 does) and
    a get_model with its order of steps: provider per chunk, then the DDP config copied from args."""
    args = argparse.Namespace(transformer_impl="transformer_engine", delay_wgrad_compute=False)
    seen = {"configs": [], "ddp": None}

    def config_from_args():
        if args.delay_wgrad_compute:
            raise AssertionError("overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute")
        config = types.SimpleNamespace(delay_wgrad_compute=False)
        seen["configs"].append(config)
        return config

    def get_model(provider, model_type=None, wrap_with_ddp=True, config=None, pg_collection=None):
        model = [provider(pre_process=True, post_process=True, config=config, pg_collection=pg_collection)]
        seen["ddp"] = args.delay_wgrad_compute  # Megatron-LM: DistributedDataParallelConfig(**fields of args)
        return model

    get_model.__module__ = "megatron_lm_like_training"
    monkeypatch.setitem(sys.modules, "megatron_lm_like_training", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "megatron.training", types.SimpleNamespace(get_args=lambda: args))
    monkeypatch.setattr(megatron_lm, "_config_from_args", config_from_args)
    return args, seen, megatron_lm._get_model(get_model)


def _provider(built):
    def provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        if config is None:  # as Megatron-LM's model_provider
            config = megatron_lm._config_from_args()
        built.append(config.delay_wgrad_compute)  # what TE layers read when they are made
        return object()
    return provider


def test_te_layers_are_built_to_defer_and_ddp_takes_their_hooks(monkeypatch, megatron_lm_like):
    args, seen, get_model = megatron_lm_like
    monkeypatch.setattr(megatron_lm, "_plan", _plan("zb-h1"))
    built = []
    get_model(_provider(built))
    assert built == [True] and seen["configs"][0].delay_wgrad_compute
    assert seen["ddp"] is True
    assert args.delay_wgrad_compute is False


@pytest.mark.parametrize("name,impl", [("1f1b", "transformer_engine"), ("zb-h1", "local")])
def test_without_w_or_without_te_nothing_changes(monkeypatch, megatron_lm_like, name, impl):
    args, seen, get_model = megatron_lm_like
    args.transformer_impl = impl
    monkeypatch.setattr(megatron_lm, "_plan", _plan(name))
    built = []
    get_model(_provider(built))
    assert built == [False] and seen["ddp"] is False
