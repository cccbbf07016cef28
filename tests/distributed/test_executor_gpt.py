"""The executor on the tiny megatron-core GPT (megatron_vshape.testing.tiny_gpt) against the same
model without pipelining, from the same weights and data.

* Every registered schedule x pp {2, 3, 4} x microbatches {pp, 2pp+1, 4pp} (and 1 where the
  generator allows it): one step, an optimizer update, then forward_only evaluation.
* TP=2 x PP=2, tied embeddings (V) and untied: three steps of torch.optim.SGD with momentum, then
  evaluation, against the same model at TP=2 without pipelining (so pipelining is the only
  difference), and loosely against the one-rank model without TP.

Losses and gradients must be bitwise equal where the order of additions is the same: every
parameter gets one contribution per microbatch, in microbatch order, on both sides.  The one
exception is a tied embedding with more than one microbatch: the reference sums a microbatch's
embedding and output-layer gradients before adding them to .grad, the pipeline adds them in
separate ops (chunk 0's B, chunk 1's W), so there only 1e-6 relative (to the step's largest
reference gradient, as `compare` measures) is required.  One launch per test runs every case
and its references (spawning dominates the cost on small CI machines).
"""
from __future__ import annotations

import functools

import pytest
import torch

from megatron_vshape.integration.launch import launch
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.ops import Placement
from megatron_vshape.testing.tiny_gpt import TinyGPT, compare
from test_executor_linear import schedule_cases

# Momentum SGD: a real torch.optim optimizer, elementwise, so it acts the same on TP shards.
OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
TOL = 1e-6
# TP=2 against one rank without TP: the sharded GEMMs and their all-reduce round differently.
NO_TP_SANITY = 1e-5
SINGLE = Placement("single", 1)


def _cases(tiny, pp, names=None, counts=None):
    """(tiny, name, microbatches, generator options) for the schedules and microbatch counts."""
    return [(tiny, name, m, options) for name, m, options in schedule_cases(pp, names, counts)]


def _placement(case, pp):
    tiny, name, m, options = case
    return registry.build(name, pp, m, **dict(options)).placement


def _job(rank, world_size, tp, cases, steps, sanity):
    """Every case pipelined at (tp, world_size // tp), then the references, split over the
    data-parallel replicas that a pp=1 layout of the same ranks has."""
    from megatron.core import parallel_state as ps

    from megatron_vshape.runtime.executor import get_forward_backward_func
    from megatron_vshape.testing.tiny_gpt import (build_chunks, data_iterators, forward_step, init_parallel,
                                                  microbatch_loss, named_grads, portable, reference_run,
                                                  unique_parameters)

    pp = world_size // tp
    results, layout = {}, None
    # Grouped by placement: parallel groups are re-created only when the placement changes.
    for case in sorted(cases, key=lambda c: _placement(c, pp).kind):
        tiny, name, m, options = case
        placement = _placement(case, pp)
        if (placement.kind, placement.chunks) != layout:
            init_parallel(tp, pp, placement, seed=tiny.seed)
            layout = (placement.kind, placement.chunks)
        chunks = build_chunks(tiny, placement, tp=tp)
        optimizer = OPTIMIZER(unique_parameters(chunks))
        fb = functools.partial(get_forward_backward_func(name, p2p_timeout=120, schedule_options=dict(options)),
                               forward_step_func=forward_step, model=chunks, num_microbatches=m,
                               seq_length=tiny.seq_length, micro_batch_size=tiny.micro_batch_size)
        last = ps.get_pipeline_model_parallel_rank() == pp - 1
        losses, grads, returned = [], [], []
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            res = fb(data_iterator=data_iterators(tiny, step, m, len(chunks)))
            returned.append(len(res))
            losses.append([microbatch_loss(d) for d in res])
            grads.append(named_grads(chunks))
            optimizer.step()
        # evaluation after training: forward ops only, on the data of step `steps`
        with torch.no_grad():
            res = fb(data_iterator=data_iterators(tiny, steps, m, len(chunks)), forward_only=True)
        results[case] = portable({"losses": losses if last else None, "grads": grads, "returned": returned,
                                  "eval": [microbatch_loss(d) for d in res] if last else None,
                                  "eval_returned": len(res)})

    # One more reference step than trained: its losses (before the update) are what evaluation sees.
    keys = list(dict.fromkeys((c[0], c[2]) for c in cases))
    init_parallel(tp, 1, SINGLE)
    refs = {}
    replica, replicas = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    for tiny, m in keys[replica::replicas]:
        ref = reference_run(tiny, m, steps=steps + 1, tp=tp, optimizer=OPTIMIZER, initialise=False)
        if ps.get_tensor_model_parallel_rank() == 0:
            refs[(tiny, m)] = ref
    no_tp = {}
    if sanity:
        init_parallel(1, 1, SINGLE)
        for tiny, m in keys[rank::world_size]:
            no_tp[(tiny, m)] = reference_run(tiny, m, steps=steps, optimizer=OPTIMIZER, initialise=False)
    return {"results": results, "refs": refs, "no_tp": no_tp}


def _step(run, step):
    return {"losses": None if run["losses"] is None else run["losses"][step:step + 1],
            "grads": run["grads"][step:step + 1]}


def _rel_loss(ref, got):
    return max(abs(a - b) for a, b in zip(ref, got, strict=True)) / max(abs(a) for a in ref)


def _same_order_of_additions(tiny, m):
    return not (tiny.tied_embeddings and m > 1)


def _run(tp, pp, cases, steps, sanity=False):
    jobs = launch(_job, tp * pp, (tp, cases, steps, sanity), timeout=420)
    refs, no_tp = {}, {}
    for job in jobs:
        refs.update(job["refs"])
        no_tp.update(job["no_tp"])
    exact, worst, worst_no_tp = 0, {"loss": 0.0, "grad": 0.0, "eval": 0.0}, 0.0
    for case in cases:
        tiny, name, m, _ = case
        ref, mine = refs[(tiny, m)], [job["results"][case] for job in jobs]
        label = (name, f"pp={pp}", f"tp={tp}", f"m={m}", "tied" if tiny.tied_embeddings else "untied")
        bitwise, tol = True, 0.0 if _same_order_of_additions(tiny, m) else TOL
        for step in range(steps):
            diff = compare(_step(ref, step), [_step(r, step) for r in mine])
            loss_rel = diff["max_abs_loss_diff"] / max(abs(x) for x in ref["losses"][step])
            assert loss_rel <= tol and diff["max_rel_grad_diff"] <= tol, (label, step, diff)
            worst["loss"], worst["grad"] = max(worst["loss"], loss_rel), max(worst["grad"], diff["max_rel_grad_diff"])
            bitwise &= diff["max_abs_loss_diff"] == 0.0 and diff["max_abs_grad_diff"] == 0.0
            if sanity:
                loose = compare(_step(no_tp[(tiny, m)], step), [_step(r, step) for r in mine])
                assert loose["max_rel_grad_diff"] <= NO_TP_SANITY, (label, step, "against no TP", loose)
                worst_no_tp = max(worst_no_tp, loose["max_rel_grad_diff"])
            if not bitwise:
                print(label, "step", step, diff)
        evals = [r["eval"] for r in mine if r["eval"] is not None]
        assert len(evals) == tp, f"{label}: {len(evals)} ranks returned evaluation losses, expected the last stage's {tp}"
        for got in evals:
            rel = _rel_loss(ref["losses"][steps], got)
            assert rel <= tol, (label, "eval", rel)
            worst["eval"] = max(worst["eval"], rel)
            bitwise &= rel == 0.0
        for got in mine:  # only the last pipeline rank returns loss dicts, one per microbatch
            want = 0 if got["losses"] is None else m
            assert got["returned"] == [want] * steps and got["eval_returned"] == want, label
        exact += bitwise
    print(f"tp={tp} pp={pp}: {len(cases)} cases x {steps} step(s), {exact} bitwise (losses, gradients, eval), "
          f"{sum(_same_order_of_additions(c[0], c[2]) for c in cases)} required to be; "
          f"worst relative: loss {worst['loss']:.2e}, grad {worst['grad']:.2e}, eval {worst['eval']:.2e}"
          + (f"; against one rank without TP: grad {worst_no_tp:.2e}" if sanity else ""))


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_every_schedule_and_microbatch_count(pp):
    # 2pp layers: pp stages of two layers (single placement), 2pp stages of one (loop, V).
    untied = TinyGPT(num_layers=2 * pp, seq_length=8)
    # Tied embeddings on the V, where both ends live on rank 0; m=1 adds in the reference's order.
    tied = TinyGPT(num_layers=2 * pp, seq_length=8, tied_embeddings=True)
    cases = _cases(untied, pp) + _cases(tied, pp, names=["v-zb", "v-half", "v-min"], counts=[1, 2 * pp + 1])
    _run(tp=1, pp=pp, steps=1, cases=cases)


def test_tp2_pp2_several_optimizer_steps():
    # Tied embeddings where both ends live on rank 0 (V); across ranks (single, loop) the tied
    # weight's all-reduce is megatron-core's embedding group, which needs CUDA.
    tied, untied = TinyGPT(num_layers=4, seq_length=8, tied_embeddings=True), TinyGPT(num_layers=4, seq_length=8)
    cases = (_cases(tied, 2, names=["v-zb", "v-half", "v-min"], counts=[2, 5])
             + _cases(untied, 2, names=["1f1b", "1f1b-interleaved", "zb-h1", "zb-h2", "v-zb"], counts=[2, 5]))
    _run(tp=2, pp=2, steps=3, cases=cases, sanity=True)
