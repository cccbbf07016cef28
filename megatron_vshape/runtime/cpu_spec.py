"""A GPT layer spec that runs on CPU: the TEST AND DEMO spec of this package.

Production runs use Megatron's own layer specs (Transformer Engine or local); nothing in the
runtime depends on this module.  It exists because megatron-core's stock `DotProductAttention`
takes its score buffer from a CUDA memory pool and forks the CUDA RNG tracker, so tests on
gloo/CPU need another core attention.  Everything else is megatron-core's local modules:
`ColumnParallelLinear` / `RowParallelLinear` (so the B/W split and tensor parallelism are the
real ones) and a torch LayerNorm/RMSNorm.  Positions: learned absolute embeddings work as they
are; megatron-core's rotary embedding moves its frequencies to CUDA on first use, so for
`position_embedding_type="rope"` on CPU call `use_cpu_rotary(model)` after building the model.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build


class SdpaCoreAttention(MegatronModule):
    """Core attention on `torch.nn.functional.scaled_dot_product_attention`.

    Same constructor and forward signature as megatron-core's `DotProductAttention`:
    query `[sq, b, np, hn]`, key/value `[sk, b, ng, hn]` (this tensor-parallel rank's heads,
    query groups repeated for GQA), output `[sq, b, np * hn]`.  `attention_mask` follows
    Megatron's convention (True = masked out); with no mask and a causal mask type the causal
    mask is applied.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SdpaCoreAttention (CPU test spec) has no context parallelism")
        tp_size = pg_collection.tp.size() if pg_collection is not None else 1
        if config.num_attention_heads % tp_size or config.num_query_groups % tp_size:
            raise ValueError(
                f"num_attention_heads={config.num_attention_heads} and num_query_groups="
                f"{config.num_query_groups} must be divisible by tensor parallel size {tp_size}"
            )
        self.heads = config.num_attention_heads // tp_size
        self.groups = config.num_query_groups // tp_size
        self.head_dim = config.kv_channels
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        # Megatron's query-key layer scaling divides the scale by the layer number and multiplies
        # it back inside the softmax; in exact arithmetic the two cancel, so only the scale stays.
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SdpaCoreAttention (CPU test spec) takes no packed sequences or bias")
        if self.heads > self.groups:  # grouped-query attention: share each key/value group
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        # [s, b, n, h] -> [b, n, s, h], the layout SDPA expects.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask_type = attn_mask_type or self.attn_mask_type
        mask = None if attention_mask is None else ~attention_mask
        causal = mask is None and mask_type == AttnMaskType.causal
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal, scale=self.softmax_scale,
        )
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)


class CpuNorm(torch.nn.Module):
    """LayerNorm or RMSNorm with megatron-core's norm constructor.

    Marks its parameters `sequence_parallel` when the config is, so that Megatron's
    finalize_model_grads all-reduces their gradients across tensor-parallel ranks.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def cpu_gpt_layer_spec(normalization: str = "LayerNorm") -> ModuleSpec:
    """megatron-core's local GPT layer spec with CPU core attention and torch norms.

    Dense MLP only (no experts); attention is causal.
    """
    spec = get_gpt_layer_local_spec(normalization=normalization)
    layer = spec.submodules
    layer.input_layernorm = CpuNorm
    layer.pre_mlp_layernorm = CpuNorm
    layer.self_attention.submodules.core_attention = SdpaCoreAttention
    return spec


def cpu_gpt_block_spec(config, vp_stage: Optional[int] = None, normalization: Optional[str] = None):
    """Block spec for one model chunk: this chunk's layers plus a CPU final norm.

    Like megatron-core's `get_gpt_decoder_block_spec`, it asks megatron-core how many layers
    this (pipeline rank, vp_stage) builds, so it follows whatever layer layout the config has.
    """
    layer = cpu_gpt_layer_spec(normalization or config.normalization)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=CpuNorm)


class CpuRotaryEmbedding(RotaryEmbedding):
    """megatron-core's RotaryEmbedding, with its angles computed where its frequencies live."""

    def get_emb(self, max_seq_len: int, offset: int = 0):
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, dim/2]
        if self.rotary_interleaved:  # (f0, f0, f1, f1, ...)
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:  # (f0, f1, ..., f0, f1, ...)
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


def use_cpu_rotary(model: torch.nn.Module) -> None:
    """Make a GPTModel's rotary embedding (if it has one) run on CPU."""
    rope = getattr(model, "rotary_pos_emb", None)
    if type(rope) is RotaryEmbedding:
        rope.__class__ = CpuRotaryEmbedding
