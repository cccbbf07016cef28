"""scripts/gpu_check.py as a user runs it: on a machine without CUDA it proves its plumbing (the
split against the fused backward in fp32, the recorder, `verify` and the driver over gloo),
prints one table with every GPU part reported as skipped, and exits 0; a failed check exits 1."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path; on a GPU run the script itself")
@pytest.mark.timeout(420)
def test_gpu_check_on_cpu_proves_its_plumbing_and_skips_the_gpu_parts():
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--timeout", "240"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    out = done.stdout
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines() if "  ok  " in line or "  skipped  " in line
            or "  FAIL  " in line}
    assert not any("  FAIL  " in line for line in rows.values()), out
    for ok in ("environment", "every schedule deadlock-free under NCCL's ordering (the verifier's model)",
               "B + W = fused backward (CPU fp32, plumbing)", "op timing by CUDA events (Recorder)",
               "verify v-half pp=2 over gloo", "driver v-half pp=2, 4 iterations"):
        assert "  ok  " in rows[ok], (ok, out)
    assert "bitwise equal" in rows["B + W = fused backward (CPU fp32, plumbing)"]
    for skipped in ("time: B + W vs fused backward (bf16, hidden 4096)",
                    "fp16 loss scale in effect (driver's optimizer wiring)",
                    "verify every schedule at pp=2 over NCCL; driver iterations per schedule"):
        assert "  skipped  no CUDA device" in rows[skipped], (skipped, out)
    assert "checks:" in out.splitlines()[-1] and "0 failed" in out.splitlines()[-1]
    # each row also as it finished, so a run killed at its time limit keeps what it found
    assert "gpu_check: driver v-half pp=2, 4 iterations: ok:" in done.stderr, done.stderr[-3000:]


def test_a_failed_check_is_a_row_and_exit_status_1(monkeypatch, capsys):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)

    def broken():
        raise ValueError("the check broke\nlast line")

    monkeypatch.setattr(gpu_check, "world_of_one", lambda gpu: contextlib.nullcontext())
    monkeypatch.setattr(gpu_check, "split_rows", lambda gpu: [gpu_check.guarded("broken check", broken)])
    monkeypatch.setattr(gpu_check, "event_timing", lambda gpu: (gpu_check.OK, "fine"))
    monkeypatch.setattr(gpu_check, "multi_gpu_rows", lambda gpu, args: [])
    assert gpu_check.main([]) == 1
    out = capsys.readouterr().out
    assert "broken check" in out and "FAIL" in out and "ValueError: last line" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_require_gpu_fails_at_once_without_cuda(capsys):
    """On a lent GPU machine a torch that cannot see the GPU must not pass as a CPU run of the plumbing."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    assert gpu_check.main(["--require-gpu"]) == 1
    out = capsys.readouterr().out
    assert "CUDA device  FAIL" in out and "--require-gpu" in out and "1 failed" in out
