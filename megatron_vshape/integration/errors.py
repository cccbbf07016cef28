"""One readable error per failed run, under torchrun as under plain python.

Under torchrun every rank runs the same validation and meets the same mistake; printing it from
each would give one copy per rank, and torchrun then adds its own traceback of the failed
launch.  So:

* an error every rank found alike (a configuration mistake, a diverged run) is printed by global
  rank 0 only; an error of one rank (a p2p timeout, a crash) by that rank, prefixed with it;
* the rank that prints the line also writes it into torchrun's error file (TORCHELASTIC_ERROR_FILE),
  which torchrun prints as the "Root Cause" in its closing block instead of "<N/A>".

Exit codes are the driver's (2 configuration, 1 run-time); torchrun itself exits 1 whenever a
rank fails, whatever the code (its block shows the rank's `exitcode`).
"""
from __future__ import annotations

import json
import os
import sys
import time

SHARED_ERROR_WAIT_S = 10.0


def global_rank() -> int:
    """This process's rank: torch.distributed's when it is up, else torchrun's RANK (0 alone)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0") or 0)


def report(prog: str, message: str, *, shared: bool) -> None:
    """Say `prog: error: message` once.  `shared`: every rank found the same error, so rank 0
    alone prints it; else this rank prints it, naming itself when there are several."""
    several = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    # The global rank, unless the message starts with it (a p2p timeout names its pipeline rank,
    # the same number only without data parallelism).
    if not shared and several and not message.startswith(f"rank {global_rank()}:"):
        message = f"rank {global_rank()}: {message}"
    say(f"{prog}: error: {message}", shared=shared)


def say(line: str, *, shared: bool) -> None:
    """Print an error line as `report` does (`line` is complete: argparse's own errors come so)."""
    rank = global_rank()
    if rank == 0 or not shared:
        print(line, file=sys.stderr, flush=True)
        # torchrun names the failure with the earliest timestamp as the root cause; a copy of a
        # shared error written by another rank could carry an earlier second than rank 0's and be
        # named instead (its SIGTERM exit then shows), so only the rank that prints writes the file.
        _error_file(line)
    if shared and rank != 0:
        # Let rank 0 say it first: torchrun ends every rank as soon as one exits, and a rank that
        # exited early would have rank 0 killed before its line is out.  Rank 0's exit ends this wait.
        time.sleep(SHARED_ERROR_WAIT_S)


def _error_file(line: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:  # torchrun's record format; it prints py_callstack as the "traceback"
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # the line on stderr is what matters
