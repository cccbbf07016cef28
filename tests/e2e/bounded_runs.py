"""Commands the end-to-end tests run, each with a hard time bound that takes the whole process tree
with it (megatron_vshape.testing.processes: torchrun's ranks would outlive torchrun otherwise, on
the machine the rest of the suite shares)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_vshape.testing import processes

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
PRETRAIN = str(REPO / "scripts" / "pretrain_gpt.py")


def run_bounded(cmd: Sequence[str], timeout: float, extra_path: Optional[str] = None,
                env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run `cmd` in the repository with the repository on PYTHONPATH.  After `timeout` seconds it is
    killed with everything it started (processes.run) and the test fails with its output so far."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    PYTHONPATH=os.pathsep.join(p for p in (str(REPO), extra_path, os.environ.get("PYTHONPATH")) if p))
    full_env.update(env or {})
    code, out, err = processes.run(cmd, timeout, cwd=REPO, env=full_env)
    if code is None:
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout:.0f}s; killed with the processes it "
                             f"started.\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(list(cmd), code, out, err)


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
