"""CPU benchmark (not a test): every schedule on the tiny GPT, next to torch.distributed.pipelining's ZBV and 1F1B on the same model.

For each pp, one launch of pp gloo ranks runs, per schedule, --warmup + --steps steps and reports,
all from ONE step, the median one by step time (so a row's figures describe the same step):
  step ms        wall time of that step (slowest rank, ranks released together by a barrier)
  bubble         measured: 1 - busiest rank's op time / makespan, from recorded op start/end times
  sim bubble     the simulator's bubble rate for the same op lists fed with that step's measured
                 per-stage op costs (megatron_vshape/testing/timed_steps.py)
  overhead       measured makespan / simulated makespan (same measured costs)
  peak bytes     bytes of tensors saved for backward, per rank (max over ranks shown, and per rank in CSV)
The makespan (first op start to last op end, all ranks) lies inside the step; a row where it does
not is refused, not written.  torch.distributed.pipelining rows have no op times (its schedules do
not expose them): step time and peak bytes only.  Timings on an oversubscribed CPU are noisy;
nothing here is asserted.

  .venv/bin/python scripts/bench/cpu_pipeline.py --pp 2 4 --csv /tmp/cpu_pipeline.csv
"""
from __future__ import annotations

import argparse
import csv
import sys
import time

from megatron_vshape.argtypes import Parser, check_output_paths, fail, nonnegative_int, output_path, positive_float, \
    positive_int, quiet_megatron_notices

quiet_megatron_notices()  # before the imports below pull in megatron-core (here and in every rank)

from megatron_vshape.integration.launch import launch  # noqa: E402
from megatron_vshape.schedule import registry  # noqa: E402
from megatron_vshape.testing.timed_steps import SIZES, barrier_time, figures, median_step, run_steps, slowest  # noqa: E402

TORCH_SCHEDULES = ("torch-zbv", "torch-1f1b")


class _TorchStage:
    """Adapter: a megatron chunk as a torch.distributed.pipelining stage module."""

    @staticmethod
    def make(chunk, tiny):
        import torch

        class Stage(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.chunk = chunk

            def forward(self, x):
                b = x.shape[0] if chunk.pre_process else x.shape[1]
                pos = torch.arange(tiny.seq_length).expand(b, tiny.seq_length)
                if chunk.pre_process:
                    return self.chunk(x, pos, None)
                self.chunk.set_input_tensor(x)
                return self.chunk(None, pos, None)

        return Stage()


def _torch(tiny, name, pp, m, warmup, steps):
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    from megatron_vshape.runtime.stats import Recorder
    from megatron_vshape.schedule.ops import Placement
    from megatron_vshape.testing.tiny_gpt import batch, build_chunks, init_parallel

    placement = Placement("v", pp, 2) if name == "torch-zbv" else Placement("single", pp, 1)
    init_parallel(1, pp, placement, seed=tiny.seed)
    chunks = build_chunks(tiny, placement)
    rank = torch.distributed.get_rank()
    stages = [PipelineStage(_TorchStage.make(c, tiny), s, placement.num_stages, torch.device("cpu"))
              for c, s in zip(chunks, placement.stages_of(rank))]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))

    if name == "torch-zbv":
        schedule = ScheduleZBVZeroBubble(stages, m, loss_fn=loss_fn)
    else:
        schedule = Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    recorder, times = Recorder(), []
    recorder.exclude_parameters(p for c in chunks for p in c.parameters())
    holds_first = 0 in placement.stages_of(rank)
    holds_last = placement.num_stages - 1 in placement.stages_of(rank)
    for step in range(warmup + steps):
        mbs = [batch(tiny, step, i) for i in range(m)]
        tokens = torch.cat([b["tokens"] for b in mbs])
        labels = torch.cat([b["labels"] for b in mbs])
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        t0 = barrier_time()
        with recorder.saved_tensors():
            schedule.step(*((tokens,) if holds_first else ()), target=labels if holds_last else None)
        elapsed = slowest(time.perf_counter() - t0)
        if step >= warmup:
            times.append(elapsed)
    return {"times": times, "ops": None, "peak": recorder.peak_bytes}


def _rank(rank, world_size, tiny, m, names, warmup, steps):
    out = {}
    for name in names:
        run = _torch if name in TORCH_SCHEDULES else run_steps
        out[name] = run(tiny, name, world_size, m, warmup, steps)
    return out


def check_row(row):
    """Refuse a row whose makespan exceeds the step it was measured in (an inconsistent clock)."""
    if row.get("makespan_ms") is not None and row["makespan_ms"] > row["step_ms"]:
        raise RuntimeError(f"{row['schedule']} pp={row['pp']}: makespan {row['makespan_ms']:.1f} ms > step "
                           f"{row['step_ms']:.1f} ms; the two are not from the same step; not writing this row")
    return row


def bench(pp, m, tiny, names, warmup, steps, timeout):
    results = launch(_rank, pp, (tiny, m, names, warmup, steps), timeout=timeout, backend="gloo")
    rows = []
    base = results[0]["1f1b"]["peak"] if "1f1b" in names else None
    for name in names:
        runs = [r[name] for r in results]
        peak = [r["peak"] for r in runs]
        row = {"pp": pp, "microbatches": m, "schedule": name, "peak_bytes": peak,
               "peak_vs_1f1b": max(peak) / base if base else None}
        if runs[0]["ops"] is None:  # torch's schedules: step time only
            row["step_ms"] = 1e3 * runs[0]["times"][median_step(runs[0]["times"])]
        else:  # the simulator fed with the same step's measured per-stage op costs
            f = figures(runs, registry.build(name, pp, m))
            row.update(step_ms=1e3 * f["step_s"], bubble=f["bubble"], sim_bubble=f["sim_bubble"],
                       overhead=f["makespan_s"] / f["sim_s"], makespan_ms=1e3 * f["makespan_s"],
                       sim_makespan_ms=1e3 * f["sim_s"])
        rows.append(check_row(row))
    return rows


def _fmt(v, spec):
    return format(v, spec) if v is not None else format("-", spec.rstrip("f").split(".")[0])


def print_table(rows, tiny):
    print(f"tiny GPT: hidden={tiny.hidden_size} seq={tiny.seq_length} micro_batch={tiny.micro_batch_size} "
          f"vocab={tiny.vocab_size}; layers per pp: see header; CPU gloo, 1 thread per rank")
    last_pp = None
    for r in rows:
        if r["pp"] != last_pp:
            last_pp = r["pp"]
            print(f"\npp={r['pp']} microbatches={r['microbatches']}")
            print(f"  {'schedule':<17} {'step ms':>8} {'bubble':>7} {'sim bubble':>10} {'overhead':>8} "
                  f"{'max peak B':>11} {'vs 1f1b':>7}")
        print(f"  {r['schedule']:<17} {r['step_ms']:>8.1f} {_fmt(r.get('bubble'), '>7.3f')} "
              f"{_fmt(r.get('sim_bubble'), '>10.3f')} {_fmt(r.get('overhead'), '>8.3f')} "
              f"{max(r['peak_bytes']):>11} {_fmt(r['peak_vs_1f1b'], '>7.3f')}")


def main(argv=None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=positive_int, nargs="+", default=[2, 4])
    p.add_argument("--microbatches", type=positive_int, default=None, help="default 2*pp")
    p.add_argument("--layers-per-stage", type=positive_int, default=1, help="layers per V stage (a 1F1B stage holds twice that)")
    p.add_argument("--hidden-size", type=positive_int, default=SIZES["hidden_size"])  # ops of milliseconds
    p.add_argument("--seq-length", type=positive_int, default=SIZES["seq_length"])
    p.add_argument("--micro-batch-size", type=positive_int, default=SIZES["micro_batch_size"])
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--warmup", type=nonnegative_int, default=1)
    p.add_argument("--schedules", nargs="+", default=None, help="default: every registered schedule and torch's")
    p.add_argument("--timeout", type=positive_float, default=900)
    p.add_argument("--csv", default=None, type=output_path(), metavar="PATH", help="also write the rows as CSV")
    args = p.parse_args(argv)
    unwritable = check_output_paths(args)
    if unwritable:  # before minutes of benchmarking
        return fail(p.prog, unwritable, 1)
    from megatron_vshape.testing.tiny_gpt import TinyGPT  # torch and megatron-core: after the arguments are checked

    names = args.schedules or registry.names() + list(TORCH_SCHEDULES)
    rows = []
    for pp in args.pp:
        m = args.microbatches or 2 * pp
        tiny = TinyGPT(num_layers=2 * pp * args.layers_per_stage, hidden_size=args.hidden_size,
                       seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
        runnable = []
        for name in names:
            try:
                if name not in TORCH_SCHEDULES:
                    registry.build(name, pp, m)
                runnable.append(name)
            except Exception as e:  # a schedule that cannot run these sizes is reported, not benchmarked
                print(f"skip {name} at pp={pp}, microbatches={m}: {e}", file=sys.stderr)
        rows += bench(pp, m, tiny, runnable, args.warmup, args.steps, args.timeout)
    print_table(rows, tiny)
    write_csv(rows, args.csv)
    return 0


def write_csv(rows, path) -> None:
    """The rows as CSV at `path` (nothing when None), one column per key any row has."""
    if not path:
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    sys.exit(main())
