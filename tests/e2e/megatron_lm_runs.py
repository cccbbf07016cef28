"""Helpers for the Megatron-LM integration tests: run a training script through
`python -m megatron_vshape.launch` (under torchrun for several ranks) with a hard time bound, and the
non-pipelined reference losses of the tiny GPT."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from bounded_runs import run_bounded

STANDIN = Path(__file__).resolve().parent / "megatron_lm_standin" / "pretrain_gpt.py"
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.eE+-]+)")


def run_launcher(script, args: List[str], nproc: int, timeout: float, extra_path: Optional[str] = None,
                 env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m megatron_vshape.launch SCRIPT ARGS` (plain
    `python -m megatron_vshape.launch` for nproc=0), killed with all its ranks after `timeout` seconds."""
    launcher = ["-m", "megatron_vshape.launch", str(script), *args]
    cmd = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                             if nproc else []), *launcher]
    return run_bounded(cmd, timeout, extra_path, env)


def losses(stdout: str) -> List[float]:
    """Per-iteration 'lm loss' of Megatron-style iteration lines, in order."""
    return [float(m.group(2)) for m in LOSS_LINE.finditer(stdout)]


def _reference(rank, world, tiny, m, steps, lr):
    from megatron_vshape.testing.tiny_gpt import batch, reference_run

    out = reference_run(tiny, m, steps=steps, lr=lr)
    result = []
    for step, per_microbatch in enumerate(out["losses"]):
        tokens = [float(batch(tiny, step, i)["loss_mask"].sum()) for i in range(m)]
        result.append(sum(l * t for l, t in zip(per_microbatch, tokens)) / sum(tokens))
    return result


def reference_losses(tiny, microbatches: int, steps: int, lr: float) -> List[float]:
    """Token-weighted loss per iteration of the same model, weights and data without pipelining (SGD)."""
    from megatron_vshape.integration.launch import launch

    return launch(_reference, 1, args=(tiny, microbatches, steps, lr), timeout=120)[0]
