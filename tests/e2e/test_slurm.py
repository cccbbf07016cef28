"""The project's SLURM scripts on a real SLURM: munged, slurmctld and two slurmd emulating nodes n1
and n2 on this machine (scripts/slurm/local_cluster.py), installed from Debian when missing.

- scripts/slurm/submit_grid.py submits the tiny CPU config through scripts/slurm/pretrain.sbatch
  across both nodes (one torchrun per node, 2 processes each, pp=4); the job completes, SLURM
  records exit 0, and the loss in the driver's VSHAPE_SUMMARY fell.
- A rank killed mid-run (SIGKILL, as the OOM killer does) ends every rank; SLURM records a non-zero
  exit and scripts/bench/report.py shows the run as FAILED.
- A grid that does not fit fails in submit_grid.py before any sbatch, one line per problem.

Skipped only where SLURM cannot be installed (not root, no apt-get, no package source); the skip
reason is also raised as a warning so it shows in `pytest -q` output.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "scripts" / "slurm"
TINY = ROOT / "configs" / "tiny" / "tiny-cpu.yaml"


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


local_cluster = _load("vshape_local_cluster", SLURM_DIR / "local_cluster.py")
report = _load("vshape_report", ROOT / "scripts" / "bench" / "report.py")


def _say(msg):
    # Shown with -s, and in the report of a failing test.
    print(f"[slurm-e2e] {msg}", flush=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    t0 = time.monotonic()
    reason = local_cluster.ensure_installed(log=_say)
    if reason:
        warnings.warn(f"SLURM e2e tests skipped: {reason}")
        pytest.skip(reason)
    t1 = time.monotonic()
    c = local_cluster.LocalCluster(tmp_path_factory.mktemp("slurm"), ("n1", "n2"), cpus=4)
    try:
        c.start()
        _say(f"install check {t1 - t0:.1f}s, cluster up in {time.monotonic() - t1:.1f}s "
             f"({c.run('sinfo', '-h', '-N', '-o', '%N:%t').stdout.split()})")
        yield c
    finally:
        t2 = time.monotonic()
        c.stop()
        left = c.leftovers()
        _say(f"cluster stopped in {time.monotonic() - t2:.1f}s; processes left: {left}")
        assert not left, f"processes of the test cluster still alive: {left}"


def _job_env(cluster):
    """What a user's shell holds when submitting: SLURM_CONF, the interpreter, this checkout."""
    return dict(cluster.env, PYTHON=sys.executable, PYTHONPATH=str(ROOT),
                MASTER_PORT=str(local_cluster.free_port()), OMP_NUM_THREADS="1")


def _submit_grid(*args, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, str(SLURM_DIR / "submit_grid.py"), *args], env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=120, cwd=cwd)


# Bounds above pytest.ini's 300 s: the first test also pays for installing SLURM on a fresh machine.
@pytest.mark.timeout(600)
def test_tiny_config_trains_across_two_nodes(cluster, tmp_path):
    t0 = time.monotonic()
    out = _submit_grid("--configs", str(TINY), "--schedules", "v-half", "--gpus-per-node", "2", "--no-gpus",
                       "--out", str(tmp_path), env=_job_env(cluster))
    assert out.returncode == 0, out.stderr + out.stdout
    (line,) = [l for l in out.stdout.splitlines() if l.startswith("submitted ")]
    job, log = line.split()[1], Path(line.split("log=")[1])
    info = cluster.wait(job, timeout=300)
    elapsed = time.monotonic() - t0
    text = log.read_text()
    _say(f"job {job}: {info.get('JobState')} ExitCode={info.get('ExitCode')} on {info.get('NodeList')} "
         f"in {elapsed:.1f}s")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-4000:] + cluster.logs()
    assert info["NodeList"] == "n[1-2]"
    (run,) = report.collect([str(log)])
    assert run.ok, run.reason
    summary = [json.loads(l.split("VSHAPE_SUMMARY ", 1)[1]) for l in text.splitlines() if "VSHAPE_SUMMARY " in l][-1]
    _say(f"VSHAPE_SUMMARY: schedule={summary.get('schedule')} world_size={summary.get('world_size')} "
         f"pp={summary.get('pp')} loss {summary.get('first_loss')} -> {summary.get('final_loss')}")
    assert summary["world_size"] == 4 and summary["schedule"] == "v-half"
    assert summary["final_loss"] < summary["first_loss"]
    assert 'VSHAPE_EXIT {"exit_code": 0' in text


def _rank_pid(job: str, rank: int):
    """The process of global rank `rank` in SLURM job `job` (torchrun sets RANK in each worker)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == job.encode() and env.get(b"RANK") == str(rank).encode() \
                and b"TORCHELASTIC_RUN_ID" in env:
            return int(proc.name)
    return None


@pytest.mark.timeout(600)
def test_a_dead_rank_fails_the_job_and_the_report(cluster, tmp_path):
    log = tmp_path / "dies.out"
    env = _job_env(cluster)
    env["NPROC_PER_NODE"] = "2"
    job = cluster.run("sbatch", "--parsable", "--nodes=2", f"--output={log}", str(SLURM_DIR / "pretrain.sbatch"),
                      "--config", str(TINY), "--train-iters", "100000", env=env).stdout.strip()
    deadline = time.monotonic() + 240
    while not (log.exists() and "VSHAPE_METRICS" in log.read_text()):
        state = cluster.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job ended ({state}) before training:\n" + \
            (log.read_text()[-4000:] if log.exists() else cluster.logs())
        assert time.monotonic() < deadline, "no iteration logged in 240 s"
        time.sleep(0.3)
    pid = _rank_pid(job, 3)  # a rank on the second node
    assert pid, "rank 3's process not found"
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    info = cluster.wait(job, timeout=120)
    _say(f"killed rank 3 (pid {pid}); job {job} ended {info.get('JobState')} ExitCode={info.get('ExitCode')} "
         f"{time.monotonic() - t_kill:.1f}s later")
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0"
    (run,) = report.collect([str(log)])
    assert not run.ok and run.exit_code not in (None, 0)
    assert "FAILED" in report.table([run])


@pytest.mark.parametrize("argv,message", [
    (["--", "--pipeline-layout", "1,2,1"], "--pipeline-layout 1,2,1 gives 3 stages;"),
    (["--", "--global-batch-size", "10", "--micro-batch-size", "4"],
     "--global-batch-size=10 is not divisible by --micro-batch-size=4 x data-parallel size 1; use --global-batch-size=12"),
    (["--nodes", "1"], "needs tp x pp x cp = 1x4x1 = 4 GPUs but the job has --nodes=1 x --gpus-per-node=2 = 2; "
                       "use --nodes=2"),
    # The driver's own start-up checks beyond the pipeline's: model sizes, flag values and combinations.
    (["--", "--num-attention-heads", "3"], "--hidden-size=64 is not divisible by --num-attention-heads=3"),
    (["--", "--min-lr", "0.1"], "--min-lr=0.1 is above --lr=0.003"),
])
def test_a_grid_that_does_not_fit_fails_before_sbatch(tmp_path, argv, message):
    """No cluster needed: nothing reaches sbatch (no sbatch on PATH would fail differently)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    out = _submit_grid("--configs", str(TINY), "--schedules", "v-half", "--gpus-per-node", "2", "--no-gpus",
                       "--out", str(tmp_path / "logs"), *argv[:cut], *argv[cut:],
                       env=dict(os.environ, PATH="/nonexistent"))
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert "nothing submitted" in out.stderr and not (tmp_path / "logs").exists()
