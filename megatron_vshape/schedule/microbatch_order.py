"""Microbatches in order: on every stage, each op kind runs microbatch 0, 1, 2, ... in turn.

Why it matters.  A parameter's gradient is the sum of its microbatches' contributions, added
as the B's (norms, biases, embeddings) and the W's (deferred weight GEMMs) of its stage run.
Floating-point addition is not associative, so only a schedule whose B's and W's run in
microbatch order on every stage adds them in the order of the non-pipelined model, and
gives its gradients bit for bit (any other order runs correctly, the runtime's tests run W's
reversed on purpose, but its gradients agree only within rounding).  The planner and the
solver relabel their orders (below); `problems` says where a schedule is out of order.

Why it costs nothing.  Microbatches are interchangeable, so a search that moves single ops
may leave two of a kind out of order on a stage; `relabel` gives the k-th op of each kind
on a stage microbatch k.  Each stage lives on one rank, so the k-th one there ran after
k ops of its inputs' kind had ended (each op needs its own input), that is after the
k-th input had ended: the same start times stay feasible, and the eager simulation of
the relabelled order ends no later.  Each stage holds as many activations after every op
as before, so the memory peaks are unchanged too.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Dict, List, Sequence

from .ops import B, BACKWARD_KINDS, F, RELEASE_KINDS, W, Op

# The sequences that must each run in microbatch order on a stage: forwards; backwards (B
# or BW: the input gradient, and the gradients autograd accumulates there); weight
# gradients (W or BW: the deferred GEMMs).
_SEQUENCES = (("F", (F,)), ("B", BACKWARD_KINDS), ("W", RELEASE_KINDS))


def problems(ranks: Sequence[Sequence[Op]]) -> List[str]:
    """One line per (sequence, stage) whose microbatches do not increase, naming the first step back."""
    out: List[str] = []
    for name, kinds in _SEQUENCES:
        last: Dict[int, Op] = {}
        for rank, ops in enumerate(ranks):
            for op in ops:
                if op.kind not in kinds:
                    continue
                before = last.get(op.stage)
                if before is not None and before.microbatch > op.microbatch:
                    out.append(f"rank {rank}: {op} after {before}: stage {op.stage}'s {name} ops out of microbatch "
                               f"order (gradients then equal the non-pipelined ones within rounding, not bit for bit; "
                               f"microbatch_order.relabel puts them in order)")
                    last[op.stage] = op  # report each step back once
                elif before is None or before.microbatch < op.microbatch:
                    last[op.stage] = op
    return out


def relabel(ranks: Sequence[Sequence[Op]]) -> List[List[Op]]:
    """The same op lists with the k-th op of each kind on a stage given microbatch k (a W
    takes the microbatch its own B got).  Never longer, same memory (module docstring)."""
    forwards: Counter = Counter()
    backwards: Counter = Counter()
    by_old_b: Dict[int, Dict[int, int]] = defaultdict(dict)  # stage -> old microbatch of a B -> new
    out: List[List[Op]] = []
    for ops in ranks:
        new: List[Op] = []
        for op in ops:
            if op.kind == F:
                mb = forwards[op.stage]
                forwards[op.stage] += 1
            elif op.kind in BACKWARD_KINDS:
                mb = backwards[op.stage]
                backwards[op.stage] += 1
                if op.kind == B:
                    by_old_b[op.stage][op.microbatch] = mb
            else:
                mb = None
            new.append(op if mb is None else Op(op.kind, mb, op.stage))
        out.append(new)
    # A W's new microbatch is its B's; W's were out of order only if their B's were, or
    # if the W's themselves were: sort the W's of each stage into the slots W's hold.
    for ops in out:
        slots: Dict[int, List[int]] = defaultdict(list)
        for i, op in enumerate(ops):
            if op.kind == W:
                slots[op.stage].append(i)
        for stage, where in slots.items():
            mbs = sorted(by_old_b[stage][ops[i].microbatch] for i in where)
            for i, mb in zip(where, mbs):
                ops[i] = Op(W, mb, stage)
    return out
