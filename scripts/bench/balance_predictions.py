"""The planner's prediction (not a measurement): even split against --pipeline-balance auto's layout
for real model shapes, every schedule given, from `schedule/balance.py`'s estimate and the simulator.

  PYTHONPATH=. .venv/bin/python scripts/bench/balance_predictions.py            # the README's table
  PYTHONPATH=. .venv/bin/python scripts/bench/balance_predictions.py --case configs/gpt/gpt-6.7b.yaml:128256:8:32

A case is CONFIG:VOCAB:PP:MICROBATCHES.  Time is the simulated iteration relative to 1F1B's even split
at the same sizes; peak is the most activation memory on any rank relative to 1F1B's rank 0 (plain
stages), both under the estimated stage costs.
"""
from __future__ import annotations

import argparse
import sys

from megatron_vshape.argtypes import Parser
from megatron_vshape.integration.layout import shape_from_config
from megatron_vshape.schedule.balance import compare_balanced, row_cells

CASES = ["configs/gpt/gpt-6.7b.yaml:32000:8:32", "configs/gpt/gpt-6.7b.yaml:128256:8:32",
         "configs/gpt/gpt-6.7b.yaml:32000:16:64", "configs/gpt/gpt-6.7b.yaml:128256:16:64",
         "configs/paper/paper-9.6b.yaml:50257:16:32", "configs/paper/paper-9.6b.yaml:128256:16:32"]
SCHEDULES = ["1f1b", "v-min", "v-half", "v-zb"]


def rows_for(case: str, schedules):
    path, vocab, pp, m = case.rsplit(":", 3)
    shape = shape_from_config(path, int(vocab))
    name = path.rsplit("/", 1)[-1].removesuffix(".yaml")
    out = []
    rows = compare_balanced(shape, int(pp), int(m), names=schedules)
    base = next(r["even"]["makespan"] for r in rows if r["schedule"] == "1f1b")
    for r in rows:
        if "error" in r:
            out.append([name, vocab, pp, m, r["schedule"]] + ["-"] * 7 + ["cannot serve: " + r["error"]])
            continue
        out.append([name, vocab, pp, m, r["schedule"]] + row_cells(r, base))
    return out


def main(argv=None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", nargs="+", default=CASES, metavar="CONFIG:VOCAB:PP:M")
    p.add_argument("--schedules", nargs="+", default=SCHEDULES)
    args = p.parse_args(argv)
    header = ["model", "vocab", "pp", "m", "schedule", "even: bubble", "peak", "time", "balanced layout", "bubble",
              "peak", "time", "speed-up"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for case in args.case:
        for row in rows_for(case, args.schedules):
            print("| " + " | ".join(map(str, row)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
