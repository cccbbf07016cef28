"""The quickstart demo at its smallest, run once per pytest run (also under `make test`'s two
workers): test_pretrain_cli checks its output is whole and test_readme checks the README's speed
section against it (one demo, not two)."""
import fcntl
import json
import os
import subprocess
import sys

import pytest

from bounded_runs import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART_TIMEOUT = 380  # seconds, the whole demo on a loaded 2-core machine; tests using it allow more


@pytest.fixture(scope="session")
def quickstart_pp2(run_folder):
    """(completed process, output folder) of `scripts/quickstart.py` on the pp=2 tiny config: few
    iterations, and the speed section's fewest launches and steps (its times are not asserted).

    Once per pytest run: under `make test`'s two workers (pytest-xdist) the worker that comes
    second waits on a lock and reads the first one's result from the run's shared folder."""
    shared = run_folder
    out, result = shared / "quickstart", shared / "quickstart.json"
    with open(shared / "quickstart.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this worker dies
        if not result.exists():
            out.mkdir(exist_ok=True)
            cmd = [sys.executable, os.path.join(ROOT, "scripts", "quickstart.py"), "--config",
                   os.path.join(ROOT, "configs", "tiny", "tiny-cpu-pp2.yaml"), "--nproc", "2", "--iters", "3",
                   "--baseline-iters", "1", "--out", str(out), "--speed-runs", "1", "--speed-steps", "1"]
            try:
                run = run_bounded(cmd, QUICKSTART_TIMEOUT, env={"PYTHONWARNINGS": "ignore"})
            except AssertionError as timed_out:  # the demo and its ranks killed: the other worker reads why
                run = subprocess.CompletedProcess(cmd, -9, "", str(timed_out))
            result.write_text(json.dumps({"args": cmd, "returncode": run.returncode, "stdout": run.stdout,
                                          "stderr": run.stderr}))
    run = subprocess.CompletedProcess(**json.loads(result.read_text()))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run, out
