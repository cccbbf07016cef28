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


def test_any_layer_count_on_every_placement():
    """Layers that do not divide: the remainder goes to the middle stages, numbered as unpipelined."""
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType

    tiny = TinyGPT(num_layers=6)
    for placement, want in ((Placement("loop", 2, 2), (1, 2, 2, 1)), (Placement("v", 2, 2), (1, 2, 2, 1)),
                            (Placement("single", 4, 1), (1, 2, 2, 1))):
        layout = chunk_config(tiny.transformer_config(pp=placement.pp), placement).pipeline_model_parallel_layout
        # megatron-core's layout reads the virtual pipeline size from parallel_state
        parallel_state.set_virtual_pipeline_model_parallel_world_size(placement.chunks if placement.chunks > 1 else None)
        for stage in range(placement.num_stages):
            rank, chunk = placement.rank_of(stage), placement.chunk_of(stage)
            vp = chunk if placement.chunks > 1 else None
            assert layout.layout[rank][chunk].count(LayerType.decoder) == want[stage], placement
            assert layout.get_layer_offset(LayerType.decoder, vp_stage=vp, pp_rank=rank) == sum(want[:stage]), placement
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def test_megatron_split_flags_mean_the_v_ends():
    """decoder_first/last on the V: stage 0 and stage 2p-1 (both rank 0); the rest spread evenly."""
    config = TinyGPT(num_layers=12).transformer_config(pp=4, num_layers_in_first_pipeline_stage=1,
                                                        num_layers_in_last_pipeline_stage=1)
    v = chunk_config(config, Placement("v", 4, 2)).pipeline_model_parallel_layout
    assert v.stage_layers == (1, 1, 2, 2, 2, 2, 1, 1)  # 10 over 6: the two extra in the middle
    given = chunk_config(TinyGPT(num_layers=7).transformer_config(pp=2), Placement("v", 2, 2), (3, 1, 2, 1))
    assert given.pipeline_model_parallel_layout.stage_layers == (3, 1, 2, 1)
    assert given.num_layers_in_first_pipeline_stage is None


def test_bad_layouts_and_placements():
    tiny = TinyGPT(num_layers=6)
    with pytest.raises(ConfigError, match=r"sums to 5 layers but --num-layers=6"):
        chunk_config(tiny.transformer_config(pp=2), Placement("v", 2, 2), (1, 1, 2, 1))
    with pytest.raises(ConfigError, match=r"stage 1 has no layers"):
        chunk_config(tiny.transformer_config(pp=2), Placement("v", 2, 2), (3, 0, 2, 1))
    with pytest.raises(ConfigError, match="needs pp >= 2"):
        chunk_config(tiny.transformer_config(pp=1), Placement("v", 1, 2))
