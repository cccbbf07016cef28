"""megatron_vshape.testing.processes: a command past its time bound goes down with everything it
started, also the processes in sessions of their own (torchrun's ranks), which killing its process
group leaves running."""
import os
import subprocess
import sys
import time

import psutil

from bounded_runs import TORCHRUN
from megatron_vshape.testing.processes import kill_tree, run

# Starts a child in a session of its own, as torchrun starts each rank, names it, and waits.
SPAWNER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(child.pid))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

# A torchrun rank that names itself and waits.
RANK = """
import os, sys, time
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(sys.argv[1], os.environ["RANK"] + ".tmp"), os.path.join(sys.argv[1], os.environ["RANK"]))
time.sleep(600)
"""


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, not reaped yet by init
    except psutil.NoSuchProcess:
        return True


def _all_gone(pids, within=30):
    """Whether every pid is gone within `within` seconds (init reaps them in its own time)."""
    deadline = time.monotonic() + within
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(_gone(p) for p in pids)


def test_a_command_past_its_time_is_killed_with_a_child_in_another_session(tmp_path):
    named = tmp_path / "child"
    for timeout in (2, 4, 8, 16, 32, 64):  # long enough for this machine to start two interpreters
        code, _, _ = run([sys.executable, "-c", SPAWNER, str(named)], timeout)
        assert code is None  # killed at the bound
        if named.exists():
            break
    child = int(named.read_text())
    assert _all_gone([child]), f"the child {child} in its own session outlived the bound"


def test_kill_tree_takes_torchruns_ranks_with_it(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with open(tmp_path / "torchrun.err", "w") as err:
        agent = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node=2", str(script), str(tmp_path)],
                                 stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 240
            while not all((tmp_path / r).exists() for r in ("0", "1")):
                assert agent.poll() is None, (tmp_path / "torchrun.err").read_text()[-3000:]
                assert time.monotonic() < deadline, "torchrun's ranks did not start"
                time.sleep(0.2)
            ranks = [int((tmp_path / r).read_text()) for r in ("0", "1")]
            assert all(psutil.Process(r).ppid() == agent.pid for r in ranks)
            assert all(os.getsid(r) != os.getsid(agent.pid) for r in ranks)  # why its process group is not enough
        finally:
            kill_tree(agent.pid)
            agent.wait()  # reaped by kill_tree already: this Popen learns it
    assert _all_gone(ranks), ranks
