"""CPU benchmark (not a test): the even split against --pipeline-balance auto's layout, with a
vocabulary large enough that the output layer dominates, at pp=2 (each rank its own core).

For each schedule (default 1f1b, v-half, v-zb), `schedule/balance.py` picks the layout from the
model's shape; both layouts then train the tiny GPT on pp gloo ranks.  Per row, from the median
step by time of each launch, then the median over --runs launches:
  step ms         wall time of the step (slowest rank)
  bubble          measured: 1 - busiest rank's op time / makespan (recorded op start/end times)
  sim step        the simulator's makespan for the same op lists fed with the run's own per-stage
                  mean op times (so 'sim speed-up' is the simulator's prediction from measured costs)
  peak MiB        bytes saved for backward, per rank
and, per layout, the per-stage F+B+W measured against the estimate (both relative to stage 1), which
checks the estimate.  Timings on a shared CPU are noisy; nothing here is asserted.  With
--op-clock cpu the ops are timed in each rank's compute-thread CPU time, which other processes do
not inflate: 'sim speed-up' is then what a core per rank would give (step ms stays wall time, and
there is no bubble column: CPU times have no common origin).

  PYTHONPATH=. .venv/bin/python scripts/bench/balanced_v.py --csv /tmp/balanced_v.csv
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from megatron_vshape.argtypes import Parser, check_output_paths, fail, output_path, positive_float, positive_int, \
    quiet_megatron_notices

quiet_megatron_notices()

from cpu_pipeline import write_csv  # noqa: E402  (same directory)
from megatron_vshape.integration.launch import launch  # noqa: E402
from megatron_vshape.schedule import registry  # noqa: E402
from megatron_vshape.schedule.balance import CPU, ModelShape, balance  # noqa: E402
from megatron_vshape.testing.timed_steps import figures, median_over, run_cases  # noqa: E402


def _row(label, tiny, schedule, launches, op_clock):
    """Figures of one case: each launch's median step, then the median over launches."""
    per_launch = [figures([r[label] for r in results], schedule) for results in launches]
    med = median_over(per_launch)
    if op_clock == "cpu":
        med["bubble"] = float("nan")  # op intervals in CPU time do not line up across ranks
    stage = [[c.F + c.B + c.W for c in f["stage_costs"]] for f in per_launch]
    return {"case": label, "schedule": schedule.name, "layout": ",".join(map(str, tiny.pipeline_layout)),
            "step_ms": 1e3 * med["step_s"], "bubble": med["bubble"], "sim_ms": 1e3 * med["sim_s"],
            "peak_mib": [p / 2 ** 20 for p in med["peak_bytes"]],
            "stage_fbw": [statistics.median(x[s] for x in stage) for s in range(schedule.num_stages)]}


def _percent(x: float) -> str:
    return "-" if x != x else f"{x:.1%}"  # nan: not measured


def main(argv=None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=positive_int, default=2)
    p.add_argument("--microbatches", type=positive_int, default=8)
    p.add_argument("--num-layers", type=positive_int, default=8)
    p.add_argument("--hidden-size", type=positive_int, default=256)
    p.add_argument("--seq-length", type=positive_int, default=128)
    p.add_argument("--vocab-size", type=positive_int, default=32000)
    p.add_argument("--micro-batch-size", type=positive_int, default=1)
    p.add_argument("--schedules", nargs="+", default=["1f1b", "v-half", "v-zb"])
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--warmup", type=positive_int, default=1)
    p.add_argument("--runs", type=positive_int, default=3, help="launches; the median over them is reported")
    p.add_argument("--op-clock", choices=("wall", "cpu"), default="wall",
                   help="what op times (the sim columns and the per-stage check) are measured in: wall time, or "
                        "each rank's compute-thread CPU time, which other processes on a shared machine do not "
                        "inflate (the simulator then predicts the step with a core per rank; no bubble column)")
    p.add_argument("--timeout", type=positive_float, default=900)
    p.add_argument("--csv", default=None, type=output_path(), metavar="PATH")
    args = p.parse_args(argv)
    unwritable = check_output_paths(args)
    if unwritable:
        return fail(p.prog, unwritable, 1)
    from megatron_vshape.testing.tiny_gpt import TinyGPT

    shape = ModelShape(args.num_layers, args.hidden_size, args.seq_length, args.vocab_size,
                       micro_batch_size=args.micro_batch_size, dtype_bytes=4, machine=CPU)  # fp32, one core a rank
    tiny = TinyGPT(num_layers=args.num_layers, hidden_size=args.hidden_size, seq_length=args.seq_length,
                   vocab_size=args.vocab_size, micro_batch_size=args.micro_batch_size)
    cases, estimates = {}, {}
    for name in args.schedules:
        b = balance(shape, name, args.pp, args.microbatches)
        even_schedule = registry.build(name, args.pp, args.microbatches)  # what an even run uses today
        for kind, layout, schedule, sim in (("even", b.even_layout, even_schedule, b.even_sim),
                                            ("balanced", b.layout, b.schedule, b.sim)):
            label = f"{name} {kind}"
            cases[label] = (dataclasses.replace(tiny, pipeline_layout=tuple(layout)), schedule)
            estimates[label] = (sim.makespan, [c.F + c.B + c.W for c in shape.stage_costs(layout, args.pp)])
    run = [(label, tiny_, schedule) for label, (tiny_, schedule) in cases.items()]
    launches = [launch(run_cases, args.pp, (run, args.microbatches, args.warmup, args.steps, args.op_clock),
                       timeout=args.timeout, backend="gloo") for _ in range(args.runs)]
    rows = [_row(label, tiny_, schedule, launches, args.op_clock) for label, (tiny_, schedule) in cases.items()]
    print(f"tiny GPT: {args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, vocab "
          f"{args.vocab_size}, micro batch {args.micro_batch_size}; pp={args.pp}, {args.microbatches} microbatches; "
          f"median of {args.runs} launch(es) x median of {args.steps} steps; CPU gloo; ops timed in "
          f"{'wall' if args.op_clock == 'wall' else 'CPU'} time")
    print(f"  {'case':<17} {'layout':<17} {'step ms':>8} {'speed-up':>8} {'sim ms':>8} {'sim speed-up':>12} "
          f"{'pred. speed-up':>14} {'bubble':>7}  peak MiB per rank")
    for r in rows:
        even = next(x for x in rows if x["case"] == f"{r['schedule']} even")
        pred = estimates[f"{r['schedule']} even"][0] / estimates[r["case"]][0]
        r.update(speedup=even["step_ms"] / r["step_ms"], sim_speedup=even["sim_ms"] / r["sim_ms"], pred_speedup=pred)
        print(f"  {r['case']:<17} {r['layout']:<17} {r['step_ms']:>8.1f} {r['speedup']:>8.3f} {r['sim_ms']:>8.1f} "
              f"{r['sim_speedup']:>12.3f} {pred:>14.3f} {_percent(r['bubble']):>7}  "
              + " ".join(f"{x:.1f}" for x in r["peak_mib"]))
    print("\nper-stage F+B+W, measured vs estimated (each relative to stage 1):")
    for r in rows:
        est = estimates[r["case"]][1]
        meas = r["stage_fbw"]
        print(f"  {r['case']:<17} measured " + " ".join(f"{x / meas[1]:.2f}" for x in meas)
              + "   estimated " + " ".join(f"{x / est[1]:.2f}" for x in est))
    write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
