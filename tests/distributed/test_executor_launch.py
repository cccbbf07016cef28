"""The launch harness: results by rank, and a failing, dying or hanging rank is an error, never a hang."""
import os
import time

import pytest

from megatron_vshape.integration.launch import LaunchError, launch


def _sum_ranks(rank, world_size, tag):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "tag": tag}


def _raise_on_rank1(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("deliberate failure")
    dist.barrier()


def _die_on_rank1(rank, world_size):
    if rank == 1:
        os._exit(3)
    time.sleep(60)


def _hang(rank, world_size):
    time.sleep(60)


def test_results_by_rank():
    out = launch(_sum_ranks, 3, ("t",), timeout=60)
    assert out == [{"rank": r, "sum": 3.0, "tag": "t"} for r in range(3)]


@pytest.mark.parametrize("fn, pattern", [
    (_raise_on_rank1, r"rank 1 of 2 failed:(.|\n)*deliberate failure"),
    (_die_on_rank1, r"rank 1 of 2 died without a result \(exit code 3\)"),
    (_hang, r"timed out after 8s: rank\(s\) \[0, 1\]"),
])
def test_failures_are_errors_not_hangs(fn, pattern):
    start = time.monotonic()
    with pytest.raises(LaunchError, match=pattern):
        launch(fn, 2, timeout=8)
    assert time.monotonic() - start < 30
