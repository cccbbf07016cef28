"""The executor on the tiny megatron-core GPT (megatron_vshape.testing.tiny_gpt) against the same
model without pipelining, from the same weights and data.

* Every registered schedule x pp {2, 4} x microbatches {1 (where the generator allows it), 2pp+1}:
  one step, an optimizer update, then forward_only evaluation; at pp=3 every schedule on uneven
  stages.  What the model adds to the executor (chunks with embedding and loss, tied weights,
  an optimizer, evaluation, the loss dicts returned) depends neither on pp=3 nor on more
  microbatch counts: test_executor_linear runs every schedule at pp {2, 3, 4} x {1, pp, 2pp+1,
  4pp} on megatron-core's linear layers, where the schedule's shape is what varies.
* TP=2 x PP=2, tied embeddings (V) and untied: three steps of torch.optim.SGD with momentum, then
  evaluation, against the same model at TP=2 without pipelining (so pipelining is the only
  difference), and loosely against the one-rank model without TP.
* Grad sync of the V's tied word embedding (owned by chunk 0, borrowed by chunk 1's output layer):
  DDP-like hooks and grad_sync_func see its gradient complete.

Losses and gradients must be bitwise equal where the order of additions is the same: every
parameter gets one contribution per microbatch, in microbatch order, on both sides.  The one
exception is a tied embedding with more than one microbatch: the reference sums a microbatch's
embedding and output-layer gradients before adding them to .grad, the pipeline adds them in
separate ops (chunk 0's B, chunk 1's W), so there only 1e-6 relative (to the step's largest
reference gradient, as `compare` measures) is required.  One launch per test runs every case
and its references (spawning dominates the cost on small CI machines).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from megatron_vshape.integration.launch import launch
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.ops import Placement
from megatron_vshape.testing.tiny_gpt import TinyGPT, compare
from test_executor_linear import build, schedule_cases

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
    keys = list(dict.fromkeys(_ref_key(c[0], c[2]) for c in cases))
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


def _ref_key(tiny, m):
    """The reference of a case: the unpipelined model does not depend on the layout."""
    return dataclasses.replace(tiny, pipeline_layout=None), m


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
        ref, mine = refs[_ref_key(tiny, m)], [job["results"][case] for job in jobs]
        label = (name, f"pp={pp}", f"tp={tp}", f"m={m}", "tied" if tiny.tied_embeddings else "untied",
                 f"layout={tiny.pipeline_layout}")
        bitwise, tol = True, 0.0 if _same_order_of_additions(tiny, m) else TOL
        for step in range(steps):
            diff = compare(_step(ref, step), [_step(r, step) for r in mine])
            loss_rel = diff["max_abs_loss_diff"] / max(abs(x) for x in ref["losses"][step])
            assert loss_rel <= tol and diff["max_rel_grad_diff"] <= tol, (label, step, diff)
            worst["loss"], worst["grad"] = max(worst["loss"], loss_rel), max(worst["grad"], diff["max_rel_grad_diff"])
            bitwise &= diff["max_abs_loss_diff"] == 0.0 and diff["max_abs_grad_diff"] == 0.0
            if sanity:
                loose = compare(_step(no_tp[_ref_key(tiny, m)], step), [_step(r, step) for r in mine])
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


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_the_unpipelined_gpt(pp):
    # 2pp layers: pp stages of two layers (single placement), 2pp stages of one (loop, V).
    untied = TinyGPT(num_layers=2 * pp, seq_length=8)
    # Tied embeddings on the V, where both ends live on rank 0; m=1 adds in the reference's order.
    tied = TinyGPT(num_layers=2 * pp, seq_length=8, tied_embeddings=True)
    counts = [1, 2 * pp + 1]
    cases = _cases(untied, pp, counts=counts) + _cases(tied, pp, names=["v-zb", "v-half", "v-min"], counts=counts)
    _run(tp=1, pp=pp, steps=1, cases=cases)


# Uneven stages, one layout per stage count (model order); sums differ from any even split.
UNEVEN = {2: (3, 2), 3: (1, 3, 2), 4: (2, 1, 3, 1), 6: (0, 2, 1, 3, 2, 1)}


@pytest.mark.parametrize("pp", [2, 3])
def test_every_schedule_with_uneven_stages(pp):
    """Every schedule on a layout that is neither even nor divisible (at pp=3 the V's and
    interleaving's stage 0 holds the embedding alone), untied and tied, against the unpipelined model: the same exactness as even."""
    cases = []
    for tied in (False, True):
        names = registry.names() if not tied else ["v-zb", "v-half", "v-min"]
        for name, m, options in schedule_cases(pp, names, counts=[2 * pp + 1]):
            layout = UNEVEN[registry.build(name, pp, m, **dict(options)).placement.num_stages]
            tiny = TinyGPT(num_layers=sum(layout), seq_length=8, tied_embeddings=tied, pipeline_layout=layout)
            cases.append((tiny, name, m, options))
    _run(tp=1, pp=pp, steps=2, cases=cases)


def test_tp2_pp2_several_optimizer_steps():
    # Tied embeddings where both ends live on rank 0 (V); across ranks (single, loop) the tied
    # weight's all-reduce is megatron-core's embedding group, which needs CUDA.
    tied, untied = TinyGPT(num_layers=4, seq_length=8, tied_embeddings=True), TinyGPT(num_layers=4, seq_length=8)
    cases = (_cases(tied, 2, names=["v-zb", "v-half", "v-min"], counts=[2, 5])
             + _cases(untied, 2, names=["1f1b", "1f1b-interleaved", "zb-h1", "zb-h2", "v-zb"], counts=[2, 5]))
    _run(tp=2, pp=2, steps=3, cases=cases, sanity=True)


@pytest.mark.timeout(400)
def test_tp2_pp4_every_schedule():
    # Eight ranks: one microbatch count (2pp) per schedule, the V's tied, the rest untied (as above).
    tied, untied = TinyGPT(num_layers=8, seq_length=8, tied_embeddings=True), TinyGPT(num_layers=8, seq_length=8)
    v = [n for n in registry.names() if registry.build(n, 4, 8).placement.kind == "v"]
    cases = (_cases(tied, 4, names=v, counts=[8])
             + _cases(untied, 4, names=[n for n in registry.names() if n not in v], counts=[8]))
    _run(tp=2, pp=4, steps=1, cases=cases)


# ---- grad sync of a tied weight borrowed by another chunk ----------------------------------------

def _sync_job(rank, world_size, cases, steps):
    """DDP-like hooks, then grad_sync_func, on the tied V; returns the problems found, by case."""
    from megatron_vshape.runtime.chunks import global_named_parameters
    from megatron_vshape.runtime.executor import get_forward_backward_func
    from megatron_vshape.testing.tiny_gpt import build_chunks, data_iterators, forward_step, init_parallel

    from ddp_like import DDPLike

    pp, problems, initialised = world_size, {}, False
    names = lambda chunk: dict(global_named_parameters(chunk))  # noqa: E731 - the chunk's own parameters
    for case in cases:
        tiny, name, m, options = case
        sched = build(name, pp, m, options)
        placement = sched.placement
        if not initialised:  # every case is a V
            init_parallel(1, pp, placement, seed=tiny.seed)
            initialised = True
        found = problems.setdefault(case, [])
        for with_grad_sync in (False, True):
            chunks = build_chunks(tiny, placement)
            cfg = chunks[0].config
            lent = {id(p) for chunk in chunks for p in getattr(chunk, "borrowed_parameters", ())}
            borrowed = {k for chunk in chunks for k, p in names(chunk).items() if id(p) in lent}
            if rank == 0 and not borrowed and not with_grad_sync:
                found.append("chunk 1 lists no borrowed_parameters: the tied weight would not be covered")
            hooks = DDPLike(chunks, cfg, fusion=True, names=names)
            synced = []  # (chunk, {name: main_grad when grad_sync_func was called})
            if with_grad_sync:
                cfg.grad_sync_func = [
                    functools.partial(lambda c, params: synced.append(
                        (c, {k: p.main_grad.clone() for k, p in names(chunks[c]).items()})), c)
                    for c in range(len(chunks))]
            fb = get_forward_backward_func(sched, p2p_timeout=120)
            counts = []
            for step in range(steps):
                for chunk in chunks:
                    for p in chunk.parameters():
                        p.main_grad.zero_()
                hooks.fired.clear()
                synced.clear()
                fb(forward_step_func=forward_step, model=chunks, num_microbatches=m, seq_length=tiny.seq_length,
                   micro_batch_size=tiny.micro_batch_size, data_iterator=data_iterators(tiny, step, m, len(chunks)))
                final = {k: p.main_grad for chunk in chunks for k, p in names(chunk).items()}
                label = f"{'grad_sync_func' if with_grad_sync else 'no_sync'} step {step}"
                if hooks.none_grad:
                    found.append(f"{label}: hooks fired without a gradient: {hooks.none_grad}")
                last = {}
                for k, grad in hooks.fired:
                    last[k] = grad
                counts.append(sorted((k, sum(f[0] == k for f in hooks.fired)) for k in last))
                if not with_grad_sync:
                    # Once each, on the final contribution, except a tied weight: also on its other
                    # use's last op (embedding B, output-layer W), as megatron-core's golden counts allow.
                    found += [f"{label}: {k} registered {n} times while sync was on"
                              for k, n in counts[-1] if n > (2 if k in borrowed else 1)]
                    if last.keys() != final.keys():
                        found.append(f"{label}: never registered while sync was on: {sorted(final.keys() - last.keys())}")
                    found += [f"{label}: last registration of {k} before its gradient was complete"
                              for k, grad in last.items() if not torch.equal(grad, final[k])]
                else:
                    if sorted(c for c, _ in synced) != list(range(len(chunks))):
                        found.append(f"{label}: grad_sync_func called for chunks {[c for c, _ in synced]}")
                    found += [f"{label}: grad_sync_func of chunk {c} called before {k}'s gradient was complete"
                              for c, grads in synced for k, g in grads.items() if not torch.equal(g, final[k])]
            if len({repr(c) for c in counts}) != 1:
                found.append(f"{'grad_sync_func' if with_grad_sync else 'no_sync'}: registrations differ between "
                             f"steps (megatron-core's golden counts need them equal): {counts}")
    return problems


@pytest.mark.parametrize("pp,counts", [(2, [2]), (4, [4])])
def test_tied_weight_grad_sync_waits_for_the_borrowing_chunk(pp, counts):
    """The V's tied word embedding belongs to chunk 0 but gets its last contribution in chunk 1's
    last W (output layer), which can come after chunk 0's last B (the V schedules at m = pp) and
    even its last W (W deferred to the end in reversed order): chunk 0's no_sync must be lifted
    then too, and grad_sync_func[0] called only after it.  DDP-like hooks (megatron-core's
    mechanics): every parameter registers while sync is on, its last registration sees the
    complete gradient, no hook fires without a gradient, and two steps register the same way."""
    tied = TinyGPT(num_layers=2 * pp, seq_length=8, tied_embeddings=True)
    names = (["v-zb", "v-half", "v-min"] if pp == 2 else ["v-zb"]) + ["local/v/split/reversed"]
    cases = _cases(tied, pp, names=names, counts=counts)
    jobs = launch(_sync_job, pp, (cases, 2), timeout=300)
    problems = [f"rank {r} {c[1]} m={c[2]}: {p}" for r, job in enumerate(jobs) for c, ps_ in job.items() for p in ps_]
    assert not problems, "\n".join(problems)
    print(f"pp={pp}: {len(cases)} tied V cases x (no_sync, grad_sync_func) x 2 steps, hooks and grad sync complete")
