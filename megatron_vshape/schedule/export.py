"""Schedules to and from files: the JSON format of docs/architecture.md and torch.distributed.pipelining's CSV.

JSON (stable, other tools read it): the per-rank compute op lists with the simulated figures.
torch-csv: one row per rank, one action per cell, as `_PipelineScheduleRuntime._load_csv`
(format "compute_only") reads it: `{stage}{type}{microbatch}` with torch's letters
F (forward), I (input-gradient backward), W (weight-gradient backward), B (full backward).
Torch lowers the compute actions to send/recv itself, so no communication is written.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
from typing import List, Optional

from .errors import ConfigError
from .ops import B, BW, F, W, Costs, Op, Placement, Schedule
from .simulate import SimResult, simulate
from .stage_costs import parse as parse_stage_costs
from .verify import verify

FORMATS = ("json", "torch-csv")

# Our op kinds -> torch's computation types; torch's "B" is our combined BW.
TORCH_LETTER = {F: "F", B: "I", W: "W", BW: "B"}
FROM_TORCH_LETTER = {v: k for k, v in TORCH_LETTER.items()}
_TORCH_ACTION = re.compile(r"^(\d+)([FIWB])(\d+)$")


def to_dict(schedule: Schedule, sim: Optional[SimResult] = None) -> dict:
    """The export format of docs/architecture.md (plus `chunks`, and `forward_only` for a forward-only view),
    with the figures of one simulation."""
    sim = simulate(schedule) if sim is None else sim
    extra = {"forward_only": True} if schedule.meta.get("forward_only") else {}
    if schedule.stage_costs is not None:
        extra["stage_costs"] = [c.to_dict() for c in schedule.stage_costs]
    if schedule.memory_budget is not None:
        extra["memory_budget"] = schedule.memory_budget
    if schedule.meta.get("group"):  # 1f1b-interleaved's microbatch group: the papers' prediction reads it
        extra["group"] = int(schedule.meta["group"])
    return {
        "schedule": schedule.name,
        "pp": schedule.pp,
        "microbatches": schedule.microbatches,
        "placement": schedule.placement.kind,
        "chunks": schedule.placement.chunks,
        "costs": schedule.costs.to_dict(),
        "ranks": [[op.to_dict() for op in ops] for ops in schedule.ranks],
        **sim.to_dict(),
        **extra,
    }


def to_json(schedule: Schedule, sim: Optional[SimResult] = None) -> str:
    return json.dumps(to_dict(schedule, sim), indent=None, separators=(", ", ": ")) + "\n"


def from_dict(data: dict) -> Schedule:
    """Read an exported schedule back; the result is verified (figures are recomputed, not trusted)."""
    try:
        pp = int(data["pp"])
        ranks = [[Op(d["op"], int(d["microbatch"]), int(d["stage"])) for d in ops] for ops in data["ranks"]]
        kind = data["placement"]
        stages = 1 + max((op.stage for ops in ranks for op in ops), default=0)
        chunks = int(data.get("chunks") or -(-stages // pp))
        costs = Costs(**{k: float(v) for k, v in data.get("costs", {}).items()})
        forward_only = data.get("forward_only", False) is True
        meta = {"forward_only": True} if forward_only else {}
        if data.get("group") is not None:
            meta["group"] = int(data["group"])
        stage_costs = None if data.get("stage_costs") is None else parse_stage_costs(data["stage_costs"], "stage_costs")
        budget = data.get("memory_budget")
        budget = None if budget is None else float(budget)
        schedule = Schedule(str(data["schedule"]), Placement(kind, pp, chunks), int(data["microbatches"]), costs, ranks, meta,
                            stage_costs, budget)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:  # any malformed field
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"not a schedule export (format: docs/architecture.md): {type(exc).__name__}: {exc}") from None
    return verify(schedule, forward_only)


def load_json(path: str) -> Schedule:
    """The verified schedule of an export file; ConfigError naming the file and every problem."""
    with open(path) as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a schedule export (format: docs/architecture.md): a JSON {type(data).__name__}")
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise type(exc)(f"{path}: {exc}") from None


# The simulated figures an export records, recomputed by `check` (a hand edit leaves them stale).
FIGURES = ("makespan", "bubble_rate", "span_bubble_rate", "peak_activations", "peak_vs_1f1b")


def stale_figures(data: dict, sim: SimResult) -> List[str]:
    """The recorded figures of an export that its op lists no longer give, as readable lines."""
    fresh = sim.to_dict()
    out = []
    for key in FIGURES:
        if key in data and key in fresh and not _close(data[key], fresh[key]):
            out.append(f"{key} recorded {data[key]}, the op lists give {fresh[key]}")
    return out


def _close(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    try:
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    except (TypeError, ValueError):
        return False


def to_torch_rows(schedule: Schedule) -> List[List[str]]:
    return [[f"{op.stage}{TORCH_LETTER[op.kind]}{op.microbatch}" for op in ops] for ops in schedule.ranks]


def to_torch_csv(schedule: Schedule) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(to_torch_rows(schedule))
    return buf.getvalue()


def parse_torch_csv(text: str) -> List[List[Op]]:
    """Per-rank ops of a compute-only torch CSV (the inverse of to_torch_csv)."""
    ranks: List[List[Op]] = []
    for row in csv.reader(io.StringIO(text)):
        ops = []
        for cell in row:
            cell = cell.strip()
            if not cell:
                continue
            m = _TORCH_ACTION.match(cell)
            if not m:
                raise ConfigError(f"torch CSV action {cell!r} is not a compute action like 3F0, 3I0, 3W0 or 3B0")
            ops.append(Op(FROM_TORCH_LETTER[m.group(2)], int(m.group(3)), int(m.group(1))))
        ranks.append(ops)
    return ranks


def render(schedule: Schedule, fmt: str, sim: Optional[SimResult] = None) -> str:
    if fmt == "json":
        return to_json(schedule, sim)
    if fmt == "torch-csv":
        return to_torch_csv(schedule)
    raise ConfigError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")


def write(schedule: Schedule, path: str, fmt: str = "json", sim: Optional[SimResult] = None) -> None:
    text = render(schedule, fmt, sim)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        f.write(text)
