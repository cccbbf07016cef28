#!/usr/bin/env python3
"""A sweep's logs side by side, the way the paper compares schedules: CSV, table and plots.

    python scripts/bench/report.py out/sweep-cpu/ --csv out/sweep-cpu/report.csv --plot out/sweep-cpu/report.png

Reads every log given (files, or folders searched for *.log / *.out / *.txt).  One log is one run:
the training driver's rank 0 prints `VSHAPE_SUMMARY {json}` at its end; the launchers
(scripts/slurm/pretrain.sbatch, scripts/bench/sweep_cpu.py) add `VSHAPE_EXIT {"exit_code": N}`, and the
submit scripts a `VSHAPE_RUN {json}` line naming the run before it starts.  A log without a summary,
or with a non-zero exit, is a FAILED run and is shown as one (never dropped).

Per run it shows: throughput (tokens/s), speed-up over 1F1B of the same model and sizes (model, pp,
tp, dp, microbatches, micro-batch size, sequence length), the planner's speed-up for that run (the
simulator fed with the op costs the run measured, `measured_costs`: 1F1B's makespan over the
schedule's), the paper's figure where the run is one of the paper's configurations, and peak
memory: activations (max over pipeline ranks, and relative to 1F1B) and the allocator's peak.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

MARKERS = ("VSHAPE_RUN", "VSHAPE_METRICS", "VSHAPE_SUMMARY", "VSHAPE_EXIT")
LOG_SUFFIXES = (".log", ".out", ".txt")
BASELINE = "1f1b"
# Paper: Qi, Wan, Amar, Lin, "Pipeline Parallelism with Controllable Memory", NeurIPS 2024,
# arXiv 2405.15362; table numbers of arXiv v1 (what was read, and how: configs/paper/SOURCES.md).
# Its MFU (%) per schedule for one setting of a paper config, keyed (config_name, seq_length,
# num_microbatches), None meaning any: Table 4 is pure pipeline parallelism at a fixed size, Table 3
# the best of a DP/TP/PP/micro-batch grid search (so its runs' microbatch counts differ per schedule).
PAPER_MFU: Dict[Tuple[str, Optional[int], Optional[int]], Tuple[str, Dict[str, float]]] = {
    ("paper-38.5b", None, 512): ("Table 4", {"1f1b": 47.1, "v-zb": 53.2, "v-half": 51.8, "v-min": 43.7}),
    ("paper-98.5b", 1024, None): ("Table 3", {"1f1b": 49.81, "v-zb": 57.58, "v-half": 52.60, "v-min": 48.02}),
    ("paper-98.5b", 3072, None): ("Table 3", {"1f1b": 57.25, "v-zb": 56.89, "v-half": 60.34, "v-min": 55.51}),
}


def _paper_text(table: str, mfu: Dict[str, float], schedule: str) -> str:
    versus = "" if schedule == BASELINE else f" vs {mfu[BASELINE]:g}%"
    return f"{mfu[schedule] / mfu[BASELINE]:.2f}x (MFU {mfu[schedule]:g}%{versus}, {table})"


# The paper's figure beside a run: {(config_name, schedule, seq_length, num_microbatches): text}.
PAPER_FIGURES: Dict[Tuple[str, str, Optional[int], Optional[int]], str] = {
    (config, schedule, seq, m): _paper_text(table, mfu, schedule)
    for (config, seq, m), (table, mfu) in PAPER_MFU.items() for schedule in mfu}
# Elsewhere on the pure-pipeline configs: the abstract's range, "in pure pipeline parallelism
# settings, our methods outperform 1F1B by from 7% to 55% in terms of throughput".
PURE_PP_CONFIGS = ("paper-9.6b", "paper-21b", "paper-38.5b")
PAPER_RANGE = {"v-zb": "1.07-1.55x (abstract, V-schedules)", "v-half": "1.07-1.55x (abstract, V-schedules)",
               "v-min": "1.07-1.55x (abstract, V-schedules)", "1f1b": "1.00"}


def paper_figure(run: "Run") -> str:
    """The paper's figure for this run: the most specific PAPER_FIGURES entry, else the abstract's range."""
    if not run.config_name:
        return ""
    for seq in (run.seq_length, None):
        for m in (run.num_microbatches, None):
            text = PAPER_FIGURES.get((run.config_name, run.schedule or "", seq, m))
            if text:
                return text
    return PAPER_RANGE.get(run.schedule or "", "") if run.config_name in PURE_PP_CONFIGS else ""


MiB = 1024 * 1024


@dataclass
class Run:
    log: str
    status: str = "ok"  # "ok" or "FAILED"
    reason: str = ""  # why FAILED
    exit_code: Optional[int] = None
    config_name: Optional[str] = None
    schedule: Optional[str] = None
    pp: Optional[int] = None
    tp: Optional[int] = None
    dp: Optional[int] = None
    world_size: Optional[int] = None
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    seq_length: Optional[int] = None
    micro_batch_size: Optional[int] = None
    global_batch_size: Optional[int] = None
    num_microbatches: Optional[int] = None
    train_iters: Optional[int] = None
    iterations_logged: int = 0
    first_loss: Optional[float] = None
    final_loss: Optional[float] = None
    median_iter_time_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    peak_activation_bytes: Optional[float] = None  # max over pipeline ranks
    peak_allocated_bytes: Optional[float] = None  # max over pipeline ranks
    measured_bubble_rate: Optional[float] = None
    measured_costs: Optional[dict] = None
    chunks: Optional[int] = None
    schedule_options: Optional[dict] = None  # what the driver built the schedule with (v-auto's memory budget)
    speedup: Optional[float] = None  # tokens/s over 1F1B's, same group
    predicted_speedup: Optional[float] = None  # simulator with this run's measured costs
    prediction_note: str = ""
    activation_vs_1f1b: Optional[float] = None
    paper: str = ""
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def model(self) -> str:
        if self.config_name:
            return self.config_name
        if self.num_layers and self.hidden_size:
            return f"{self.num_layers}L-h{self.hidden_size}"
        return "?"

    @property
    def group(self) -> tuple:
        """Runs that differ only in schedule: their throughputs compare."""
        return (self.model, self.pp, self.tp, self.dp, self.num_microbatches, self.micro_batch_size, self.seq_length)


# ------------------------------------------------------------------------------------------ parsing
def _records(lines: Iterable[str]):
    """(marker, payload) for each machine-readable line; a marker may follow a launcher's prefix."""
    for line in lines:
        for marker in MARKERS:
            at = line.find(marker + " ")
            if at < 0:
                continue
            try:
                yield marker, json.loads(line[at + len(marker) + 1:])
            except json.JSONDecodeError:
                pass  # a line cut by a dying process
            break


def _max(values) -> Optional[float]:
    if isinstance(values, (int, float)):
        return float(values)
    nums = [v for v in (values or []) if isinstance(v, (int, float))]
    return float(max(nums)) if nums else None


_FIELDS = ("config_name", "schedule", "pp", "tp", "dp", "world_size", "num_layers", "hidden_size", "seq_length",
           "micro_batch_size", "global_batch_size", "num_microbatches", "train_iters", "first_loss", "final_loss",
           "median_iter_time_s", "tokens_per_s", "tflops_per_gpu", "measured_bubble_rate", "measured_costs",
           "schedule_options")
_ARG = re.compile(r"--(pipeline-schedule|config)[ =](\S+)")


def _last_attempt(text: str) -> str:
    """The log from its last VSHAPE_RUN line on: a run submitted again into the same --out appends to its
    log (submit_grid.py, sbatch --open-mode=append), and an earlier attempt's summary must not stand for a
    later one that died, was killed or has not started."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if any(marker == "VSHAPE_RUN" for marker, _ in _records([line]))]
    return "".join(lines[starts[-1]:]) if starts else text


def parse_log(path: Path) -> Run:
    text = _last_attempt(Path(path).read_text(errors="replace"))
    run = Run(log=str(path))
    planned, summary, exit_rec, metrics = {}, None, None, []
    for marker, payload in _records(text.splitlines()):
        if marker == "VSHAPE_RUN":
            planned.update(payload)
        elif marker == "VSHAPE_SUMMARY":
            summary = payload
        elif marker == "VSHAPE_EXIT":
            exit_rec = payload
        else:
            metrics.append(payload)
    # What the run was: its summary, else what the submit script planned, else its command line.
    known = dict(planned)
    if summary:
        known.update({k: v for k, v in summary.items() if v is not None})
    if "schedule" not in known or "config_name" not in known:
        for flag, value in _ARG.findall(text):
            if flag == "pipeline-schedule":
                known.setdefault("schedule", value)
            else:
                known.setdefault("config_name", Path(value).stem)
    for name in _FIELDS:
        if name in known:
            setattr(run, name, known[name])
    run.chunks = known.get("virtual_pipeline_model_parallel_size") or known.get("chunks")
    if summary:
        run.peak_activation_bytes = _max(summary.get("peak_activation_bytes"))
        run.peak_allocated_bytes = _max(summary.get("peak_allocated_bytes"))
    run.iterations_logged = len(metrics)
    if metrics and run.first_loss is None:
        run.first_loss = metrics[0].get("loss")
    if exit_rec is not None:
        run.exit_code = exit_rec.get("exit_code")
    reasons = []
    if run.exit_code not in (None, 0):
        reasons.append(f"exit {run.exit_code}")
    if summary is None:
        reasons.append(f"no VSHAPE_SUMMARY (died, killed or unfinished after {len(metrics)} logged iterations)")
    elif summary.get("status") != "ok":
        reasons.append(f"summary status {summary.get('status')!r}")
    if reasons:
        run.status, run.reason = "FAILED", "; ".join(reasons)
    return run


def find_logs(paths: Iterable[str]) -> List[Path]:
    logs = []
    for p in map(Path, paths):
        if p.is_dir():
            logs += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in LOG_SUFFIXES)
        elif p.is_file():
            logs.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such log file or folder")
    return logs


# ------------------------------------------------------------------------------------------ comparing
def predicted_speedup(run: Run) -> Tuple[Optional[float], str]:
    """1F1B's simulated makespan over this schedule's, both under the costs this run measured."""
    from megatron_vshape.schedule import registry
    from megatron_vshape.schedule.errors import ConfigError
    from megatron_vshape.schedule.ops import Costs
    from megatron_vshape.schedule.simulate import simulate

    c = run.measured_costs
    if not c or not run.schedule or not run.pp or not run.num_microbatches:
        return None, "no measured_costs"
    try:
        costs = Costs(float(c["F"]), float(c["B"]), float(c.get("W") or 0.0), float(c.get("C") or 0.0))
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        return None, f"measured_costs unusable: {e}"
    options = dict(run.schedule_options or {})  # as trained: v-auto under its budget, interleaved's chunks
    if run.schedule == "1f1b-interleaved" and run.chunks:
        options.setdefault("chunks", run.chunks)
    try:
        mine = simulate(registry.build(run.schedule, run.pp, run.num_microbatches, costs, **options)).makespan
        base = simulate(registry.build(BASELINE, run.pp, run.num_microbatches, costs)).makespan
    except ConfigError as e:
        return None, str(e)
    return base / mine, ""


def compare(runs: List[Run]) -> List[Run]:
    """Fill speed-up, activation ratio, prediction and paper figure; order by group then schedule."""
    groups: Dict[tuple, List[Run]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    for members in groups.values():
        base = next((r for r in members if r.ok and r.schedule == BASELINE), None)
        for r in members:
            if r.ok:
                r.predicted_speedup, r.prediction_note = predicted_speedup(r)
            if r.ok and base and base.tokens_per_s and r.tokens_per_s:
                r.speedup = r.tokens_per_s / base.tokens_per_s
            if r.ok and base and base.peak_activation_bytes and r.peak_activation_bytes is not None:
                r.activation_vs_1f1b = r.peak_activation_bytes / base.peak_activation_bytes
            r.paper = paper_figure(r)
    order = _schedule_order()
    return sorted(runs, key=lambda r: (tuple(str(x) for x in r.group),
                                       order.get(r.schedule, len(order)), r.schedule or "", r.log))


def _schedule_order() -> Dict[str, int]:
    try:
        from megatron_vshape.schedule import registry

        return {name: i for i, name in enumerate(registry.names())}
    except ImportError:
        return {}


# ------------------------------------------------------------------------------------------ output
CSV_FIELDS = ("model", "schedule", "status", "reason", "exit_code", "pp", "tp", "dp", "world_size", "num_layers",
              "hidden_size", "seq_length", "micro_batch_size", "global_batch_size", "num_microbatches", "train_iters",
              "iterations_logged", "first_loss", "final_loss", "median_iter_time_s", "tokens_per_s",
              "tflops_per_gpu", "speedup", "predicted_speedup", "prediction_note", "paper", "peak_activation_bytes",
              "activation_vs_1f1b", "peak_allocated_bytes", "measured_bubble_rate", "measured_costs", "log")


def write_csv(runs: List[Run], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in runs:
            row = asdict(r)
            row["model"] = r.model
            row["measured_costs"] = json.dumps(r.measured_costs) if r.measured_costs else ""
            w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})


def _num(v, fmt) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def table(runs: List[Run]) -> str:
    head = ("model", "pp", "m", "schedule", "status", "tokens/s", "vs 1F1B", "planner", "paper",
            "act MiB", "act vs 1F1B", "alloc MiB", "bubble", "loss first->final")
    rows = []
    for r in runs:
        loss = f"{_num(r.first_loss, '.3f')}->{_num(r.final_loss, '.3f')}" if r.final_loss is not None else "-"
        rows.append((r.model, _num(r.pp, "d"), _num(r.num_microbatches, "d"), r.schedule or "?",
                     "ok" if r.ok else f"FAILED ({r.reason.split(';')[0]})" if r.reason.startswith("exit") else "FAILED",
                     _num(r.tokens_per_s, ".1f"), _num(r.speedup, ".3f"),
                     _num(r.predicted_speedup, ".3f"), r.paper or "-",
                     _num(r.peak_activation_bytes and r.peak_activation_bytes / MiB, ".2f"),
                     _num(r.activation_vs_1f1b, ".2f"),
                     _num(r.peak_allocated_bytes and r.peak_allocated_bytes / MiB, ".1f"),
                     _num(r.measured_bubble_rate, ".1%"), loss))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    failed = [r for r in runs if not r.ok]
    for r in failed:
        lines.append(f"FAILED: {r.log}: {r.reason}")
    return "\n".join(lines)


def plot(runs: List[Run], path: Path) -> Optional[Path]:
    """Throughput and peak activation memory per schedule, one cluster of bars per model/size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib is not installed; no plot", file=sys.stderr)
        return None
    groups = list(dict.fromkeys(r.group for r in runs))
    schedules = list(dict.fromkeys(r.schedule or "?" for r in runs))
    label = {g: f"{g[0]}\npp={g[1]} m={g[4]}" for g in groups}
    fig, axes = plt.subplots(1, 2, figsize=(max(7.0, 2.2 * len(groups) + 4), 3.8), dpi=80)
    width = 0.8 / max(1, len(schedules))
    panels = ((axes[0], "tokens_per_s", "throughput (tokens/s)", 1.0),
              (axes[1], "peak_activation_bytes", "peak activation memory (MiB, max over ranks)", MiB))
    for ax, attr, title, scale in panels:
        for j, s in enumerate(schedules):
            xs, ys, failed_xs = [], [], []
            for i, g in enumerate(groups):
                r = next((r for r in runs if r.group == g and (r.schedule or "?") == s), None)
                if r is None:
                    continue
                x = i + (j - (len(schedules) - 1) / 2) * width
                if r.ok and getattr(r, attr) is not None:
                    xs.append(x)
                    ys.append(getattr(r, attr) / scale)
                elif not r.ok:
                    failed_xs.append(x)
            bars = ax.bar(xs, ys, width, label=s)
            for x in failed_xs:
                ax.text(x, 0, "FAILED", rotation=90, ha="center", va="bottom", fontsize=7,
                        color=bars.patches[0].get_facecolor() if bars.patches else "red")
        ax.set_xticks(range(len(groups)), [label[g] for g in groups], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(schedules), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def collect(paths: Iterable[str]) -> List[Run]:
    return compare([parse_log(p) for p in find_logs(paths)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Collect a sweep's logs into a CSV, a paper-style table and plots.")
    ap.add_argument("logs", nargs="+", help="log files, or folders holding *.log / *.out / *.txt")
    ap.add_argument("--csv", type=Path, default=None, help="write one row per run here")
    ap.add_argument("--plot", type=Path, default=None, help="write the throughput/memory plot here (PNG)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when any run FAILED")
    a = ap.parse_args(argv)
    try:
        runs = collect(a.logs)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not runs:
        print(f"error: no logs (*{', *'.join(LOG_SUFFIXES)}) under {' '.join(a.logs)}", file=sys.stderr)
        return 2
    print(table(runs))
    if a.csv:
        write_csv(runs, a.csv)
        print(f"csv: {a.csv}")
    if a.plot and plot(runs, a.plot):
        print(f"plot: {a.plot}")
    return 1 if a.strict and any(not r.ok for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
