"""Weights as a pure function of (seed, global parameter name): every schedule, pp and tp starts
from the same model, so a pipelined run can be compared with the non-pipelined one.

Values follow megatron-core's defaults: normal(0, std) for weights, std/sqrt(2*num_layers) for
the output projections of attention and MLP (megatron's scaled init), norms 1, biases 0.  A
tensor-parallel shard is sliced from the full tensor drawn on CPU.
"""
from __future__ import annotations

import math
import zlib

import torch

from .chunks import global_named_parameters

_SCALED = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return g


def full_value(name: str, shape, seed: int, std: float, num_layers: int) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in leaf or "norm." in name:
        return torch.ones(shape)
    scale = std / math.sqrt(2.0 * num_layers) if name.endswith(_SCALED) else std
    return torch.randn(tuple(shape), generator=_generator(seed, name)) * scale


def _shard(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    return full.chunk(size, dim=param.partition_dim)[parallel_state.get_tensor_model_parallel_rank()]


def init_by_name(chunks, seed: int, std: float, num_layers: int) -> None:
    """Set every parameter of the chunks from (seed, its global name)."""
    with torch.no_grad():
        for chunk in chunks:
            for name, param in global_named_parameters(chunk):
                shape = list(param.shape)
                if getattr(param, "tensor_model_parallel", False):
                    from megatron.core import parallel_state

                    shape[param.partition_dim] *= parallel_state.get_tensor_model_parallel_world_size()
                value = _shard(param, full_value(name, shape, seed, std, num_layers))
                param.copy_(value.to(device=param.device, dtype=param.dtype))
