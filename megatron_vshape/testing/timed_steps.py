"""Timed training steps of the tiny GPT on gloo ranks, and the figures the CPU benchmarks and the
quickstart print from them (scripts/bench/cpu_pipeline.py, scripts/bench/balanced_v.py,
scripts/quickstart.py).

In each rank, `run_steps` runs warm-up and measured steps of one schedule with the runtime's
recorder on, and keeps every measured step's wall time (the slowest rank's, ranks released
together by a barrier) with that step's op times.  `figures` reads one launch: all from its
median step (so a row's figures describe one step), the step time, the measured makespan and
bubble, the per-stage op costs measured in that step, and the simulator's makespan for the same op
lists fed with those costs (the planner's prediction from this run's own costs).  `median_over`
takes the median of each figure over launches.  Timings on a shared CPU are noisy: nothing here is
asserted by tests but the bookkeeping.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Dict, List, Sequence, Tuple

from ..runtime.replan import stage_costs, tally
from ..schedule import registry
from ..schedule.ops import Schedule, StageCost
from ..schedule.simulate import simulate

# Big enough that an op takes milliseconds: with smaller ops, Python and gloo latency per op
# dominate and the figures measure the CPU transport, not the schedule.
SIZES = {"hidden_size": 256, "seq_length": 256, "micro_batch_size": 2}


def cores() -> int:
    """CPU cores this process may run on (its affinity, where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def barrier_time() -> float:
    import torch.distributed as dist

    dist.barrier()
    return time.perf_counter()


def slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run_steps(tiny, name: str, pp: int, m: int, warmup: int, steps: int, schedule: Schedule = None,
              clock=None) -> dict:
    """In a joined rank: `name` by the registry (or `schedule` as built, e.g. planned for
    tiny.pipeline_layout) for warmup + steps steps.  {"times": [s per measured step], "ops": [per
    step: [(kind, microbatch, stage, start, end)] relative to the step's start], "peak": bytes}.
    `clock`: the recorder's op clock (default wall time; with time.thread_time only the ops'
    durations mean anything)."""
    from ..runtime.executor import get_forward_backward_func
    from ..runtime.stats import Recorder
    from .tiny_gpt import build_chunks, data_iterators, forward_step, init_parallel

    placement = (schedule or registry.build(name, pp, m)).placement
    init_parallel(1, pp, placement, seed=tiny.seed)
    chunks = build_chunks(tiny, placement)
    recorder = Recorder(clock) if clock else Recorder()
    step_fn = get_forward_backward_func(schedule or name, stats=recorder)
    # Each measured step keeps its own op times: a figure must not mix one step's makespan with
    # another step's (or a median's) step time.
    times, ops = [], []
    for step in range(warmup + steps):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        recorder.ops.clear()
        t0 = barrier_time()
        step_fn(forward_step_func=forward_step, data_iterator=data_iterators(tiny, step, m, len(chunks)),
                model=chunks, num_microbatches=m, seq_length=tiny.seq_length,
                micro_batch_size=tiny.micro_batch_size)
        elapsed = slowest(time.perf_counter() - t0)
        if step >= warmup:
            times.append(elapsed)
            ops.append([(k, mb, s, a - t0, b - t0) for k, mb, s, a, b in recorder.ops])
    return {"times": times, "ops": ops, "peak": recorder.peak_bytes}


def run_cases(rank: int, world_size: int, cases: Sequence[Tuple[str, object, object]], m: int, warmup: int,
              steps: int, op_clock: str = "wall") -> Dict[str, dict]:
    """launch()'s rank function: run_steps for every (label, tiny, schedule name or Schedule), in order;
    op_clock "cpu" times the ops in the compute thread's CPU time (time.thread_time)."""
    clock = time.thread_time if op_clock == "cpu" else None
    out = {}
    for label, tiny, schedule in cases:
        name, built = (schedule, None) if isinstance(schedule, str) else (schedule.name, schedule)
        out[label] = run_steps(tiny, name, world_size, m, warmup, steps, schedule=built, clock=clock)
    return out


def median_step(times: Sequence[float]) -> int:
    """Index of the median step (the lower one of an even count).  Step times are all-reduced,
    so every rank picks the same step."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    return order[(len(order) - 1) // 2]


def measured(per_rank_ops) -> Tuple[float, float]:
    """(makespan, bubble rate) of one step from every rank's (kind, mb, stage, start, end): first op
    start to last op end over all ranks, and 1 - the busiest rank's op time / that makespan."""
    start = min(o[3] for ops in per_rank_ops for o in ops)
    end = max(o[4] for ops in per_rank_ops for o in ops)
    busy = max(sum(o[4] - o[3] for o in ops) for ops in per_rank_ops)
    return end - start, 1 - busy / (end - start)


def measured_stage_costs(per_rank_ops, num_stages: int) -> Tuple[StageCost, ...]:
    """Mean F, B, W per stage over every rank's ops of one step (a BW split in halves), as re-planning
    from profiles computes them (runtime/replan.py)."""
    return stage_costs(tally([op for ops in per_rank_ops for op in ops], num_stages))


def figures(per_rank: Sequence[dict], schedule: Schedule) -> dict:
    """One launch's figures of one case (per_rank: run_steps' results, rank order), from its median step."""
    step = median_step(per_rank[0]["times"])
    ops = [r["ops"][step] for r in per_rank]
    makespan, bubble = measured(ops)
    costs = measured_stage_costs(ops, schedule.num_stages)
    sim = simulate(dataclasses.replace(schedule, stage_costs=costs, memory_budget=None))
    return {"step_s": per_rank[0]["times"][step], "makespan_s": makespan, "bubble": bubble,
            "sim_s": sim.makespan, "sim_bubble": sim.bubble_rate, "stage_costs": costs,
            "peak_bytes": [r["peak"] for r in per_rank]}


def median_over(launches: Sequence[dict]) -> dict:
    """The median over launches of each timed figure of `figures`; peak bytes (deterministic) from the first."""
    out = {k: statistics.median(f[k] for f in launches) for k in ("step_s", "makespan_s", "bubble", "sim_s", "sim_bubble")}
    out["peak_bytes"] = launches[0]["peak_bytes"]
    out["launches"] = len(launches)
    return out


def rotated(items: Sequence, k: int) -> List:
    """`items` starting at its k-th (mod len): launch k runs the cases in this order, so that no case
    always runs first (or last) in a launch."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])
