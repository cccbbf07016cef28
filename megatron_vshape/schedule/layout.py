"""Layers per stage (a layout), in model order: parsing, Megatron's layer-split flags, checks.

Pure Python (no torch): the driver validates a layout before any process group, the runtime
builds chunks from the same tuple.  A layout is one count per stage, stage 0 first; the
placement decides which rank holds a stage (on the V, rank r holds stages r and 2p-1-r).

Megatron's flags keep their meaning, read on the schedule's stages:

* `first`/`last` (--decoder-first/last-pipeline-num-layers): the layers of the first and the last
  stage.  On the V that is stage 0 and stage 2p-1 (both on rank 0); on one chunk per rank the
  first and last rank; interleaved, every chunk of the first (last) rank gets first/chunks, as
  Megatron splits them.
* `embedding`/`loss` (--account-for-embedding/loss-in-pipeline-split): the embedding (the loss)
  counts as one layer of stage 0 (stage S-1) when the layers are split, so that stage builds one
  transformer layer fewer.

What does not split evenly goes to the stages nearest the middle of the model, farthest from
the embedding and the output layer (which sit on the end stages: on the V both on rank 0).
"""
from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

from .errors import ConfigError
from .ops import Placement

Layout = Tuple[int, ...]


def spread(units: int, stages: Sequence[int]) -> dict:
    """{stage: count}: `units` over `stages` as evenly as possible, the remainder to the stages
    nearest the middle of `stages` (ties to the earlier stage)."""
    k = len(stages)
    base, extra = divmod(units, k) if k else (0, 0)
    centre = (k - 1) / 2
    favoured = set(sorted(range(k), key=lambda i: (abs(i - centre), i))[:extra])
    return {s: base + (i in favoured) for i, s in enumerate(stages)}


def even(num_layers: int, num_stages: int) -> Layout:
    """The default layout: num_layers/num_stages each, any remainder nearest the middle."""
    counts = spread(num_layers, list(range(num_stages)))
    return tuple(counts[s] for s in range(num_stages))


def even_split(num_layers: int, placement: Placement, name: str, flag: str = "--num-layers") -> Layout:
    """The even split when no layout is given, or ConfigError when it would leave a middle stage
    without a layer (fewer layers than middle stages).  The end stages may have none: they still
    hold the embedding (stage 0) and the output layer with the loss (the last), which is work, and
    what balancing picks for a large vocabulary (0,4,4,0); a middle stage would hold nothing."""
    S = placement.num_stages
    if num_layers < S - 2:
        raise ConfigError(f"{flag}={num_layers} is too few for {name} at pp={placement.pp}: each of its {S - 2} middle "
                          f"stages needs a layer (only the first and the last may hold just the embedding or the "
                          f"loss); use at least {S - 2} layers or fewer pipeline stages")
    return even(num_layers, S)


def _end_stages(placement: Placement) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """The stages Megatron's 'first' and 'last' pipeline stage mean under this placement."""
    last = placement.num_stages - 1
    if placement.kind == "v":
        return (0,), (last,)
    return tuple(placement.stages_of(0)), tuple(placement.stages_of(placement.pp - 1))


def megatron_split(num_layers: int, placement: Placement, first: Optional[int] = None, last: Optional[int] = None,
                   embedding: bool = False, loss: bool = False) -> Layout:
    """The layout Megatron's layer-split flags give on this placement (module docstring)."""
    S = placement.num_stages
    if (first is not None or last is not None) and (embedding or loss):
        raise ConfigError("--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split "
                          "cannot be combined (as in Megatron); pass one kind, or give --pipeline-layout")
    counts, fixed = {}, 0
    for flag, value, stages in (("--decoder-first-pipeline-num-layers", first, _end_stages(placement)[0]),
                                ("--decoder-last-pipeline-num-layers", last, _end_stages(placement)[1])):
        if value is None:
            continue
        if value < 0 or value % len(stages):
            raise ConfigError(f"{flag}={value} must be >= 0 and split over the {len(stages)} chunk(s) of its rank; "
                              f"use a multiple of {len(stages)}")
        counts.update({s: value // len(stages) for s in stages})
        fixed += value
    rest = [s for s in range(S) if s not in counts]
    units = num_layers - fixed + embedding + loss
    if units < 0 or (units and not rest):
        raise ConfigError(f"--num-layers={num_layers} does not match --decoder-first/last-pipeline-num-layers "
                          f"(first={first}, last={last}) on {S} stages; they leave {units} layers for "
                          f"{len(rest)} other stage(s): make them add up")
    counts.update(spread(units, rest))
    counts[0] -= embedding
    counts[S - 1] -= loss
    if min(counts.values()) < 0:
        raise ConfigError(f"--num-layers={num_layers} is too few for --account-for-embedding/loss-in-pipeline-split "
                          f"on {S} stages (a stage would build fewer than 0 layers); add layers or drop the flag")
    return tuple(counts[s] for s in range(S))


_REPEAT = (re.compile(r"\(([^()]*)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))


def parse(text: str, flag: str = "--pipeline-layout") -> Layout:
    """Layers per stage from "3,4,4,3" or Megatron's layout syntax ("Et*3|t*4|...|t*3L": stages split
    by '|', 't' a transformer layer, 'E' the embedding in the first stage, 'L' the loss in the last,
    `x*n` and `(..)*n` repeat); either way in model order."""
    text = str(text).strip()
    if not set(text) & set("|EtL()*"):  # a list of counts
        items = [v.strip() for v in text.split(",")]
        bad = [v for v in items if not re.fullmatch(r"-?\d+", v)]
        if bad:
            raise ConfigError(f"{flag} {text}: {bad[0]!r} is not a layer count; give whole numbers like 3,4,4,3 "
                              "(one per stage, model order)")
        return tuple(int(v) for v in items)
    expanded = text.replace(",", "").replace(" ", "")
    for pattern in _REPEAT:
        while pattern.search(expanded):
            expanded = pattern.sub(lambda m: m.group(1) * int(m.group(2)), expanded)
    stages = expanded.split("|")
    bad = sorted(set(expanded) - set("EtL|"))
    if bad:
        raise ConfigError(f"{flag} {text}: unknown layer character(s) {''.join(bad)}; give counts like 3,4,4,3 or "
                          "Megatron's syntax with E (embedding, first stage), t (layer), L (loss, last stage)")
    if expanded.count("E") != 1 or not stages[0].startswith("E") or expanded.count("L") != 1 \
            or not stages[-1].endswith("L"):
        raise ConfigError(f"{flag} {text}: the embedding E must open the first stage and the loss L close the last "
                          "(once each); other placements of them are not supported")
    return tuple(s.count("t") for s in stages)


def check(layout: Sequence[int], num_layers: int, placement: Placement, name: str,
          flag: str = "--pipeline-layout", text: Optional[str] = None) -> Layout:
    """`layout` as a tuple, or ConfigError naming the value (`text` as the user gave it) and the fix."""
    layout = tuple(layout)
    shown = text or ",".join(map(str, layout))
    S = placement.num_stages
    if len(layout) != S:
        per = {"v": "2 per rank, along the V", "loop": f"{placement.chunks} per rank"}.get(placement.kind, "one per rank")
        raise ConfigError(f"{flag} {shown} gives {len(layout)} stages; --pipeline-schedule {name} at pp={placement.pp} "
                          f"has {S} ({per}): give {S} counts in model order")
    negative = [i for i, n in enumerate(layout) if n < 0]
    if negative:
        raise ConfigError(f"{flag} {shown}: stage {negative[0]} has {layout[negative[0]]} layers; give counts >= 0")
    empty = [s for s, n in enumerate(layout) if n == 0 and 0 < s < S - 1]
    if empty:
        raise ConfigError(f"{flag} {shown}: stage {empty[0]} has no layers and neither the embedding nor the loss; "
                          "give every middle stage at least 1 layer")
    if sum(layout) != num_layers:
        raise ConfigError(f"{flag} {shown} sums to {sum(layout)} layers but --num-layers={num_layers}; "
                          "make them equal")
    return layout


def describe(layout: Sequence[int], placement: Placement) -> str:
    """'3,4,4,3 (layers per rank 6, 8)': the layout and what each rank holds."""
    per_rank = [sum(layout[s] for s in placement.stages_of(r)) for r in range(placement.pp)]
    return f"{','.join(map(str, layout))} (layers per rank {', '.join(map(str, per_rank))})"


def to_megatron(layout: Sequence[int]) -> str:
    """Megatron's layout syntax for these stages in model order: 'Et*3|t*4|t*3L'."""
    last = len(layout) - 1
    return "|".join("E" * (s == 0) + (f"t*{n}" if n else "") + "L" * (s == last) for s, n in enumerate(layout))
