"""Spawn N ranks as local processes with a hard time bound, and collect their results.

Used by the distributed tests, `megatron-vshape verify` and the CPU benchmarks.

API
---
``launch(fn, world_size, args=(), kwargs=None, *, timeout=120.0, backend=None,
         env=None, threads=1, pg_timeout=None, startup_timeout=300.0) -> list``

* ``fn`` must be a module-level (picklable) function.  It is called in every rank as
  ``fn(rank, world_size, *args, **kwargs)`` after ``torch.distributed`` is initialised
  (default process group of ``world_size`` ranks on 127.0.0.1).  Its return value must be
  picklable (move tensors to CPU first); ``launch`` returns the list of return values
  indexed by rank.
* ``backend``: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA has at least
  ``world_size`` devices, else gloo.  Under NCCL each rank calls
  ``torch.cuda.set_device(rank % device_count)`` before ``fn``.
* ``timeout`` (seconds): the run of ``fn``, counted from the moment every rank has reported
  its process group ready, so a slow start (spawning, importing torch on a loaded machine)
  never eats into it.  ``startup_timeout`` (seconds) bounds that start, from the spawn to the
  last rank ready.  When either passes, every rank still running is killed and
  ``LaunchError`` names the ranks that were late.  ``pg_timeout`` (seconds) bounds each
  collective inside the ranks; by default the larger of the two bounds, so that a hang is the
  parent's timeout (a rank's own collective timeout would race it with another error).
* A rank that raises, or dies without a result (segfault, ``os._exit``, OOM kill), makes
  ``launch`` kill the others and raise ``LaunchError`` naming that rank, with its traceback
  or exit code (the signal's name when killed by one).  A rank that dies silently usually
  shows first as a peer's "Connection closed by peer": that error then also names the ranks
  already dead.  ``launch`` never hangs.
* ``env``: extra environment variables set in every rank before ``torch.distributed``
  starts.  ``threads``: ``torch.set_num_threads`` per rank (1 keeps N ranks on few cores
  from oversubscribing).
* Ranks are daemonic processes (they die with the parent; they cannot start child processes
  such as DataLoader workers).  With a CPU build of torch they are forked from a server process
  that imported torch and megatron-core once (``PRELOAD``), so a launch does not pay those
  imports per rank; with a CUDA build they are spawned.  Either way each rank takes the parent's
  environment as it is at the launch.  Results travel as plain pickles, so tensors in
  them arrive as ordinary copies.

Rendezvous uses a ``TCPStore`` the parent opens on a free port (port 0), so concurrent
launches (parallel test runs, several engineers) never race for a port.

Inside ``fn``, ``runtime.groups.init_megatron(tp=1, pp=1, seed=1234)`` initialises
megatron-core's model-parallel groups and its tensor-parallel RNG tracker (CPU-safe), and
``destroy_megatron()`` undoes it (both also importable from here).
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..runtime.groups import destroy_megatron, init_megatron  # noqa: F401  (launched fn's helpers)

HOST = "127.0.0.1"


class LaunchError(RuntimeError):
    """A rank failed, died, or the launch ran past its time bound."""


def default_backend(world_size: int) -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


# On a CPU build of torch, ranks are forked from one server process that has imported these once
# (a rank of a tiny model spent most of its start-up importing them: ~4 CPU s with megatron-core's
# GPT); missing ones are skipped.  None of them touches a device or starts a thread at import.  With
# a CUDA or ROCm build, ranks are spawned as before: Transformer Engine, which megatron-core's GPT
# imports when present, may initialise CUDA at import, and a CUDA context must never be forked.
PRELOAD = ("torch", "torch.distributed", "megatron.core.parallel_state", "megatron.core.models.gpt")


def _context():
    import torch

    device_build = bool(torch.version.cuda or getattr(torch.version, "hip", None))
    if device_build or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _rank_main(fn, rank, world_size, port, backend, args, kwargs, parent_env, env, threads, pg_timeout,
               startup_timeout, results):
    # A fatal signal (an abort in a library's thread, a segfault) prints every thread's Python stack
    # to this rank's stderr: the parent only sees the exit code.
    faulthandler.enable(all_threads=True)
    try:
        # The server forked from holds the environment it started with: take the parent's as it is now.
        os.environ.clear()
        os.environ.update(parent_env)
        os.environ.update(env)
        os.environ.update({"MASTER_ADDR": HOST, "MASTER_PORT": str(port), "RANK": str(rank),
                           "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
        import torch
        import torch.distributed as dist

        if threads:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # The rendezvous waits for the slowest rank to start, so it gets the start-up bound; the
        # collectives after it get pg_timeout (as megatron-core sets its groups' timeouts).
        rendezvous = timedelta(seconds=max(pg_timeout, startup_timeout))
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=rendezvous)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=rendezvous)
        if pg_timeout < startup_timeout and hasattr(dist.distributed_c10d, "_set_pg_timeout"):
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=pg_timeout))
        # Gloo's set-up is no barrier: a rank whose fn returned at once could tear its group down
        # while a peer still connects to it ("Connection closed by peer" there).
        dist.barrier()
        results.put(("ready", rank, None))  # the parent starts fn's clock when every rank is here
        out = fn(rank, world_size, *args, **kwargs)
    except BaseException:
        # Report before tearing the group down: the teardown makes the peers fail too, and
        # the parent names the rank whose error arrives first.
        results.put(("error", rank, traceback.format_exc()))
        time.sleep(0.5)
        raise SystemExit(1)
    # Plain pickle bytes: torch's queue reducers would share tensors through file descriptors
    # that vanish when this process exits.
    results.put(("ok", rank, pickle.dumps(out)))
    try:
        # Nor is a subgroup's set-up (Megatron's groups made inside fn): a rank whose fn ended first
        # must not close its sockets while a peer still connects to it.  The parent kills every rank
        # once all results are in, so this wait is bounded by the slowest rank's fn.
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass


def launch(fn: Callable[..., Any], world_size: int, args: Sequence = (), kwargs: Optional[Dict] = None, *,
           timeout: float = 120.0, backend: Optional[str] = None, env: Optional[Dict[str, str]] = None,
           threads: int = 1, pg_timeout: Optional[float] = None, startup_timeout: float = 300.0) -> List[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return results by rank."""
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    backend = backend or default_backend(world_size)
    pg_timeout = float(pg_timeout or max(timeout, startup_timeout))
    # The parent owns the rendezvous store: port 0 lets the OS choose a free port atomically.
    store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=max(pg_timeout, startup_timeout)))
    ctx = _context()
    results = ctx.Queue()
    procs = []
    for rank in range(world_size):
        p = ctx.Process(target=_rank_main, name=f"rank{rank}", daemon=True,
                        args=(fn, rank, world_size, store.port, backend, tuple(args), dict(kwargs or {}),
                              dict(os.environ), dict(env or {}), threads, pg_timeout, startup_timeout, results))
        p.start()
        procs.append(p)

    out: Dict[int, Any] = {}
    ready: set = set()
    # Until every rank is ready the start-up bound applies; then fn gets `timeout` from that moment.
    deadline, late = time.monotonic() + startup_timeout, f"did not start within {startup_timeout:g}s"
    dead_since: Dict[int, float] = {}
    try:
        while len(out) < world_size:
            now = time.monotonic()
            if now > deadline:
                if len(ready) < world_size:
                    missing, what = [r for r in range(world_size) if r not in ready], "did not get their process group ready"
                else:
                    missing, what = [r for r in range(world_size) if r not in out], "did not finish (hung or too slow)"
                raise LaunchError(f"launch {late}: rank(s) {missing} of {world_size} {what}; all ranks were killed")
            # Drain results first: a child cannot exit before its queued result is read.  Waiting
            # no longer than the deadline, so what arrives after it is never taken as in time.
            try:
                status, rank, value = results.get(timeout=min(0.2, deadline - now))
            except queue_mod.Empty:
                status = None
            if status == "error":
                raise LaunchError(f"rank {rank} of {world_size} failed:\n{value}{_other_errors(results, rank, procs)}")
            if status == "ready":
                ready.add(rank)
                if len(ready) == world_size:
                    deadline, late = time.monotonic() + timeout, f"timed out after {timeout:g}s"
                continue
            if status == "ok":
                out[rank] = pickle.loads(value)
                continue
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if rank in out or p.is_alive():
                    continue
                # Dead without a result: give the queue a moment in case the result is in flight.
                first = dead_since.setdefault(rank, now)
                if now - first > 2.0:
                    raise LaunchError(f"rank {rank} of {world_size} died without a result "
                                      f"({_exit_text(p.exitcode)}); see its output above")
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
        del store


def _other_errors(results, first: int, procs, grace: float = 1.0) -> str:
    """Errors other ranks report just after the first one (usually its consequences), and the
    ranks already dead without a word: a peer killed by a signal (an abort in a communication
    library's thread, the OOM killer) shows in the others only as "Connection closed by peer"."""
    lines, reported, end = [], {first}, time.monotonic() + grace
    while time.monotonic() < end:
        try:
            status, rank, value = results.get(timeout=max(0.0, end - time.monotonic()))
        except queue_mod.Empty:
            break
        if status == "error" and rank != first:
            reported.add(rank)
            lines.append(f"rank {rank} also failed: {value.strip().splitlines()[-1]}")
    for rank, p in enumerate(procs):
        code = p.exitcode
        if rank in reported or code is None or code == 0:
            continue
        lines.append(f"rank {rank} died without reporting an error ({_exit_text(code)})")
    return ("\n" + "\n".join(lines)) if lines else ""


def _exit_text(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"
