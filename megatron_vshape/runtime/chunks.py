"""This rank's megatron-core GPTModel chunks for a placement (single, loop or v).

How V-shape layer numbers work.  megatron-core numbers a chunk's layers with
`get_transformer_layer_offset(config, vp_stage)`, and both it and `get_num_layers_to_build` defer
to `config.pipeline_model_parallel_layout` when one is set.  Its stock layout enumerates stages in
loop order (stage = vp_stage * p + pp_rank).  For the V we install `VShapeLayerLayout`, a subclass
whose offset for (pp_rank, vp_stage) is the layer count of all stages before the V stage
`placement.stage_of(pp_rank, vp_stage)` (chunk 1 of rank r holds stage 2p-1-r).  So layer
numbers, and the keys of Megatron's sharded (checkpoint) state dict, equal the non-pipelined
model's, and every megatron-core code path that asks for offsets agrees.  The interleaved (loop)
placement uses megatron-core's own virtual-pipeline arithmetic unchanged.  Stages need not be equal
(`stage_layers`, schedule/layout.py): the V's layout takes any count per stage, and single/loop
placements whose layers do not split as megatron-core's arithmetic would get megatron-core's own
layout object built from the same counts (its stage i sits on rank i % p, chunk i // p, as ours).

Inside megatron-core a V run needs virtual_pipeline_model_parallel_size=2 (in parallel_state and
the config, so chunks pass vp_stage 0/1), and an embedding group holding only the first pipeline
rank (`embedding_ranks_for`): the embedding (stage 0) and the output layer (stage 2p-1) both live on
rank 0, so tied weights are ONE parameter there, owned by chunk 0; chunk 1 borrows it for its output
layer without registering it, so optimizers and DDP see it once, its gradient sums both uses through
autograd, and finalize_model_grads' embedding all-reduce is a no-op (group of one).  Chunk 1 lists it
in `borrowed_parameters`, so the executor keeps chunk 0's grad sync open until chunk 1's last
contribution (its output layer's last W).
"""
from __future__ import annotations

import copy
import re
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.module import Float16Module, float16_to_fp32

from ..schedule import layout
from ..schedule.errors import ConfigError
from ..schedule.ops import Placement

try:  # megatron-core releases without layer layouts cannot number the V's layers; the V says so when built
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
except ImportError:  # pragma: no cover - depends on the megatron-core release
    PipelineParallelLayerLayout = None


class VShapeLayerLayout(PipelineParallelLayerLayout or object):
    """megatron-core layer layout for the V placement: `layers[s]` decoder layers on stage s (default
    an even split), embedding in stage 0, loss in stage 2p-1, stages ordered along the V."""

    def __init__(self, pp: int, num_layers: int, layers: Optional[Sequence[int]] = None):
        if PipelineParallelLayerLayout is None:
            from megatron.core.package_info import __version__

            raise ConfigError(f"megatron-core {__version__} has no transformer.pipeline_parallel_layer_layout, "
                              "which the V placement needs to number its layers; use megatron-core >= 0.16")
        self.placement = Placement("v", pp, 2)
        self.pipeline_model_parallel_size = pp
        self.virtual_pipeline_model_parallel_size = 2
        self.stage_layers = tuple(layers) if layers is not None else layout.even(num_layers, 2 * pp)
        self.input_data = f"v-shape(pp={pp}, layers per stage {','.join(map(str, self.stage_layers))})"
        by_stage = _types_by_stage(self.stage_layers)
        self.layout = [[by_stage[s] for s in self.placement.stages_of(r)] for r in range(pp)]
        self.flatten_layout = [t for types in by_stage for t in types]
        self._by_stage = by_stage

    def get_layer_offset(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None):
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        stage = self.placement.stage_of(pp_rank, vp_stage or 0)
        return sum(types.count(layer_type) for types in self._by_stage[:stage])


def _types_by_stage(stage_layers: Sequence[int]) -> List[list]:
    """megatron-core layer types per stage: the decoder layers, the embedding first, the loss last."""
    last = len(stage_layers) - 1
    return [[LayerType.embedding] * (s == 0) + [LayerType.decoder] * n + [LayerType.loss] * (s == last)
            for s, n in enumerate(stage_layers)]


_SPLIT_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                 "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def stage_layers_of(config, placement: Placement) -> Optional[layout.Layout]:
    """Layers per stage (model order) that `config` asks for on this placement; None where
    megatron-core's own arithmetic numbers the layers (single and loop placements with layers
    that split evenly or Megatron's split settings).  On the V, Megatron's settings keep their
    meaning (first = stage 0, last = stage 2p-1, both on rank 0; a layout's stages in model order)."""
    given = config.pipeline_model_parallel_layout
    if isinstance(given, VShapeLayerLayout):
        return given.stage_layers
    stages, pp = placement.num_stages, placement.pp
    if given is not None and PipelineParallelLayerLayout is not None and isinstance(given, PipelineParallelLayerLayout):
        if placement.kind != "v":
            return None
        per_rank = given.layout  # [pp rank][virtual stage]; stage i of its list is (i % pp, i // pp)
        if len(per_rank) * len(per_rank[0]) != stages:
            raise ConfigError(f"pipeline_model_parallel_layout has {len(per_rank) * len(per_rank[0])} stages; the V "
                              f"at pp={pp} has {stages}: give {stages} stages in model order")
        return tuple(per_rank[i % pp][i // pp].count(LayerType.decoder) for i in range(stages))
    split = [getattr(config, f) for f in _SPLIT_FIELDS]
    if placement.kind == "v" and any(split):
        return layout.megatron_split(config.num_layers, placement, *split)
    if placement.kind != "v" and (any(split) or config.num_layers % stages == 0):
        return None
    return layout.even(config.num_layers, stages)


def embedding_ranks_for(placement: Placement) -> Callable[[List[int]], List[int]]:
    """`get_embedding_ranks` for megatron-core's initialize_model_parallel.

    V: only the first pipeline rank (embedding and output layer both live there).  Others:
    megatron-core's default (first and last).
    """
    if placement.kind == "v":
        return lambda pp_ranks, *_: [pp_ranks[0]]
    return lambda pp_ranks, *_: parallel_state.default_embedding_ranks(pp_ranks)


def check_model_config(config, placement: Placement) -> None:
    """Raise ConfigError for a model config this placement cannot build."""
    if placement.chunks > 1 and placement.pp < 2:
        raise ConfigError(f"placement {placement.kind!r} with {placement.chunks} chunks needs pp >= 2, got pp={placement.pp}")
    if getattr(config, "mtp_num_layers", None):
        raise ConfigError(
            f"multi-token prediction (mtp_num_layers={config.mtp_num_layers}) is not supported with "
            f"placement {placement.kind!r}; unset mtp_num_layers"
        )
    if config.pipeline_model_parallel_size != placement.pp:
        raise ConfigError(
            f"config.pipeline_model_parallel_size={config.pipeline_model_parallel_size} but the "
            f"schedule has pp={placement.pp}; set them equal"
        )
    vp = config.virtual_pipeline_model_parallel_size
    want = placement.chunks if placement.chunks > 1 else None
    if vp is not None and vp != want:
        raise ConfigError(
            f"virtual_pipeline_model_parallel_size={vp} conflicts with placement "
            f"{placement.kind!r} ({placement.chunks} chunk(s) per rank); set it to {want}"
        )


def _check_parallel_state(placement: Placement, tied: bool) -> None:
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    want_vp = placement.chunks if placement.chunks > 1 else None
    if pp != placement.pp or vp != want_vp:
        raise ConfigError(
            f"megatron parallel_state has pp={pp}, virtual pp={vp}; placement {placement.kind!r} "
            f"needs pp={placement.pp}, virtual pp={want_vp}: pass them to initialize_model_parallel"
        )
    if placement.kind == "v" and tied and placement.pp > 1:
        group = parallel_state.get_embedding_group(check_initialized=False)
        if group is not None and group.size() > 1:
            raise ConfigError(
                "tied embeddings on the V placement need an embedding group of the first pipeline "
                "rank only; pass get_embedding_ranks=embedding_ranks_for(placement) to "
                "initialize_model_parallel"
            )


def chunk_config(config, placement: Placement, stage_layers: Optional[Sequence[int]] = None):
    """A copy of `config` with the placement's pipeline settings; all chunks share it.
    `stage_layers`: layers per stage in model order (default: what `config` asks for, see
    `stage_layers_of`); uneven or not, every placement numbers its layers as the unpipelined model."""
    check_model_config(config, placement)
    if stage_layers is None and placement.pp > 1:
        stage_layers = stage_layers_of(config, placement)
    if stage_layers is not None:
        stage_layers = layout.check(stage_layers, config.num_layers, placement, "this schedule", "stage_layers")
    config = copy.copy(config)
    config.virtual_pipeline_model_parallel_size = placement.chunks if placement.chunks > 1 else None
    if stage_layers is not None and placement.pp > 1:
        for name in _SPLIT_FIELDS:  # the layout below says it all
            setattr(config, name, False if name.startswith("account") else None)
        if placement.kind == "v":
            config.pipeline_model_parallel_layout = VShapeLayerLayout(placement.pp, config.num_layers, stage_layers)
        else:  # megatron-core's own layout: its stage i sits on rank i % pp, chunk i // pp, as ours
            config.pipeline_model_parallel_layout = PipelineParallelLayerLayout(_types_by_stage(stage_layers),
                                                                                placement.pp)
    return config


SpecArg = Union[object, Callable[..., object]]


def _is_factory(spec) -> bool:
    """A `(config, vp_stage) -> spec` callable, not a spec: megatron-core's ModuleSpec defines __call__ too
    (it builds the module), so `callable` alone would build a layer from (config, vp_stage) and fail."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return callable(spec) and not isinstance(spec, ModuleSpec)


def build_model_chunks(
    config,
    placement: Placement,
    *,
    vocab_size: int,
    max_sequence_length: int,
    transformer_layer_spec: Optional[SpecArg] = None,
    share_embeddings_and_output_weights: bool = False,
    position_embedding_type: str = "learned_absolute",
    pp_rank: Optional[int] = None,
    split_backward: bool = False,
    stage_layers: Optional[Sequence[int]] = None,
    **gpt_kwargs,
) -> List[GPTModel]:
    """Build this pipeline rank's GPTModel chunks, indexed by chunk.

    Chunk c holds global stage `placement.stages_of(pp_rank)[c]`: pre_process on stage 0,
    post_process (final norm, output layer, loss) on the last stage.  `transformer_layer_spec` is
    a layer/block spec, or a callable `(config, vp_stage) -> spec` (default: the CPU test spec).
    `stage_layers`: layers per stage in model order (see `chunk_config`).
    megatron parallel_state must be initialised for this placement (see `embedding_ranks_for`).
    `split_backward`: the chunks will run a schedule with W ops, so Transformer Engine layers defer
    their weight gradients to it (see `runtime.wgrad.defer_te_wgrad`; wrap the chunks in megatron-core's
    DDP with `ddp_config.delay_wgrad_compute=True`).  Local layers are split regardless.
    """
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    config = chunk_config(config, placement, stage_layers)
    if split_backward:
        from .wgrad import defer_te_wgrad

        defer_te_wgrad(config)
    _check_parallel_state(placement, share_embeddings_and_output_weights)
    if transformer_layer_spec is None:
        from .cpu_spec import cpu_gpt_block_spec

        transformer_layer_spec = cpu_gpt_block_spec
    tied_over_gloo = share_embeddings_and_output_weights and placement.kind != "v" and _embedding_group_on_gloo()
    if (placement.kind == "v" and placement.pp > 1) or tied_over_gloo:
        gpt_kwargs["pg_collection"] = _without_embedding_group(gpt_kwargs.get("pg_collection"))
    last = placement.num_stages - 1
    chunks = []
    for chunk, stage in enumerate(placement.stages_of(pp_rank)):
        vp_stage = chunk if placement.chunks > 1 else None
        spec = transformer_layer_spec(config, vp_stage) if _is_factory(transformer_layer_spec) else transformer_layer_spec
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                pre_process=stage == 0,
                post_process=stage == last,
                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                position_embedding_type=position_embedding_type,
                vp_stage=vp_stage,
                **gpt_kwargs,
            )
        )
    if share_embeddings_and_output_weights and placement.kind == "v" and placement.pp > 1 and pp_rank == 0:
        _tie_output_to_embedding(chunks[1], chunks[0])
    if tied_over_gloo:
        with torch.no_grad():
            # What megatron-core's set-up does through CUDA: the last stage's copy (zeroed) takes the first's.
            allreduce_tied_embedding(chunks, lambda weight: weight.data)
    return chunks


def _embedding_group_on_gloo() -> bool:
    """Whether the first and last pipeline ranks' embedding group runs on gloo (CPU), where
    megatron-core's own tied-weight set-up (which moves the weight to CUDA) cannot run."""
    import torch.distributed as dist

    group = parallel_state.get_embedding_group(check_initialized=False)
    return group is not None and group.size() > 1 and dist.get_backend(group) == "gloo"


def allreduce_tied_embedding(chunks, tensor_of=lambda weight: weight.grad) -> None:
    """Sum `tensor_of(weight)` of the tied word embedding over the embedding group (first and last
    pipeline rank on single and loop placements): megatron-core's finalize_model_grads step, for
    chunks without its DDP wrapper.  No-op off the group, on the V (group of one) and when untied."""
    import torch.distributed as dist

    group = parallel_state.get_embedding_group(check_initialized=False)
    if group is None or group.size() < 2 or dist.get_rank() not in dist.get_process_group_ranks(group):
        return
    models = [_unwrap(c) for c in chunks]
    if not models[0].share_embeddings_and_output_weights:
        return
    # On the first pipeline rank the embedding's chunk comes first, on the last the output layer's last.
    model = models[0] if parallel_state.is_pipeline_first_stage(ignore_virtual=True) else models[-1]
    tensor = tensor_of(model.shared_embedding_or_output_weight())
    if tensor is not None:
        dist.all_reduce(tensor, group=group)


def _unwrap(module):
    while not hasattr(module, "share_embeddings_and_output_weights") and hasattr(module, "module"):
        module = module.module
    return module


def _without_embedding_group(pg_collection):
    """The V needs no embedding group (both ends on rank 0): with none, megatron-core's set-up
    skips its initial embedding all-reduce (which also moves the weight to CUDA)."""
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError:  # pragma: no cover - depends on the megatron-core release
        from megatron.core.package_info import __version__

        raise ConfigError(f"megatron-core {__version__} has no ProcessGroupCollection, which the V placement "
                          "needs to build its chunks without an embedding group; use megatron-core >= 0.16") from None
    pg_collection = copy.copy(pg_collection or ProcessGroupCollection.use_mpu_process_groups())
    pg_collection.embd = None
    return pg_collection


def _tie_output_to_embedding(head: GPTModel, first: GPTModel) -> None:
    """Make `head`'s output layer use `first`'s word embedding without owning it."""
    weight = first.embedding.word_embeddings.weight
    # Both uses on one rank: once the output layer's W has put its gradient into main_grad (gradient-
    # accumulation fusion) and set grad_added_to_main_grad, megatron-core's DDP hook would drop the
    # embedding's .grad for the rest of the step; with zero_out_wgrad it adds it (the W's dummy is zeros),
    # as megatron-core arranges for pp=1, where both uses are on one rank too.
    weight.zero_out_wgrad = True
    del head.output_layer.weight
    head.output_layer.weight = None
    head.shared_embedding_or_output_weight = lambda: weight
    # The executor's grad sync of chunk 0 must wait for this chunk's output-layer contribution.
    head.borrowed_parameters = (weight,)
    # The weight is checkpointed once, by chunk 0, under the embedding key, as without pipelining.
    head.tie_embeddings_and_output_weights_state_dict = lambda *args, **kwargs: None


_LAYER_RE = re.compile(r"^((?:.*\.)?decoder\.layers\.)(\d+)\.")


def global_named_parameters(chunk: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """(name, parameter) with layer indices made global: the names the non-pipelined model uses."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    # The last stage's copy of a tied word embedding (single and loop placements) is the same
    # weight as the first stage's: it goes by the embedding's name, as without pipelining.
    duplicate = getattr(chunk, "share_embeddings_and_output_weights", False) and not chunk.pre_process
    for name, param in chunk.named_parameters():
        if duplicate and name == "output_layer.weight":
            name = "embedding.word_embeddings.weight"
        m = _LAYER_RE.match(name)
        if m:
            number = layers[int(m.group(2))].layer_number  # 1-based global layer number
            name = f"{m.group(1)}{number - 1}.{name[m.end():]}"
        yield name, param


class VFloat16Module(Float16Module):
    """megatron-core's Float16Module for a chunk of the V: only the output of the last stage (2p-1, rank 0's
    chunk 1) is upcast to fp32.  megatron-core upcasts the last virtual stage of the last pipeline rank,
    which on the V is stage p, a middle stage whose output the next stage expects in the pipeline dtype.
    Inputs are cast on stage 0 as megatron-core does (rank 0, chunk 0 there too)."""

    def __init__(self, config, module, placement: Placement):
        super().__init__(config, module)
        rank = parallel_state.get_pipeline_model_parallel_rank()
        self.last_stage = placement.stage_of(rank, self.vp_stage or 0) == placement.num_stages - 1

    def forward(self, *inputs, fp32_output=True, **kwargs):
        outputs = super().forward(*inputs, fp32_output=False, **kwargs)
        return float16_to_fp32(outputs) if fp32_output and self.last_stage else outputs
