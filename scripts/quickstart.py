#!/usr/bin/env python
"""`make demo`: train a tiny GPT on 4 CPU processes (torchrun, gloo) with V-Half on mock data, then
the same model under 1F1B, and show the loss and each pipeline rank's activation memory side by side;
then compare speed at pp=2, where each rank can have its own core.

    .venv/bin/python scripts/quickstart.py [--iters 30] [--schedule v-half] [--config FILE]

Draws the schedule's timeline (the planner's picture) first, streams the driver's per-interval
lines while it trains, and ends with the comparison tables.  Step times at pp=4 on a machine with
fewer cores than ranks measure who got a core, not the schedule, so the output says so and the
speed comparison runs at pp=2: 1F1B, V-Half and V-ZB in the same launches, the median of each
launch's steps and of --speed-runs launches, with the simulator's prediction from the op costs
those launches measured beside it (megatron_vshape/testing/timed_steps.py, as
scripts/bench/cpu_pipeline.py).  Exit status: the first failing run's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_vshape.argtypes import Parser, positive_int  # noqa: E402
from megatron_vshape.testing import timed_steps  # noqa: E402  (no torch: cores() and the sizes)

BASELINE = "1f1b"
# The speed comparison: pp=2, the V's four stages one layer each, ops of milliseconds (timed_steps.SIZES).
SPEED_PP, SPEED_MICROBATCHES = 2, 8
SPEED_SCHEDULES = (BASELINE, "v-half", "v-zb")


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


def speed(runs: int, steps: int, warmup: int = 1) -> dict:
    """{schedule: timed_steps.median_over(...)} of SPEED_SCHEDULES at SPEED_PP: `runs` launches, each
    running every schedule for warmup + steps steps (the order rotated per launch)."""
    from megatron_vshape.argtypes import quiet_megatron_notices

    quiet_megatron_notices()  # in the ranks too
    from megatron_vshape.integration.launch import launch
    from megatron_vshape.schedule import registry
    from megatron_vshape.testing.timed_steps import SIZES, figures, median_over, rotated, run_cases
    from megatron_vshape.testing.tiny_gpt import TinyGPT

    tiny = TinyGPT(num_layers=2 * SPEED_PP, **SIZES)
    per_launch = {name: [] for name in SPEED_SCHEDULES}
    for k in range(runs):
        cases = [(name, tiny, name) for name in rotated(SPEED_SCHEDULES, k)]
        results = launch(run_cases, SPEED_PP, (cases, SPEED_MICROBATCHES, warmup, steps), timeout=600, backend="gloo")
        for name in SPEED_SCHEDULES:
            per_launch[name].append(figures([r[name] for r in results], registry.build(name, SPEED_PP, SPEED_MICROBATCHES)))
    return {name: median_over(f) for name, f in per_launch.items()}


def speed_heading(runs: int, steps: int) -> str:
    sizes = timed_steps.SIZES
    return (f"3) speed, where each rank has its own core: {', '.join(SPEED_SCHEDULES)} at pp={SPEED_PP}, "
            f"{SPEED_MICROBATCHES} microbatches, a {2 * SPEED_PP}-layer GPT (hidden {sizes['hidden_size']}, seq "
            f"{sizes['seq_length']}, micro batch {sizes['micro_batch_size']}), {runs} launches of {SPEED_PP} "
            f"processes x {steps} steps each")


def print_speed(rows: dict, runs: int, steps: int, cores: int) -> None:
    base = rows[BASELINE]
    print(f"  {'schedule':<8} {'step ms':>8} {'vs ' + BASELINE:>8} {'simulated vs ' + BASELINE:>18} {'bubble':>7} "
          f"{'sim bubble':>10}  peak MiB per rank")
    for name, r in rows.items():
        print(f"  {name:<8} {1e3 * r['step_s']:>8.1f} {base['step_s'] / r['step_s']:>8.3f} "
              f"{base['sim_s'] / r['sim_s']:>18.3f} {r['bubble']:>7.1%} {r['sim_bubble']:>10.1%}  "
              + " ".join(f"{b / 2 ** 20:.2f}" for b in r["peak_bytes"]))
    print(f"step ms: the median over {runs} launch(es) of each launch's median step of {steps} (the slowest rank); "
          f"vs {BASELINE}: its step time over this one's (above 1 is faster); simulated: the same ratio from the "
          "simulator fed with the op costs each launch measured (the planner's prediction)")
    if SPEED_PP > cores:
        print(f"note: this process may use {cores} core(s), fewer than the {SPEED_PP} ranks: these times are not a "
              "speed comparison either")


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny", "tiny-cpu.yaml"))
    ap.add_argument("--schedule", default="v-half")
    ap.add_argument("--iters", type=int, default=30, help="training iterations of the main run")
    ap.add_argument("--baseline-iters", type=int, default=3, help="iterations of the 1F1B run (memory only)")
    ap.add_argument("--nproc", type=int, default=4, help="processes (= pipeline size in the config)")
    ap.add_argument("--out", default=os.path.join(ROOT, "out"))
    ap.add_argument("--speed-runs", type=positive_int, default=3,
                    help="launches of the pp=2 speed comparison (the median over them)")
    ap.add_argument("--speed-steps", type=positive_int, default=5,
                    help="measured steps per schedule and launch (the median)")
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
    cores = timed_steps.cores()
    if bubble is not None:
        print(f"measured bubble rate at pp={pp} ({args.schedule}, median step): {100 * bubble:.1f}% vs {BASELINE} "
              f"{100 * (base.get('measured_bubble_rate') or 0):.1f}%"
              + (f": NOT a speed comparison: {args.nproc} ranks share {cores} core(s), so a rank waits for a core, "
                 "not for the schedule (the memory above is exact); speed is compared below, at pp=2"
                 if args.nproc > cores else ""))
    print("\n" + speed_heading(args.speed_runs, args.speed_steps), flush=True)
    print_speed(speed(args.speed_runs, args.speed_steps), args.speed_runs, args.speed_steps, cores)
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
