"""Commands the end-to-end tests run, each with a hard time bound that takes the whole process tree
with it.  torchrun starts every rank in a session of its own, so killing torchrun, or its process
group, would leave the ranks running (blocked in a collective until gloo's own timeout) on the
machine the rest of the suite shares; the tree is collected from the parent links instead."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
PRETRAIN = str(REPO / "scripts" / "pretrain_gpt.py")


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it, whatever session each is in, and reap them."""
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
    psutil.wait_procs(tree, timeout=30)


def run_bounded(cmd: Sequence[str], timeout: float, extra_path: Optional[str] = None,
                env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run `cmd` in the repository with the repository on PYTHONPATH.  After `timeout` seconds it is
    killed with everything it started and the test fails with its output so far; a test that ends
    otherwise (pytest-timeout, an interrupt) takes the tree down the same way."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    PYTHONPATH=os.pathsep.join(p for p in (str(REPO), extra_path, os.environ.get("PYTHONPATH")) if p))
    full_env.update(env or {})
    proc = subprocess.Popen(list(cmd), cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # something it started outside its tree still holds the pipes
            out, err = "", ""
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout:.0f}s; killed with the processes it "
                             f"started.\n{out[-3000:]}\n{err[-3000:]}")
    except BaseException:
        kill_tree(proc.pid)
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def pretrain(argv: Sequence[str], nproc: int = 2, timeout: float = 280,
             env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node=NPROC scripts/pretrain_gpt.py ARGV` as users launch
    it (plain `python scripts/pretrain_gpt.py` for nproc=1), Python's warnings off."""
    launcher = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    return run_bounded([*launcher, PRETRAIN, *argv], timeout, env={"PYTHONWARNINGS": "ignore", **(env or {})})


def tagged(stdout: str, tag: str) -> List[dict]:
    """The JSON of the driver's `TAG {...}` lines (VSHAPE_METRICS, VSHAPE_SUMMARY), in order."""
    return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith(tag + " ")]


def losses_by_iteration(stdout: str) -> Dict[int, float]:
    """{iteration: loss} of the VSHAPE_METRICS lines."""
    return {m["iteration"]: m["loss"] for m in tagged(stdout, "VSHAPE_METRICS")}
