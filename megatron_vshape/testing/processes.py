"""Commands that launch ranks (torchrun), bounded in time, for the checks, benchmarks and tests that
run them: past its bound a command goes down with every process it started.  torchrun starts each
rank in a session of its own, so killing torchrun, or its process group, leaves the ranks running
(holding their devices, blocked in a collective until the backend's own timeout) and holding the
pipes a caller reads until they end.  The tree is found by parent links instead (psutil, which the
`runtime` extra installs)."""
from __future__ import annotations

import subprocess
from typing import Optional, Sequence, Tuple

import psutil

REAP_S = 30  # how long the killed processes get to be gone, and the pipes to close


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it, whatever session each is in, and wait for them."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in tree:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=REAP_S)


def run(cmd: Sequence[str], timeout: float, **popen) -> Tuple[Optional[int], str, str]:
    """(exit code, stdout, stderr) of `cmd` (text); the exit code is None when `timeout` seconds
    passed and the command was killed with everything it started (the output is what it wrote by
    then).  Whatever ends the caller's wait otherwise (an interrupt, a test's time limit) takes the
    tree down the same way."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=REAP_S)
        except subprocess.TimeoutExpired:  # a process it started outside its tree still holds the pipes
            out, err = "", ""
        return None, out, err
    except BaseException:
        kill_tree(proc.pid)
        raise
    return proc.returncode, out, err
