"""The CPU test spec: its core attention equals written-out causal attention, and the spec uses
megatron-core's own linears with no CUDA-only modules."""
import math

import pytest
import torch

from megatron_vshape.runtime.cpu_spec import (CpuNorm, CpuRotaryEmbedding, SdpaCoreAttention, cpu_gpt_layer_spec,
                                              use_cpu_rotary)


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, attention_dropout=0.0, hidden_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _written_out(q, k, v, mask):
    """softmax(q k^T / sqrt(d) with masked entries removed) v, in [s, b, n, d] layout."""
    s, b, n, d = q.shape
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, n * d)


@pytest.mark.parametrize("groups", [4, 2])  # multi-head and grouped-query attention
def test_sdpa_attention_equals_written_out_causal_attention(groups):
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(num_query_groups=groups)
    attn = SdpaCoreAttention(config, layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self")
    g = torch.Generator().manual_seed(0)
    s, b, d = 6, 2, config.kv_channels
    q = torch.randn(s, b, 4, d, generator=g)
    k = torch.randn(s, b, groups, d, generator=g)
    v = torch.randn(s, b, groups, d, generator=g)
    got = attn(q, k, v, None)
    rep = 4 // groups
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    want = _written_out(q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2), causal)
    assert got.shape == (s, b, 4 * d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # An explicit Megatron-style mask (True = masked out) gives the same result.
    torch.testing.assert_close(attn(q, k, v, causal.expand(b, 1, s, s)), want, rtol=1e-5, atol=1e-6)


def test_norm_marks_sequence_parallel_and_honours_rmsnorm():
    norm = CpuNorm(_config(normalization="RMSNorm", sequence_parallel=False), 32)
    assert isinstance(norm, torch.nn.RMSNorm)
    norm = CpuNorm(_config(), 32)
    assert isinstance(norm, torch.nn.LayerNorm)
    assert all(p.sequence_parallel is False for p in norm.parameters())


def test_spec_uses_megatron_linears_and_cpu_modules():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    spec = cpu_gpt_layer_spec()
    attn = spec.submodules.self_attention.submodules
    assert attn.core_attention is SdpaCoreAttention
    assert attn.linear_qkv is ColumnParallelLinear and attn.linear_proj is RowParallelLinear
    mlp = spec.submodules.mlp.submodules
    assert mlp.linear_fc1 is ColumnParallelLinear and mlp.linear_fc2 is RowParallelLinear
    assert spec.submodules.input_layernorm is CpuNorm and spec.submodules.pre_mlp_layernorm is CpuNorm


@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_rotary_angles(interleaved):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    holder = torch.nn.Module()
    holder.rotary_pos_emb = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_interleaved=interleaved,
                                            use_cpu_initialization=True)
    use_cpu_rotary(holder)
    rope = holder.rotary_pos_emb
    assert isinstance(rope, CpuRotaryEmbedding)
    emb = rope.get_emb(5)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    angles = torch.arange(5).float()[:, None] * inv_freq  # [s, 4]
    want = torch.stack((angles, angles), -1).flatten(-2) if interleaved else torch.cat((angles, angles), -1)
    assert emb.shape == (5, 1, 1, 8)
    torch.testing.assert_close(emb[:, 0, 0], want)
