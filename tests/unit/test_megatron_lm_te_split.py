"""The Megatron-LM hook's get_model under a split schedule with Transformer Engine layers (#35 item 1).

Megatron-LM builds each chunk's TransformerConfig from args (megatron-core 0.16 refuses
delay_wgrad_compute there without MoE overlap), calls the model provider, and then copies args into
the DistributedDataParallelConfig.  This test stands in for that sequence of Megatron-LM's get_model
(the real one needs CUDA) and checks what the hook arranges: TE layers are built from a config that
says delay_wgrad_compute, no config is ever constructed from args that say it, DDP's config says it,
and args are left as they were.
"""
import argparse
import dataclasses
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


@dataclasses.dataclass
class _DDPConfig:  # the field megatron-core's DistributedDataParallelConfig has (0.16 and 0.19)
    delay_wgrad_compute: bool = False


class _Float16Module:  # Megatron's fp16/bf16 wrapper: the default build_distributed_models is bound to
    def __init__(self, config, module):
        self.module = module


class _GPTModelBuilder:
    """core_v0.19's config-container path as GPTModelBuilder runs it (the real one needs CUDA): build_model per
    stage from the builder's own TransformerConfig, then the fp16/bf16 wrapper and DDP config given as arguments,
    never read from training's globals or from args."""

    def __init__(self, config):
        self._model_config = types.SimpleNamespace(transformer=config)
        self.seen = {}

    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        return types.SimpleNamespace(defers=self._model_config.transformer.delay_wgrad_compute)

    def build_distributed_models(self, pg_collection, ddp_config=None, wrap_with_ddp=True,
                                 mixed_precision_wrapper=_Float16Module):
        model = [self.build_model(pg_collection, pre_process=True, post_process=True)]
        self.seen = {"wrapper": mixed_precision_wrapper, "ddp": ddp_config.delay_wgrad_compute}
        return model


@pytest.fixture
def builder_path(monkeypatch):
    args = argparse.Namespace(transformer_impl="transformer_engine", delay_wgrad_compute=False)
    monkeypatch.setitem(sys.modules, "megatron.training", types.SimpleNamespace(get_args=lambda: args))
    cls = type("Builder", (_GPTModelBuilder,), {})
    cls.build_model = megatron_lm._build_model(_GPTModelBuilder.build_model)
    cls.build_distributed_models = megatron_lm._build_distributed_models(_GPTModelBuilder.build_distributed_models)
    return args, cls(types.SimpleNamespace(delay_wgrad_compute=False))


def test_builder_path_defers_te_wgrad_and_ddp_takes_their_hooks(monkeypatch, builder_path):
    """The config-container path (core_v0.19 on) arranges what get_model's does: before, its TE layers computed
    their weight gradients in B and the executor refused the run at the first step."""
    args, builder = builder_path
    monkeypatch.setattr(megatron_lm, "_plan", _plan("zb-h1"))
    ddp = _DDPConfig()
    model = builder.build_distributed_models(None, ddp_config=ddp)
    assert [m.defers for m in model] == [True]
    assert builder.seen == {"wrapper": _Float16Module, "ddp": True}  # not the V: Megatron's own wrapper
    assert ddp.delay_wgrad_compute is False and args.delay_wgrad_compute is False  # the caller's left as they were


@pytest.mark.parametrize("name,impl", [("1f1b", "transformer_engine"), ("zb-h1", "local")])
def test_builder_path_without_w_or_without_te_nothing_changes(monkeypatch, builder_path, name, impl):
    args, builder = builder_path
    args.transformer_impl = impl
    monkeypatch.setattr(megatron_lm, "_plan", _plan(name))
    model = builder.build_distributed_models(None, ddp_config=_DDPConfig())
    assert [m.defers for m in model] == [False] and builder.seen == {"wrapper": _Float16Module, "ddp": False}
