#!/usr/bin/env python3
"""The comparison sweep on this machine's CPU, no SLURM: each schedule trains the tiny config
through torchrun (gloo), one run after another, then scripts/bench/report.py tabulates and plots.

    .venv/bin/python scripts/bench/sweep_cpu.py      # tiny-cpu.yaml (4 processes), tiny-cpu-pp2.yaml (2)
    .venv/bin/python scripts/bench/sweep_cpu.py --configs configs/tiny/tiny-cpu-pp2.yaml \
        --schedules 1f1b,v-half --out out/sweep-pp2 -- --train-iters 20

Every run is validated first with the driver's checks (nothing starts if one cannot run). Each
run's log, `OUT/<config>__<schedule>.log`, holds the driver's output between a `VSHAPE_RUN` line
and a `VSHAPE_EXIT {"exit_code": N}` line, as a SLURM job's log does, so the same report reads
both.  A run past --timeout is killed (exit 124) and reported FAILED.  Timings on a shared CPU are
noisy: the table shows what the schedules do to the same model, not what a GPU cluster will see.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from megatron_vshape.testing.processes import kill_tree  # noqa: E402

TRAIN_SCRIPT = ROOT / "scripts" / "pretrain_gpt.py"
DEFAULT_CONFIGS = [ROOT / "configs" / "tiny" / "tiny-cpu.yaml", ROOT / "configs" / "tiny" / "tiny-cpu-pp2.yaml"]
SCHEDULES = ("1f1b", "1f1b-interleaved", "v-min", "v-half", "v-zb")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


grid = _load("vshape_submit_grid", ROOT / "scripts" / "slurm" / "submit_grid.py")
report = _load("vshape_report", ROOT / "scripts" / "bench" / "report.py")


def run_one(config: Path, schedule: str, nproc: int, log: Path, extra, timeout: float) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(TRAIN_SCRIPT), "--config", str(config), "--pipeline-schedule", schedule, *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        f.write("VSHAPE_RUN " + json.dumps({"config_name": config.stem, "schedule": schedule, "nproc": nproc}) + "\n")
        f.write("vshape: " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # torchrun and its ranks, each in a session of its own
            proc.wait()
            code = 124
            f.write(f"vshape: killed after --timeout={timeout:.0f}s\n")
        f.write("VSHAPE_EXIT " + json.dumps({"exit_code": code}) + "\n")
    return code


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description="Train the tiny config under each schedule on CPU, then report.",
                                 epilog="Flags after -- go to every run's scripts/pretrain_gpt.py.")
    ap.add_argument("--configs", nargs="+", type=Path, default=DEFAULT_CONFIGS,
                    help="config YAML files (default: the tiny GPT at pp=4 and at pp=2)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--nproc", type=int, default=None, help="processes per run (default: the config's pp)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "sweep-cpu")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take before it is killed")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    schedules = [s.strip() for s in a.schedules.split(",") if s.strip()]
    runs, errors = [], []
    for config in a.configs:
        for schedule in schedules:
            try:
                args = grid.driver_args(config, schedule, extra)
                nproc = a.nproc or args.pipeline_model_parallel_size * args.tensor_model_parallel_size
                grid.validate_run(args, nproc, None)
                runs.append((config, schedule, nproc))
            except grid.ConfigError as e:
                errors.append(f"{config.name} {schedule}: {e}")
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    for config, schedule, nproc in runs:
        log = a.out / f"{config.stem}__{schedule}.log"
        t0 = time.monotonic()
        code = run_one(config, schedule, nproc, log, extra, a.timeout)
        print(f"{config.stem} {schedule}: exit {code} in {time.monotonic() - t0:.0f}s  ({log})", flush=True)
    print()
    return report.main([str(a.out), "--csv", str(a.out / "report.csv"), "--plot", str(a.out / "report.png")])


if __name__ == "__main__":
    sys.exit(main())
