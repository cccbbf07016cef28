"""Re-planning inside the runtime (runtime/replan.py, `_Executor.replan()`) on the tiny GPT over
gloo ranks: a deterministic CPU run that re-plans after N steps gives the same losses and
parameters, bit for bit, as the run that never re-plans, while its order really changes; every
rank gets the same schedule; `megatron-vshape profile` turns the ranks' dumps into a stage-costs
file the planner reads.

The first re-plan injects a recorded profile (each rank replaces its recorder's op times with
synthetic ones for its own stages, unequal across stages), so the costs, and with them the
order, must change.  These costs are ones for which the planner's local moves leave stage 0's
F's, B's and W's out of microbatch order before it relabels them: unrelabelled, the embedding's
gradient would add up in another order and the losses differ in the last bits.  The second
re-plans from the times really measured, which may or may not change the order, and still has
to agree on every rank.
The pretraining driver's --pipeline-replan-after N runs the same call at iteration N.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_vshape.integration.launch import launch
from megatron_vshape.schedule import microbatch_order
from megatron_vshape.schedule import stage_costs as stage_costs_file
from megatron_vshape.schedule.ops import Op
from megatron_vshape.testing.tiny_gpt import TinyGPT

NAME, PP, M, STEPS, REPLAN_AT, REMEASURE_AT = "v-half", 2, 4, 4, 1, 2
OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
# Synthetic per-op seconds (F, B, W) per stage for the injected profile: costs under which the
# planner's moves put stage 0 out of microbatch order before relabelling (module docstring).
INJECTED = [(0.003, 0.004, 0.0005), (0.001, 0.003, 0.002), (0.004, 0.001, 0.001), (0.002, 0.004, 0.002)]


def _injected_ops(stages, m):
    ops, t = [], 0.0
    for mb in range(m):
        for stage in stages:
            for kind, d in zip(("F", "B", "W"), INJECTED[stage]):
                ops.append((kind, mb, stage, t, t + d))
                t += d
    return ops


def _train(tiny, replan, dump_dir):
    from megatron.core import parallel_state as ps

    from megatron_vshape.runtime.executor import get_forward_backward_func
    from megatron_vshape.runtime.stats import Recorder
    from megatron_vshape.schedule import registry
    from megatron_vshape.testing.tiny_gpt import (build_chunks, data_iterators, forward_step, microbatch_loss,
                                                  unique_parameters)

    placement = registry.build(NAME, PP, M).placement
    chunks = build_chunks(tiny, placement)
    optimizer = OPTIMIZER(unique_parameters(chunks))
    recorder = Recorder()
    fb = get_forward_backward_func(NAME, stats=recorder, p2p_timeout=120)
    rank = ps.get_pipeline_model_parallel_rank()
    orders, losses = [registry.build(NAME, PP, M).ranks], []
    for step in range(STEPS):
        if replan and step == REPLAN_AT:
            recorder.clear()
            recorder.ops.extend(_injected_ops(placement.stages_of(rank), M))
            orders.append(fb.replan().ranks)
            recorder.clear()  # the next re-plan sees one real step of the new schedule
        if replan and step == REMEASURE_AT:
            recorder.dump(f"{dump_dir}/stats{rank}.json")
            orders.append(fb.replan().ranks)
        optimizer.zero_grad(set_to_none=True)
        out = fb(forward_step_func=forward_step, data_iterator=data_iterators(tiny, step, M, len(chunks)), model=chunks,
                 num_microbatches=M, seq_length=tiny.seq_length, micro_batch_size=tiny.micro_batch_size)
        losses.append([microbatch_loss(d) for d in out])
        optimizer.step()
    params = [p.detach().numpy().copy() for p in unique_parameters(chunks)]
    return {"losses": losses, "params": params, "orders": [[[str(op) for op in ops] for ops in o] for o in orders],
            "costs": [c.to_dict() for c in (fb.stage_costs or ())]}


def _job(rank, world_size, tiny, dump_dir):
    """One launch for both tests (spawning dominates the cost): the executor, then the driver."""
    from megatron_vshape.schedule import registry
    from megatron_vshape.testing.tiny_gpt import init_parallel

    init_parallel(1, PP, registry.build(NAME, PP, M).placement, seed=tiny.seed)
    plain = _train(tiny, False, dump_dir)
    replanned = _train(tiny, True, dump_dir)
    return {"plain": plain, "replanned": replanned, "driver": _driver_runs(world_size)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replan")
    return tmp, launch(_job, PP, (TinyGPT(num_layers=4), str(tmp)), timeout=540)


@pytest.mark.timeout(600)
def test_replan_changes_the_order_not_the_numbers(runs):
    tmp_path, jobs = runs
    last = jobs[PP - 1]  # the last pipeline rank returns the losses
    plain, replanned = last["plain"], last["replanned"]
    assert len(plain["losses"]) == STEPS and all(len(x) == M for x in plain["losses"])
    assert replanned["losses"] == plain["losses"]  # bit for bit: floats compared exactly
    for job in jobs:
        for a, b in zip(job["plain"]["params"], job["replanned"]["params"], strict=True):
            assert np.array_equal(a, b)
    # Every rank re-planned the same schedules from the same agreed costs.
    for job in jobs[1:]:
        assert job["replanned"]["orders"] == jobs[0]["replanned"]["orders"]
        assert job["replanned"]["costs"] == jobs[0]["replanned"]["costs"]
    before, injected, measured = jobs[0]["replanned"]["orders"]
    assert injected != before, "the injected profile must change v-half's order"
    for order in (before, injected, measured):  # what makes the numbers equal bit for bit
        assert microbatch_order.problems([[Op.parse(op) for op in ops] for ops in order]) == []
    assert all(len(ops) == len(b) for ops, b in zip(measured, before))

    # The ranks' dumps -> a stage-costs file the planner reads.
    out = tmp_path / "stage_costs.json"
    files = [str(tmp_path / f"stats{r}.json") for r in range(PP)]
    cli = subprocess.run([sys.executable, "-m", "megatron_vshape.cli", "profile", *files, "--output", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    table = stage_costs_file.load(str(out))
    assert len(table) == 2 * PP and all(c.F > 0 and c.B > 0 and c.W > 0 for c in table)
    assert json.loads(out.read_text())["unit"] == "seconds"
    # The last stage (output layer and loss) saves more for backward than a plain layer stage.
    assert table[-1].size > 1.0


# The pretraining driver with --pipeline-replan-after N, against the same run without it.
# Untied embeddings: on the V a tied embedding's two uses (chunk 0's B, chunk 1's W) interleave
# differently across microbatches in another order, so its gradient would add in another order.
# --pipeline-costs plans the first schedule for costs far from what the CPU measures (B ten
# times F, W a tenth), so the re-plan from the measured times has a different order to choose.
DRIVER_FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-2",
                "--lr-warmup-iters", "1", "--mock-data", "--vocab-size", "63", "--make-vocab-size-divisible-by", "1",
                "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
                "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size", "2",
                "--pipeline-schedule", "v-half", "--pipeline-costs", "1,10,0.1,0"]
DRIVER_REPLAN_AT = 2


def _driver_runs(world_size):
    from megatron_vshape.argtypes import quiet_megatron_notices
    from megatron_vshape.integration import train

    quiet_megatron_notices()
    out = {}
    for label, extra in (("plain", []), ("replanned", ["--pipeline-replan-after", str(DRIVER_REPLAN_AT)])):
        args = train.parse_args(DRIVER_FLAGS + extra)
        out[label] = train.run(args, train.validate(args, world_size=world_size))
    return out


@pytest.mark.timeout(600)
def test_driver_replan_after_n_keeps_the_loss_curve_bit_for_bit(runs):
    results = [job["driver"] for job in runs[1]]
    for r in results:
        plain, replanned = r["plain"], r["replanned"]
        assert plain["replanned"] is None
        info = replanned["replanned"]
        assert info["iteration"] == DRIVER_REPLAN_AT and info["schedule"] == "v-half"
        assert len(info["stage_costs"]) == 2 * PP
        assert replanned["losses"] == plain["losses"] and len(plain["losses"]) == 4  # exact floats
        assert replanned["grad_norms"] == plain["grad_norms"]
        assert info == results[0]["replanned"]["replanned"]  # every rank agreed on the same costs
    assert results[0]["replanned"]["replanned"]["order_changed"], \
        "planned for B = 10 F, re-planned for what the CPU measures: v-half's order must change"


def test_profile_refuses_files_that_are_not_recorder_dumps(tmp_path):
    def dump(name, data):
        (tmp_path / name).write_text(data if isinstance(data, str) else json.dumps(data))
        return tmp_path / name

    ops = [["F", 0, 0, 0.0, 1.0], ["B", 0, 0, 1.0, 2.0], ["W", 0, 0, 2.0, 3.0]]
    cases = [(dump("bad.json", "{not json"), "not JSON"),
             (dump("partial.json", {"ops": ops}), "no forward recorded for stage(s) 1"),
             (dump("empty.json", {"ops": []}), "no op recorded in"),  # dumped before any step
             (dump("six.json", {"ops": [ops[0] + [4.0]]}), "is not [kind in F/B/W/BW, microbatch, stage, start, end]"),
             (dump("kind.json", {"ops": [["X", 0, 0, 0.0, 1.0]]}), "is not [kind in"),
             (dump("saved.json", {"ops": ops, "saved_by_stage": {"5": [1]}}), "but bytes were saved on stage 5")]
    for path, word in cases:
        cli = subprocess.run([sys.executable, "-m", "megatron_vshape.cli", "profile", str(path), "--output",
                              str(tmp_path / "out.json"), "--stages", "2"], capture_output=True, text=True, timeout=120)
        assert cli.returncode == 2 and word in cli.stderr and len(cli.stderr.strip().splitlines()) == 1, cli.stderr


def _replan_over_the_budget(rank, world_size):
    """v-auto under memory budget 0.5 at pp=4, m=8 (a cap of 4 stage-activations a rank), re-planned from a
    profile whose stage 0 saves five times a plain stage's bytes: one microbatch no longer fits rank 0."""
    from megatron_vshape.integration import train
    from megatron_vshape.runtime.executor import get_forward_backward_func
    from megatron_vshape.runtime.stats import Recorder

    recorder = Recorder()
    ex = get_forward_backward_func("v-auto", stats=recorder, schedule_options={"memory_budget": 0.5})
    ex._last_step = (4, 8, 0, torch.device("cpu"))  # as a step of pp=4, 8 microbatches leaves it
    before = ex._plan(4, 8, False, 0)[0]
    for mb in range(8):
        for stage in range(8):
            recorder.ops.extend([("F", mb, stage, 0.0, 1.0), ("B", mb, stage, 1.0, 2.0), ("W", mb, stage, 2.0, 3.0)])
            recorder.saved_by_stage.setdefault(stage, []).append(5000 if stage == 0 else 1000)
    try:
        ex.replan()
        raised = None
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        raised = f"{type(e).__name__}: {e}"
    kept = (ex.schedule, ex.stage_costs, ex.schedule_options, ex._plan(4, 8, False, 0)[0].ranks == before.ranks)
    return {"raised": raised, "kept": kept, "driver": train._replan(ex, 3)}


@pytest.mark.timeout(300)
def test_a_replan_that_cannot_fit_the_budget_keeps_the_schedule():
    """The re-plan's ConfigError comes before the executor changes anything (it runs the schedule it had),
    and the driver's --pipeline-replan-after says so and trains on instead of stopping at iteration N."""
    (got,) = launch(_replan_over_the_budget, 1, timeout=240)
    assert got["raised"].startswith("ConfigError: v-auto: microbatches=8 is too few for pp=4 at memory budget 0.5")
    assert got["kept"] == ("v-auto", None, {"memory_budget": 0.5}, True)
    record = got["driver"]
    assert record["schedule"] == "v-auto" and not record["order_changed"] and "too few" in record["kept"]
