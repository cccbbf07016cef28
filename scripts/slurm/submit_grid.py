#!/usr/bin/env python3
"""Submit the paper's comparison grid (configs x schedules x microbatch counts) as one SLURM job
per run, each through scripts/slurm/pretrain.sbatch, after validating EVERY run first.

    python scripts/slurm/submit_grid.py --configs configs/paper/*.yaml --gpus-per-node 8 \
        --schedules 1f1b,1f1b-interleaved,v-min,v-half,v-zb --microbatches-per-pp 2,4 \
        --sbatch-arg=--partition=gpu --sbatch-arg=--time=00:30:00 --out out/sweep-paper
    python scripts/bench/report.py out/sweep-paper --csv out/sweep-paper/report.csv --plot out/sweep-paper/report.png

Per run: global batch = m x micro-batch x data-parallel size (m = each --microbatches-per-pp times
pp, or each --microbatches); GPUs = tp x pp x dp, on ceil(GPUs / --gpus-per-node) nodes (or
--nodes).  Each run's log, `OUT/<config>__<schedule>__m<m>.out`, starts with a `VSHAPE_RUN {json}`
line naming it, so the report lists a run that died before printing anything as FAILED.
Flags after `--` go to every run's pretrain_gpt.py (they override the config file).

Validation happens before any sbatch, with the driver's own parsing (`integration.train.parse_args`:
config keys, flag values, defaults) and start-up checks (`integration.train.validate`, what the ranks
run, for GPUs unless --no-gpus; only the paths to read and write are left to the nodes, whose
storage this host may not see): flag values and combinations, model sizes (heads, layers per stage),
a global batch that is not a multiple of micro-batch x data-parallel size, too few microbatches for
a schedule, and a job with fewer GPUs than tp x pp needs.  Any bad run: one line per problem naming the value and the fix, exit 2,
nothing submitted.  --dry-run validates and prints the sbatch commands only.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = ROOT / "scripts" / "slurm" / "pretrain.sbatch"
GRID_SCHEDULES = ("1f1b", "1f1b-interleaved", "v-min", "v-half", "v-zb")
sys.path.insert(0, str(ROOT))

from megatron_vshape.integration.train import parse_args, validate  # noqa: E402
from megatron_vshape.schedule.errors import ConfigError  # noqa: E402


def driver_args(config: Path, schedule: str, passthrough: List[str]) -> argparse.Namespace:
    """The Namespace the driver itself will parse from this run's command line (config file, then
    flags), with the driver's defaults, so submit-time validation sees exactly what the ranks see."""
    try:
        return parse_args(["--config", str(config), "--pipeline-schedule", schedule, *passthrough])
    except SystemExit:  # argparse already printed the driver's one-line error
        raise ConfigError(f"the driver refuses these flags for {config.name} (see the line above)") from None


def validate_run(args: argparse.Namespace, world: int, global_batch: Optional[int], gpus: bool = True):
    """The driver's own start-up validation (integration.train.validate) for `world` processes with or
    without GPUs, but for the paths, which the nodes may see and this host not; returns its PipelinePlan."""
    if global_batch is not None:
        args.global_batch_size = global_batch
    args.data_parallel_size = None  # dp = world / (tp x pp x cp), as Megatron derives it
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * (world // max(1, args.tensor_model_parallel_size *
                                                                        args.pipeline_model_parallel_size))
    return validate(args, world_size=world, cuda=gpus, check_paths=False)  # a schedule at pp < 2 is refused


@dataclass
class Run:
    config: Path
    schedule: str
    microbatches: Optional[int]  # None: the config's global batch decides
    args: Dict[str, object] = field(default_factory=dict)
    nodes: int = 0
    world: int = 0
    name: str = ""

    @property
    def log(self) -> str:
        return f"{self.name}.out"


def plan_run(config: Path, schedule: str, m: Optional[int], per_pp: Optional[int], passthrough: List[str], a) -> Run:
    """Resolve one grid point to the driver's arguments and a job shape; raise ConfigError if it cannot run."""
    args = driver_args(config, schedule, passthrough)
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    cp = getattr(args, "context_parallel_size", None) or 1
    needed = tp * pp * cp * a.dp
    nodes = a.nodes or max(1, math.ceil(needed / a.gpus_per_node))
    world = nodes * a.gpus_per_node
    where = f"{config.name} {schedule}"
    if world < tp * pp * cp:
        raise ConfigError(f"{where}: the run needs tp x pp x cp = {tp}x{pp}x{cp} = {tp * pp * cp} GPUs but the job "
                          f"has --nodes={nodes} x --gpus-per-node={a.gpus_per_node} = {world}; use "
                          f"--nodes={math.ceil(tp * pp * cp / a.gpus_per_node)}")
    if world != needed:
        raise ConfigError(f"{where}: --nodes={nodes} x --gpus-per-node={a.gpus_per_node} = {world} GPUs is not "
                          f"tp x pp x cp x --dp = {tp}x{pp}x{cp}x{a.dp} = {needed}; use "
                          f"--dp={world // (tp * pp * cp)} or --gpus-per-node/--nodes that give {needed}"
                          if world % (tp * pp * cp) == 0 else
                          f"{where}: {world} GPUs (--nodes={nodes} x --gpus-per-node={a.gpus_per_node}) do not "
                          f"split into tp x pp x cp = {tp * pp * cp}; use a multiple of {tp * pp * cp} GPUs")
    if per_pp is not None:
        m = per_pp * pp
    plan = validate_run(args, world, None if m is None else m * args.micro_batch_size * a.dp, not a.no_gpus)
    m = plan.num_microbatches
    return Run(config, schedule, m, vars(args), nodes, world, f"{Path(config).stem}__{schedule}__m{m}")


def driver_argv(run: Run, passthrough: List[str]) -> List[str]:
    """The run's pretrain_gpt.py flags: its config, schedule and global batch, then the user's flags."""
    return ["--config", str(run.config), "--pipeline-schedule", run.schedule,
            "--global-batch-size", str(run.args["global_batch_size"])] + passthrough


def sbatch_cmd(run: Run, out: Path, a, passthrough: List[str]) -> List[str]:
    cmd = ["sbatch", "--parsable", f"--job-name=vshape-{run.name}", f"--nodes={run.nodes}",
           f"--output={out / run.log}", "--open-mode=append",
           f"--export=ALL,NPROC_PER_NODE={a.gpus_per_node}"]
    if not a.no_gpus:
        cmd.append(f"--gpus-per-node={a.gpus_per_node}")
    cmd += list(a.sbatch_arg) + [str(SBATCH_SCRIPT)] + driver_argv(run, passthrough)
    return cmd


def _ints(text: str, flag: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers, e.g. 2,4") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r}: expected integers >= 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Validate, then submit configs x schedules x microbatch counts to SLURM.",
                                 epilog="Flags after -- go to every run's scripts/pretrain_gpt.py.")
    ap.add_argument("--configs", nargs="+", required=True, type=Path, help="config YAML files (configs/...)")
    ap.add_argument("--schedules", default=",".join(GRID_SCHEDULES), help="comma-separated schedule names")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--microbatches-per-pp", default=None,
                   help="microbatch counts as multiples of each config's pp, e.g. 2,4 (m = 2pp and 4pp)")
    g.add_argument("--microbatches", default=None, help="absolute microbatch counts, e.g. 16,32")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (processes) per node (default 8)")
    ap.add_argument("--nodes", type=int, default=None, help="nodes per job (default: what tp x pp x dp needs)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size of every run (default 1)")
    ap.add_argument("--no-gpus", action="store_true",
                    help="CPU nodes: do not ask SLURM for GPUs (--gpus-per-node then counts processes)")
    ap.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                    help="extra sbatch option for every job, e.g. --sbatch-arg=--partition=gpu (repeatable)")
    ap.add_argument("--out", type=Path, default=Path("out/sweep-slurm"), help="folder for the job logs")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the sbatch commands; submit nothing")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    a = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        for flag in ("gpus_per_node", "dp", "nodes"):
            value = getattr(a, flag)
            if value is not None and value < 1:
                raise ConfigError(f"--{flag.replace('_', '-')}={value} must be >= 1")
        schedules = [s.strip() for s in a.schedules.split(",") if s.strip()]
        counts = [(None, None)]
        if a.microbatches_per_pp:
            counts = [(None, k) for k in _ints(a.microbatches_per_pp, "--microbatches-per-pp")]
        elif a.microbatches:
            counts = [(m, None) for m in _ints(a.microbatches, "--microbatches")]
        if any(t.split("=")[0] == "--global-batch-size" for t in passthrough) and (a.microbatches or a.microbatches_per_pp):
            raise ConfigError("--global-batch-size after -- and --microbatches/--microbatches-per-pp both set the "
                              "global batch; pass one of them")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs, errors = [], []
    for config in a.configs:
        for schedule in schedules:
            for m, per_pp in counts:
                try:
                    runs.append(plan_run(config, schedule, m, per_pp, passthrough, a))
                except ConfigError as e:
                    text = str(e)
                    errors.append(text if text.startswith(config.name) else f"{config.name} {schedule}: {text}")
    if errors:
        for e in dict.fromkeys(errors):
            print(f"error: {e}", file=sys.stderr)
        print(f"nothing submitted: {len(errors)} of {len(errors) + len(runs)} runs do not validate", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out.resolve()
    for run in runs:
        cmd = sbatch_cmd(run, out, a, passthrough)
        if a.dry_run:
            print(shlex.join(cmd))
            continue
        planned = {"config_name": run.config.stem, "schedule": run.schedule, "num_microbatches": run.microbatches,
                   "pp": run.args.get("pipeline_model_parallel_size"), "tp": run.args.get("tensor_model_parallel_size", 1),
                   "dp": a.dp, "micro_batch_size": run.args.get("micro_batch_size", 1),
                   "seq_length": run.args.get("seq_length"), "num_layers": run.args.get("num_layers"),
                   "hidden_size": run.args.get("hidden_size"), "nodes": run.nodes, "world_size": run.world}
        with open(out / run.log, "a") as f:
            f.write(f"VSHAPE_RUN {json.dumps(planned)}\n")
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            print(f"error: sbatch failed for {run.name} (exit {done.returncode}): {done.stderr.strip()}", file=sys.stderr)
            return 1
        job = done.stdout.strip().split(";")[0]
        print(f"submitted {job} {run.name} nodes={run.nodes} log={out / run.log}", flush=True)
    if not a.dry_run:
        print(f"report: python scripts/bench/report.py {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
