"""CPU check of the stage-cost estimate (not a test): what one layer, the embedding and the output
layer with the loss cost per microbatch, measured by the runtime, next to `schedule/balance.py`'s
estimate for the CPU machine, at several shapes.

For each shape HIDDEN:VOCAB the tiny GPT trains --steps steps (after --warmup) under v-zb at pp=2
with the even layout; each step's per-stage mean F, B and W (the runtime's recorder, the same table
--pipeline-replan-after reads) is split into per-part costs as re-balancing splits it
(`measured_parts`: a layer from the middle stages, the embedding and the head as what their end
stages took beyond their layers), and the median over steps is printed.  Ops are timed in the
compute thread's CPU time (`--op-clock cpu`, the default), which other processes on a shared
machine do not inflate; `--op-clock wall` times them as training does.  Nothing is asserted.

  PYTHONPATH=. .venv/bin/python scripts/bench/part_costs.py --shapes 128:32000 256:32000 512:16000
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from megatron_vshape.argtypes import Parser, positive_float, positive_int, quiet_megatron_notices

quiet_megatron_notices()

from megatron_vshape.integration.launch import launch  # noqa: E402
from megatron_vshape.schedule.balance import CPU, ModelShape, measured_parts  # noqa: E402
from megatron_vshape.schedule.layout import even  # noqa: E402
from megatron_vshape.testing.timed_steps import measured_stage_costs, run_steps  # noqa: E402

PARTS = (("layer", "a layer"), ("embedding", "embedding"), ("head", "output layer + loss"))


def _rank(rank, world_size, tinies, m, warmup, steps, clock):
    import time

    return [run_steps(tiny, "v-zb", world_size, m, warmup, steps, clock=time.thread_time if clock == "cpu" else None)
            for tiny in tinies]


def _shape(text: str):
    try:
        hidden, vocab = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give HIDDEN:VOCAB, e.g. 256:32000") from None
    if hidden < 4 or hidden % 4 or vocab < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: HIDDEN a multiple of 4 (4 heads), VOCAB >= 1")
    return hidden, vocab


def main(argv=None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_shape, default=[(128, 32000), (256, 32000), (512, 16000)],
                   metavar="HIDDEN:VOCAB")
    p.add_argument("--num-layers", type=positive_int, default=8)
    p.add_argument("--seq-length", type=positive_int, default=128)
    p.add_argument("--microbatches", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--warmup", type=positive_int, default=1)
    p.add_argument("--op-clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--timeout", type=positive_float, default=900)
    args = p.parse_args(argv)
    from megatron_vshape.testing.tiny_gpt import TinyGPT

    pp, layout = 2, even(args.num_layers, 4)
    tinies = [TinyGPT(num_layers=args.num_layers, hidden_size=h, seq_length=args.seq_length, vocab_size=v,
                      micro_batch_size=1) for h, v in args.shapes]
    runs = launch(_rank, pp, (tinies, args.microbatches, args.warmup, args.steps, args.op_clock),
                  timeout=args.timeout, backend="gloo")
    print(f"tiny GPT on CPU (gloo, one thread per rank): {args.num_layers} layers, seq {args.seq_length}, micro batch "
          f"1; v-zb pp={pp}, layout {','.join(map(str, layout))}, {args.microbatches} microbatches; median of "
          f"{args.steps} steps; ops timed in {'CPU' if args.op_clock == 'cpu' else 'wall'} time; ms per microbatch")
    print(f"  {'hidden':>6} {'vocab':>6}  {'part':<20} {'measured F / B / W':>22}  {'estimated F / B / W':>22}")
    for i, (h, v) in enumerate(args.shapes):
        estimate = ModelShape(args.num_layers, h, args.seq_length, v, dtype_bytes=4, machine=CPU).parts()
        steps = []
        for step in range(args.steps):
            table = measured_stage_costs([rank_runs[i]["ops"][step] for rank_runs in runs], len(layout))
            steps.append(measured_parts([dataclasses.replace(c, size=1.0) for c in table], layout, estimate))
        for part, label in PARTS:
            meas = [statistics.median(1e3 * getattr(getattr(s, part), k) for s in steps) for k in "FBW"]
            est = [1e3 * getattr(getattr(estimate, part), k) for k in "FBW"]
            print(f"  {h:>6} {v:>6}  {label:<20} {' / '.join(f'{x:6.2f}' for x in meas):>22}  "
                  f"{' / '.join(f'{x:6.2f}' for x in est):>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
