"""Unequal stages: the stage-costs file (`--stage-costs FILE.json`) and fitting it to a schedule.

The file gives, per stage in model order, the time of one F, B and W for one microbatch (in
the same unit as `--costs`, per stage as simulated: a V stage of plain layers costs half a
rank's share) and the stage's activation size relative to a plain layer stage (default 1):

    {"stage_costs": [{"F": 1.3, "B": 1.2, "W": 0.8, "size": 1.6}, {"F": 1, "B": 1.1, "W": 0.8}, ...]}

A bare list of such entries is read too, and so is a schedule export that carries
"stage_costs" (what was simulated there).  The hop latency C stays with `--costs`.

A file written for S stages serves any schedule whose stage count divides S: 2p entries
(the V's or interleaving's stages) serve 1F1B's p stages by merging consecutive pairs
(times add; size is relative to the coarser plain stage, so it is the mean).
"""
from __future__ import annotations

import json
import math
from typing import Sequence, Tuple

from .errors import ConfigError
from .ops import StageCost

FIELDS = ("F", "B", "W")


def parse(data, source: str = "stage costs") -> Tuple[StageCost, ...]:
    """StageCosts from a decoded file; ConfigError naming the entry, the value and the fix."""
    entries = data.get("stage_costs") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: expected a list of stages, e.g. "
                          '{"stage_costs": [{"F": 1, "B": 1, "W": 1, "size": 1}, ...]} (one entry per stage)')
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"{source}: stage {i} is {entry!r}; give an object with F, B, W (and optionally size)")
        missing = [k for k in FIELDS if k not in entry]
        if missing:
            raise ConfigError(f"{source}: stage {i} has no {', '.join(missing)}; every stage needs F, B and W "
                              "(times of one op for one microbatch) and optionally size (default 1)")
        unknown = sorted(set(entry) - set(FIELDS) - {"size"})
        if unknown:
            raise ConfigError(f"{source}: stage {i} has unknown key(s) {', '.join(unknown)}; use F, B, W, size")
        values = {}
        for k in FIELDS + ("size",):
            v = entry.get(k, 1.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{source}: stage {i} {k}={v!r} is not a number; give a number >= 0")
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{source}: stage {i} {k}={v!r} is negative or not finite; give a number >= 0")
            values[k] = float(v)
        if values["F"] + values["B"] + values["W"] <= 0:
            raise ConfigError(f"{source}: stage {i} has F=B=W=0; give the measured times (> 0 in total)")
        out.append(StageCost(values["F"], values["B"], values["W"], values["size"]))
    return tuple(out)


def read_json(path: str, what: str, hint: str = ""):
    """The JSON in `path`; a missing, unreadable or non-JSON file is a ConfigError naming `what`."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what}: not JSON ({exc}){hint}") from None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read it ({exc.strerror})") from None


def load(path: str) -> Tuple[StageCost, ...]:
    """Read and validate a stage-costs file."""
    return parse(read_json(path, f"--stage-costs {path}"), f"--stage-costs {path}")


def fit(stage_costs: Sequence[StageCost], num_stages: int, what: str = "the schedule") -> Tuple[StageCost, ...]:
    """The stage costs for a schedule of `num_stages` stages: as given, or consecutive groups
    merged when the file is finer (e.g. the V's 2p stages for 1F1B's p)."""
    n = len(stage_costs)
    if n == num_stages:
        return tuple(stage_costs)
    if n % num_stages:
        raise ConfigError(f"stage costs give {n} stages; {what} has {num_stages} stages: give {num_stages} entries "
                          f"(one per stage, in model order; {2 * num_stages} also serve by merging pairs)")
    k = n // num_stages
    groups = [stage_costs[i * k:(i + 1) * k] for i in range(num_stages)]
    return tuple(StageCost(sum(c.F for c in g), sum(c.B for c in g), sum(c.W for c in g), sum(c.size for c in g) / k)
                 for g in groups)


def to_dict(stage_costs: Sequence[StageCost]) -> dict:
    """The file's content (what `load` reads back)."""
    return {"stage_costs": [c.to_dict() for c in stage_costs]}
