"""The V layer layout in megatron-core's terms, without spawning ranks: offsets and counts per
(pp rank, vp stage) follow the V, and megatron-core's own interleaved arithmetic is untouched."""
import pytest

from megatron_vshape.runtime.chunks import VShapeLayerLayout, chunk_config
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Placement
from megatron_vshape.testing.tiny_gpt import TinyGPT


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_v_layout_offsets_follow_the_v(pp):
    from megatron.core.transformer.enums import LayerType

    per_stage = 3
    layout = VShapeLayerLayout(pp, 2 * pp * per_stage)
    v = Placement("v", pp, 2)
    for rank in range(pp):
        for chunk, stage in enumerate(v.stages_of(rank)):
            assert layout.get_layer_offset(LayerType.decoder, vp_stage=chunk, pp_rank=rank) == stage * per_stage
            assert layout.layout[rank][chunk].count(LayerType.decoder) == per_stage
    # Embedding first and loss last in model order, both on rank 0 (chunks 0 and 1).
    assert layout.flatten_layout[0] == LayerType.embedding and layout.flatten_layout[-1] == LayerType.loss
    assert layout.layout[0][0][0] == LayerType.embedding and layout.layout[0][1][-1] == LayerType.loss
    layout.validate_layer_layout(num_layers=2 * pp * per_stage, mtp_num_layers=None)


def test_chunk_config_sets_v_layout_only_for_v():
    tiny = TinyGPT(num_layers=8)
    v = chunk_config(tiny.transformer_config(pp=2), Placement("v", 2, 2))
    assert isinstance(v.pipeline_model_parallel_layout, VShapeLayerLayout)
    assert v.virtual_pipeline_model_parallel_size == 2
    loop = chunk_config(tiny.transformer_config(pp=2), Placement("loop", 2, 2))
    assert loop.pipeline_model_parallel_layout is None and loop.virtual_pipeline_model_parallel_size == 2
    single = chunk_config(tiny.transformer_config(pp=2), Placement("single", 2, 1))
    assert single.pipeline_model_parallel_layout is None and single.virtual_pipeline_model_parallel_size is None


def test_loop_offsets_are_megatron_interleaved_ones():
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = chunk_config(TinyGPT(num_layers=8).transformer_config(pp=2), Placement("loop", 2, 2))
    offsets = {(r, c): get_transformer_layer_offset(config, vp_stage=c, pp_rank=r) for r in range(2) for c in range(2)}
    assert offsets == {(0, 0): 0, (1, 0): 2, (0, 1): 4, (1, 1): 6}


def test_loop_and_single_errors_name_the_stages():
    tiny = TinyGPT(num_layers=6)
    with pytest.raises(ConfigError, match=r"num_layers=6 is not divisible by 4 stages \(pp=2 x 2 chunks\); use 8"):
        chunk_config(tiny.transformer_config(pp=2), Placement("loop", 2, 2))
    with pytest.raises(ConfigError, match="needs pp >= 2"):
        chunk_config(tiny.transformer_config(pp=1), Placement("v", 1, 2))
