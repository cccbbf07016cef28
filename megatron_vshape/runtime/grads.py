"""Gradient finalisation for model chunks without megatron-core's DistributedDataParallel (CPU):
what megatron-core's `finalize_model_grads` does there, over whatever backend the groups use.

megatron-core's DDP allocates its gradient buffers with `torch.cuda.current_device()`, so on CPU
the chunks stay unwrapped, gradients live in `.grad`, and `finalize_grads` (set as
`config.finalize_model_grads_func`, which the executor calls after the step) averages them over
the data-parallel replicas, sums the tied word embedding over the embedding group and scales by
the token count when the loss is per token.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .chunks import allreduce_tied_embedding


def unique_parameters(chunks) -> List[torch.nn.Parameter]:
    """The chunks' parameters, each once (a weight borrowed by another chunk is stepped once)."""
    return list(dict.fromkeys(p for chunk in chunks for p in chunk.parameters()))


def finalize_grads(model, num_tokens: Optional[torch.Tensor] = None, pg_collection=None, force_all_reduce=False):
    from megatron.core import parallel_state

    config = model[0].config
    if getattr(config, "sequence_parallel", False):
        raise NotImplementedError("finalize_grads does not all-reduce sequence-parallel norm gradients; "
                                  "use megatron-core's DistributedDataParallel (GPU) for sequence parallelism")
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    grads = [p.grad for p in unique_parameters(model) if p.grad is not None]
    if dist.get_world_size(dp_group) > 1 and grads:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        flat /= dist.get_world_size(dp_group)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
    allreduce_tied_embedding(model)
    if num_tokens is not None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dist.broadcast(num_tokens, src=dist.get_process_group_ranks(pp_group)[-1], group=pp_group)
        dist.all_reduce(num_tokens, group=dp_group)
        if num_tokens > 0:
            # Replicas' gradients were averaged; per-token scaling divides their sum.
            scale = dist.get_world_size(dp_group) / num_tokens.item()
            for g in grads:
                g.mul_(scale)


def clip_grad_norm(params, max_norm: float) -> float:
    """Global L2 norm of the gradients over the model-parallel ranks (each weight counted once:
    no tensor-parallel duplicates, no tied copy), and Megatron's clipping when max_norm > 0.

    The squares are added exactly (math.fsum of every gradient's own sum, gathered from all
    ranks), so the norm does not depend on which rank holds which layer: every schedule and
    layout, and the model without pipelining, clip by the same coefficient.  A running float
    sum per rank, then an all-reduce, rounds by layout, and V and 1F1B runs drifted apart by an
    ulp a step wherever clipping was active."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    counted = [p.grad for p in params if p.grad is not None and not getattr(p, "shared", False)
               and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)]
    squares = [float(g.detach().float().pow(2).sum()) for g in counted]
    group = parallel_state.get_model_parallel_group()
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, squares, group=group)
    norm = math.sqrt(math.fsum(s for rank in everyone for s in rank))
    if max_norm > 0:
        coeff = max_norm / (norm + 1.0e-6)
        if coeff < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coeff)
    return norm
