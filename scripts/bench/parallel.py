"""--jobs for the bench scripts: one function over many independent points (plans, scans,
released-scheduler runs), in order, here or in a pool of processes.  Each point's work is
deterministic (the planner counts ops, never the clock), so N processes give the rows one
process gives, N times sooner; only the CPU-second columns differ."""
from __future__ import annotations

import multiprocessing
from typing import Callable, Iterator, Optional, Sequence


def in_processes(fn: Callable, items: Sequence, jobs: int, setup: Optional[Callable] = None, arg=None) -> Iterator:
    """fn of each item, in the order given: here, or in `jobs` processes that each run
    setup(arg) first.  The processes come from a fork server where the platform has one (else
    spawned): a plain fork copies the caller's other threads' locks (pytest-xdist's I/O thread,
    say) held, and a worker that needs one waits forever (a CI run hung so).  A worker imports
    `fn`'s module by name, so a bench script loaded by its path must sit on sys.path (as when it
    runs as a script; the tests' loader puts scripts/bench there)."""
    if jobs <= 1:
        if setup:
            setup(arg)
        yield from map(fn, items)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    with context.Pool(jobs, initializer=setup, initargs=(arg,) if setup else ()) as pool:
        yield from pool.imap(fn, items)


def check_jobs(ap, jobs: int) -> None:
    """--jobs below 1 is argparse's error, before anything runs."""
    if jobs < 1:
        ap.error(f"--jobs {jobs}: give 1 or more processes")
