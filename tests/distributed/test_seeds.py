"""The driver's dropout streams: one per pipeline rank, on CPU and on GPUs, as Megatron-LM seeds them (seed + 100 x
pipeline rank for torch's generator and for megatron-core's CUDA seeding, which also sets the default CUDA generator
that hidden and embedding dropout draw from).  A GPU run is stood in for here by recording what the driver hands to
megatron-core's model_parallel_cuda_manual_seed; every pipeline rank used to pass it the plain seed."""
from __future__ import annotations

import argparse

import pytest

from megatron_vshape.integration.launch import launch


def _seeds(rank, world_size):
    from unittest import mock

    import torch
    from megatron.core import tensor_parallel

    from megatron_vshape.integration import train
    from megatron_vshape.schedule.ops import Placement

    cuda_seeds = []
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=world_size, seed=1234)
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(tensor_parallel, "model_parallel_cuda_manual_seed", side_effect=cuda_seeds.append):
        train.init_parallel(args, Placement("v", world_size, 2))
    return torch.initial_seed(), cuda_seeds


@pytest.mark.timeout(240)
def test_each_pipeline_rank_draws_dropout_from_its_own_stream():
    got = launch(_seeds, 4, timeout=200)
    assert got == [(1234 + 100 * r, [1234 + 100 * r]) for r in range(4)]
