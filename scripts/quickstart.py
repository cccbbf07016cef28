#!/usr/bin/env python
"""`make demo`: train a tiny GPT on 4 CPU processes (torchrun, gloo) with V-Half on mock data, then
the same model under 1F1B, and show the loss and each pipeline rank's activation memory side by side.

    .venv/bin/python scripts/quickstart.py [--iters 30] [--schedule v-half] [--config FILE]

Draws the schedule's timeline (the planner's picture) first, streams the driver's per-interval
lines while it trains, and ends with the comparison table.  Exit status: the first failing run's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BASELINE = "1f1b"


def picture(schedule: str, pp: int, microbatches: int, out_dir: str) -> str:
    from megatron_vshape.schedule import registry
    from megatron_vshape.schedule.render import write_picture

    path = os.path.join(out_dir, f"quickstart-{schedule}-pp{pp}-m{microbatches}.svg")
    write_picture(registry.build(schedule, pp, microbatches), path)
    return path


def train(config: str, schedule: str, iters: int, log_interval: int, nproc: int, show: bool, *extra: str) -> dict:
    """One torchrun of the driver; returns its VSHAPE_SUMMARY (raises SystemExit on failure)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", os.path.join(ROOT, "scripts", "pretrain_gpt.py"),
           "--config", config, "--pipeline-schedule", schedule, "--train-iters", str(iters),
           "--log-interval", str(log_interval), *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    print("$ " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd), flush=True)
    summary = None
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        tail, errors = [], []
        for line in proc.stdout:
            tail = (tail + [line])[-40:]
            if "error:" in line and line not in errors:
                errors.append(line)
            if line.startswith("VSHAPE_SUMMARY "):
                summary = json.loads(line.split(" ", 1)[1])
            elif show and (line.startswith(" iteration") or line.startswith("megatron-vshape pretrain")):
                print("  " + _short(line.rstrip()), flush=True)
        code = proc.wait()
    if code or summary is None:
        sys.stdout.write("".join(tail) + "".join(errors))
        print(f"quickstart: the {schedule} run failed (exit {code})", file=sys.stderr)
        raise SystemExit(code or 1)
    return summary


def _short(line: str) -> str:
    """A driver line without the fields that make it wrap in a terminal."""
    keep = ("iteration ", "lm loss", "learning rate", "elapsed time", "bubble", "peak activations", "megatron-vshape")
    parts = [p.strip() for p in line.split("|")]
    return " | ".join(p for p in parts if p.startswith(keep) or parts.index(p) == 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny", "tiny-cpu.yaml"))
    ap.add_argument("--schedule", default="v-half")
    ap.add_argument("--iters", type=int, default=30, help="training iterations of the main run")
    ap.add_argument("--baseline-iters", type=int, default=3, help="iterations of the 1F1B run (memory only)")
    ap.add_argument("--nproc", type=int, default=4, help="processes (= pipeline size in the config)")
    ap.add_argument("--out", default=os.path.join(ROOT, "out"))
    args = ap.parse_args(argv)

    import yaml

    with open(args.config) as f:
        cfg = {k.replace("_", "-"): v for k, v in yaml.safe_load(f).items()}
    pp = int(cfg["pipeline-model-parallel-size"])
    m = int(cfg["global-batch-size"]) // int(cfg.get("micro-batch-size", 1)) // max(1, args.nproc // pp)
    start = time.perf_counter()
    path = picture(args.schedule, pp, m, args.out)
    print(f"schedule picture: {os.path.relpath(path, os.getcwd())}  ({args.schedule}, pp={pp}, {m} microbatches; "
          "one row per rank, F blue, B orange, W green)")
    print(f"\n1) {args.schedule}: {args.iters} iterations of a {cfg['num-layers']}-layer GPT on {args.nproc} CPU "
          "processes (gloo), mock data", flush=True)
    main_run = train(args.config, args.schedule, args.iters, max(1, args.iters // 10), args.nproc, show=True)
    print(f"\n2) {BASELINE}, same model and data, {args.baseline_iters} iterations (for its memory)", flush=True)
    base = train(args.config, BASELINE, args.baseline_iters, args.baseline_iters, args.nproc, False,
                 "--lr-warmup-iters", "0")  # a short run: its warm-up must end before it does

    print(f"\nloss ({args.schedule}): {main_run['first_loss']:.3f} at iteration 1 -> {main_run['final_loss']:.3f} at "
          f"iteration {main_run['train_iters']}")
    print("peak activation memory per pipeline rank (bytes autograd saved for backward, measured), and each\n"
          f"rank's peak relative to {BASELINE}'s largest (its rank 0, which holds the most microbatches):")
    print(f"  {'rank':>4}  {args.schedule:>12}  {BASELINE:>12}  {'vs ' + BASELINE + ' peak':>12}")
    ours, theirs = main_run["peak_activation_bytes"], base["peak_activation_bytes"]
    for r, (a, b) in enumerate(zip(ours, theirs)):
        print(f"  {r:>4}  {a / 2**20:>8.2f} MiB  {b / 2**20:>8.2f} MiB  {a / max(theirs):>12.2f}")
    bubble = main_run.get("measured_bubble_rate")
    if bubble is not None:
        shared = args.nproc > (os.cpu_count() or 1)
        print(f"measured bubble rate ({args.schedule}, median step): {100 * bubble:.1f}% vs {BASELINE} "
              f"{100 * (base.get('measured_bubble_rate') or 0):.1f}%"
              + (f": NOT a speed comparison, {args.nproc} processes share {os.cpu_count()} cores (memory above is "
                 "exact); for speed, where each rank has its own core: scripts/bench/cpu_pipeline.py --pp 2"
                 if shared else ""))
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
