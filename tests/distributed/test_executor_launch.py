"""The launch harness: results by rank, and a failing, dying or hanging rank is an error, never a hang."""
import multiprocessing
import os
import time

import pytest

from megatron_vshape.integration import launch as launch_module
from megatron_vshape.integration.launch import LaunchError, launch
from slow_start import SLOW, ready_rank


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
    time.sleep(600)


def _abort_on_rank1(rank, world_size):
    """Rank 1 dies by SIGABRT (as a communication library's thread that throws does) while rank 0
    waits for it in a collective: rank 0 only sees its peer's connection closed."""
    import torch.distributed as dist

    if rank == 1:
        os.abort()
    dist.barrier()


def _hang(rank, world_size):
    time.sleep(600)


def _env(rank, world_size, names):
    return {n: os.environ.get(n) for n in names}


@pytest.fixture(params=["as_built", "spawn"])
def start_method(request, monkeypatch):
    """Ranks started the way this torch build starts them (forked from a preloaded server on a CPU
    build), and spawned, the way a CUDA build starts them."""
    if request.param == "spawn":
        monkeypatch.setattr(launch_module, "_context", lambda: multiprocessing.get_context("spawn"))
    return request.param


def test_results_by_rank(start_method):
    out = launch(_sum_ranks, 3, ("t",), timeout=60)
    assert out == [{"rank": r, "sum": 3.0, "tag": "t"} for r in range(3)]


def test_ranks_see_the_parents_environment_as_it_is_at_each_launch(start_method, monkeypatch):
    """On a CPU build the ranks are forked from a server started at the first launch: a variable
    set or removed in the parent after that must reach (or leave) the ranks of the next launch
    all the same, as it does for spawned ranks."""
    monkeypatch.setenv("VSHAPE_LAUNCH_GONE", "1")
    launch(_env, 2, (["VSHAPE_LAUNCH_GONE"],), timeout=60)  # the server exists from here on
    monkeypatch.delenv("VSHAPE_LAUNCH_GONE")
    monkeypatch.setenv("VSHAPE_LAUNCH_NEW", "after")
    got = launch(_env, 2, (["VSHAPE_LAUNCH_GONE", "VSHAPE_LAUNCH_NEW", "VSHAPE_LAUNCH_OWN"],),
                 env={"VSHAPE_LAUNCH_OWN": "mine"}, timeout=60)
    assert got == [{"VSHAPE_LAUNCH_GONE": None, "VSHAPE_LAUNCH_NEW": "after", "VSHAPE_LAUNCH_OWN": "mine"}] * 2


# A failing or dying rank is reported as soon as it fails, so its deadline only guards a hang.
# The hang's 2 s run from the moment both ranks are ready, however long they took to start.
@pytest.mark.parametrize("fn, pattern, timeout", [
    (_raise_on_rank1, r"rank 1 of 2 failed:(.|\n)*deliberate failure", 120),
    (_die_on_rank1, r"rank 1 of 2 died without a result \(exit code 3\)", 120),
    # Rank 0's error names the dead peer; on a machine too loaded to run rank 0 within 2 s, the
    # parent sees rank 1 dead first.  Either way the signal is named.
    (_abort_on_rank1, r"(rank 0 of 2 failed:(.|\n)*rank 1 died without reporting an error"
                      r"|rank 1 of 2 died without a result) \(killed by SIGABRT\)", 120),
    (_hang, r"timed out after 2s: rank\(s\) \[0, 1\] of 2 did not finish", 2),
])
def test_failures_are_errors_not_hangs(fn, pattern, timeout):
    start = time.monotonic()
    with pytest.raises(LaunchError, match=pattern):
        launch(fn, 2, timeout=timeout)
    assert time.monotonic() - start < 300  # the ranks left sleeping (600 s) were killed, not waited for


def test_the_clock_starts_when_the_ranks_are_ready():
    """Ranks that take SLOW seconds to start: a timeout shorter than that start still lets a quick
    function finish (it counts from the last rank's process group), and the start itself has its
    own bound, which a slower start misses."""
    assert launch(ready_rank, 2, timeout=SLOW - 1) == [0, 1]
    # 10 ms: no rank starts that fast, spawned (importing torch) or forked from the preloaded
    # server (still importing this test's modules), whether or not the slow import ran (in one
    # full-suite run the ranks were ready within 1 s, the sleep not seen: unexplained).
    with pytest.raises(LaunchError, match=r"did not start within 0.01s: rank\(s\) \[0, 1\] of 2 did not get their "
                                          r"process group ready"):
        launch(ready_rank, 2, timeout=120, startup_timeout=0.01)
