"""Re-planning from profiles: measured op times become stage costs, and the planner re-plans.

The runtime never decides an order: it measures (runtime.stats.Recorder), every rank agrees on
one table of per-stage means (one collective), and the schedule is rebuilt by name from that
table by the planner (schedule.registry), identically on every rank.  Only the order changes:
each stage still runs its microbatches' F, B and W in index order (every generator does; the
planner and the solver relabel their orders so, which never costs time:
schedule/microbatch_order.py), so each parameter receives its gradient contributions in the
same order and the numbers come out bit for bit the same.

The table: per stage, the mean F, B and W time of one microbatch (seconds), and the stage's
activation size relative to a plain layer stage (mean bytes saved by one F over the median
stage's).  A stage run with a combined backward (BW) gives half of it to B and half to W.
This module needs torch only inside `agree` (the `profile` command reads files without it).
"""
from __future__ import annotations

import json
import statistics
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..schedule import registry
from ..schedule.errors import ConfigError
from ..schedule.ops import Costs, Schedule, StageCost
from ..schedule.stage_costs import read_json

OpTime = Tuple[str, int, int, float, float]  # (kind, microbatch, stage, start, end), as Recorder.ops
KINDS = ("F", "B", "W", "BW")
# Per stage: sum and count of each kind's durations, then sum and count of bytes saved by F.
COLUMNS = 2 * len(KINDS) + 2


def tally(ops: Iterable[OpTime], num_stages: int, saved: Optional[Dict[int, List[int]]] = None) -> List[List[float]]:
    """Per stage: [sum, count] of each op kind's durations, then [sum, count] of F's saved bytes:
    what one rank measured, in a form that adds up across ranks."""
    rows = [[0.0] * COLUMNS for _ in range(num_stages)]
    for kind, _, stage, start, end in ops:
        if not 0 <= stage < num_stages:
            raise ConfigError(f"recorded op on stage {stage}, but the schedule has stages 0..{num_stages - 1}")
        i = 2 * KINDS.index(kind)
        rows[stage][i] += end - start
        rows[stage][i + 1] += 1
    for stage, values in (saved or {}).items():
        rows[stage][-2] += float(sum(values))
        rows[stage][-1] += len(values)
    return rows


def stage_costs(rows: Sequence[Sequence[float]]) -> Tuple[StageCost, ...]:
    """Mean F, B, W per stage and activation size relative to the median stage, from summed tallies."""
    missing = [s for s, row in enumerate(rows) if not row[1]]
    if missing:
        raise ConfigError(f"no forward recorded for stage(s) {', '.join(map(str, missing))}; profile every pipeline "
                          "rank (one stats file per rank) over at least one training step")
    mean = lambda row, kind: row[2 * KINDS.index(kind)] / row[2 * KINDS.index(kind) + 1]  # noqa: E731
    per_f = [row[-2] / row[-1] if row[-1] else 0.0 for row in rows]
    plain = statistics.median(per_f)
    out = []
    for s, row in enumerate(rows):
        if row[3] and row[5]:
            b, w = mean(row, "B"), mean(row, "W")
        elif row[7]:
            b = w = mean(row, "BW") / 2
        else:
            raise ConfigError(f"no backward recorded for stage {s}; profile a training step, not evaluation")
        out.append(StageCost(mean(row, "F"), b, w, per_f[s] / plain if plain > 0 else 1.0))
    return tuple(out)


def from_recorders(recorders: Iterable[dict], num_stages: Optional[int] = None) -> Tuple[StageCost, ...]:
    """Stage costs from recorders' `to_dict()` (one per rank, all ranks together)."""
    recorders = list(recorders)
    if num_stages is None:
        num_stages = 1 + max((op[2] for r in recorders for op in r["ops"]), default=-1)
    highest = max((int(s) for r in recorders for s in (r.get("saved_by_stage") or {})), default=-1)
    if num_stages < 1 or highest >= num_stages:
        raise ConfigError(f"{num_stages} stage(s), but bytes were saved on stage {highest}: give the schedule's "
                          "stage count (2 x pp on the V), or let it default to the highest recorded stage + 1")
    total = [[0.0] * COLUMNS for _ in range(num_stages)]
    for r in recorders:
        saved = {int(s): v for s, v in (r.get("saved_by_stage") or {}).items()}
        for row, add in zip(total, tally(r["ops"], num_stages, saved)):
            for i, v in enumerate(add):
                row[i] += v
    return stage_costs(total)


def load_stats(paths: Sequence[str]) -> List[dict]:
    """Recorder dumps (Recorder.dump): each file one rank's dict, a list of them, or {"ranks": [...]}."""
    out: List[dict] = []
    for path in paths:
        data = read_json(path, path, "; give files written by Recorder.dump")
        items = data.get("ranks") if isinstance(data, dict) and "ranks" in data else data
        items = items if isinstance(items, list) else [items]
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("ops"), list):
                raise ConfigError(f"{path}: expected a Recorder dump with an 'ops' list of [kind, microbatch, stage, "
                                  "start, end] (Recorder.dump writes one)")
            bad = next((op for op in item["ops"] if not _is_op(op)), None)
            if bad is not None:
                raise ConfigError(f"{path}: op {json.dumps(bad)} is not [kind in {'/'.join(KINDS)}, microbatch, stage, "
                                  "start, end] (Recorder.dump writes those)")
            saved = item.get("saved_by_stage") or {}
            if not isinstance(saved, dict) or not all(str(k).isdigit() and isinstance(v, list) for k, v in saved.items()):
                raise ConfigError(f"{path}: 'saved_by_stage' must map stage numbers to lists of bytes")
            out.append(item)
    if not any(item["ops"] for item in out):
        raise ConfigError("no op recorded in " + ", ".join(paths) + "; dump the recorder after a training step")
    return out


def _is_op(op) -> bool:
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    return (isinstance(op, list) and len(op) == 5 and op[0] in KINDS and all(isinstance(v, int) and v >= 0
            for v in op[1:3]) and number(op[3]) and number(op[4]))


def agree(rows: List[List[float]], group=None, device=None) -> List[List[float]]:
    """Every rank's tally summed over `group` (default: the world) with ONE collective.

    all_gather, then the same sum in rank order on every rank: the result is bit-identical
    everywhere (a reduction's order could differ between ranks), so every rank re-plans the
    same schedule.
    """
    import torch
    import torch.distributed as dist

    mine = torch.tensor(rows, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    total = gathered[0].clone()
    for t in gathered[1:]:
        total += t
    return total.cpu().tolist()


def measured(stats, num_stages: int, group=None, device=None) -> Tuple[StageCost, ...]:
    """Per-stage costs of the step `stats` (a Recorder) recorded, agreed over `group` (one
    all_gather, the same table on every rank): seconds, and sizes relative to the median stage."""
    rows = tally(stats.ops, num_stages, stats.saved_by_stage)
    return stage_costs(agree(rows, group, device if device is not None and device.type != "cpu" else None))


def replan_executor(ex, group=None, hop_latency: float = 0.0) -> Schedule:
    """The executor's `replan()`: its recorder's per-stage tallies agreed over `group` (one
    all_gather), the schedule rebuilt by name under those stage costs (C = `hop_latency`
    seconds), its plan cache cleared; meta["order_changed"] says whether the order differs.  Deterministic: the same tallies give the same schedule
    on every rank.  Errors are raised after the collective, alike on every rank."""
    if ex.stats is None:
        raise ConfigError("replan() needs measured op times: pass stats=Recorder() to get_forward_backward_func")
    if ex._last_step is None:
        raise ConfigError("replan() before any training step: run at least one step first")
    pp, m, rank, device = ex._last_step
    name = ex.schedule if isinstance(ex.schedule, str) else ex.schedule.name
    registry.generator(name)  # re-planning rebuilds by name: a registered schedule only
    current = ex._plan(pp, m, False, rank)[0]
    table = measured(ex.stats, current.num_stages, group, device)
    k = current.placement.chunks  # Costs are per rank's share: a stage of k chunks holds 1/k of it
    mean = lambda kind: sum(getattr(c, kind) for c in table) / len(table) * k  # noqa: E731
    costs = Costs(mean("F"), mean("B"), mean("W"), hop_latency)
    # A schedule made under a memory budget (v-auto) is re-planned under the same budget.
    options = dict(ex.schedule_options)
    budget = getattr(ex.schedule, "memory_budget", None)
    if budget is not None and registry.plans_under_budget(name):
        options.setdefault("memory_budget", budget)
    # Built before anything changes: a ConfigError (e.g. the measured activation sizes no longer fit the
    # budget) leaves the executor running the schedule it had.
    registry.build(name, pp, m, costs, stage_costs=table, **options)
    ex.costs, ex.schedule_options, ex.stage_costs, ex.schedule = costs, options, table, name
    ex.forget_plans()
    new = ex._plan(pp, m, False, rank)[0]
    new.meta["order_changed"] = new.ranks != current.ranks
    return new
