"""The B/W split under tensor parallelism (TP=2), with and without sequence parallelism.

megatron-core's own sequence-parallel mappings allocate on CUDA, so on CPU this drives one
ColumnParallelLinear directly: sequence-sharded input, all-gather in F, reduce-scatter of the
input gradient in B, re-gather of the input at W.  Reference: the full-size matmul on one rank.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vshape.integration.launch import launch

S, BATCH, IN, OUT = 4, 2, 6, 8


def _job(rank, world_size):
    """Both cases on the same two ranks (one spawn): {sequence_parallel: this rank's result}."""
    from megatron_vshape.runtime.groups import destroy_megatron, init_megatron

    init_megatron(tp=world_size, pp=1)
    out = {sp: _case(rank, world_size, sp) for sp in (False, True)}
    destroy_megatron()
    return out


def _case(rank, world_size, sequence_parallel):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_vshape.runtime import wgrad

    g = torch.Generator().manual_seed(0)
    w_full, x_full = torch.randn(OUT, IN, generator=g), torch.randn(S, BATCH, IN, generator=g)
    cfg = ModelParallelConfig(tensor_model_parallel_size=world_size, sequence_parallel=sequence_parallel,
                              use_cpu_initialization=True, perform_initialization=False)
    layer = ColumnParallelLinear(IN, OUT, config=cfg, init_method=lambda w: None, bias=False, gather_output=False)
    rows = OUT // world_size
    with torch.no_grad():
        layer.weight.copy_(w_full[rank * rows:(rank + 1) * rows])
    wgrad.install(layer)
    seq = S // world_size
    x = (x_full[rank * seq:(rank + 1) * seq] if sequence_parallel else x_full).clone().requires_grad_()
    with wgrad.split_forward():
        y, _ = layer(x)
    entries = []
    with wgrad.collect(entries):
        (y * y).sum().backward()
    grad_before_w = layer.weight.grad
    wgrad.run(entries)
    return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "before_w": grad_before_w}


@pytest.fixture(scope="module")
def runs():
    return launch(_job, 2, timeout=120)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_split_linear_tp2(runs, sequence_parallel):
    tp = 2
    out = [job[sequence_parallel] for job in runs]
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(OUT, IN, generator=g), torch.randn(S, BATCH, IN, generator=g)
    w.requires_grad_()
    x.requires_grad_()
    y = torch.matmul(x, w.t())
    (y * y).sum().backward()
    rows = OUT // tp
    for r, res in enumerate(out):
        assert res["before_w"] is None
        torch.testing.assert_close(res["y"], y.detach()[..., r * rows:(r + 1) * rows], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res["dw"], w.grad[r * rows:(r + 1) * rows], rtol=1e-6, atol=1e-6)
    if sequence_parallel:  # reduce-scatter: each rank holds its sequence shard of the summed gradient
        torch.testing.assert_close(torch.cat([r["dx"] for r in out]), x.grad, rtol=1e-6, atol=1e-6)
    else:  # allreduce_dgrad: every rank holds the full input gradient
        for res in out:
            torch.testing.assert_close(res["dx"], x.grad, rtol=1e-6, atol=1e-6)
