"""build_model_chunks with megatron-core's own layer specs, as the driver and gpu_check pass them on GPUs (the CPU
tests use the CPU spec factory): a ModuleSpec is callable too, and must be used as the spec, not called."""
from __future__ import annotations

import pytest

from megatron_vshape.runtime.chunks import build_model_chunks
from megatron_vshape.schedule.ops import Placement


def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                             pipeline_dtype=None)


@pytest.mark.parametrize("kind", ["local", "transformer_engine"])
def test_megatron_layer_specs_are_used_as_specs(megatron_world, kind):
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if kind == "transformer_engine":
        pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed (GPU clusters only)")
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec()
    chunks = build_model_chunks(_config(), Placement("single", 1), vocab_size=32, max_sequence_length=8,
                                transformer_layer_spec=spec, pp_rank=0)
    layers = chunks[0].decoder.layers
    assert len(layers) == 2 and all(isinstance(layer, TransformerLayer) for layer in layers)
