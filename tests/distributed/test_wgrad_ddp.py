"""The B/W split inside megatron-core's own DistributedDataParallel, on CPU (gloo).

megatron-core's DDP puts its gradient buffers on `torch.cuda.current_device()`; the TEST (never the
runtime) makes that name the CPU while DDP is built.  Everything else is megatron-core's: its gradient
hook (`grad_added_to_main_grad`, `zero_out_wgrad`, registration for the overlapped reduction), its
registration of hooks with deferring layers (`ddp_config.delay_wgrad_compute`), no_sync and
finish_grad_sync.  Gradients are compared with the same model without pipelining.

* Tied embeddings with gradient-accumulation fusion on the V (#35 item 2): rank 0 holds the embedding
  and the output layer, one weight; once the output layer's W marks it `grad_added_to_main_grad`,
  megatron-core's hook ignores the embedding's `.grad` unless the weight has `zero_out_wgrad`.
* Transformer Engine's deferred weight gradients (#35 item 1), against `te_double` (a TEST DOUBLE of
  TE's documented contract): W runs each layer's `backward_dw()` for its own microbatch, in B order,
  and DDP's hook fires exactly once per weight and microbatch, in that W.
"""
from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

from megatron_vshape.integration.launch import launch
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.ops import Placement
from megatron_vshape.testing.tiny_gpt import TinyGPT, compare

TOL = 1e-6


def _ddp_case(rank, world_size, tiny, name, m, te, fused):
    """One training step of `name` over megatron-core DDP-wrapped chunks; returns gradients, the hook
    log [(parameter name, op running)] and the TE double's FIFO log."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_vshape.runtime.chunks import build_model_chunks, global_named_parameters
    from megatron_vshape.runtime.executor import get_forward_backward_func
    from megatron_vshape.runtime.wgrad import defer_te_wgrad
    from megatron_vshape.testing.tiny_gpt import (data_iterators, forward_step, init_parallel, load_weights,
                                                  microbatch_loss, named_grads, portable)

    import te_double

    sched = registry.build(name, world_size, m)
    init_parallel(1, world_size, sched.placement, seed=tiny.seed)
    config = tiny.transformer_config(pp=world_size)
    chunks = build_model_chunks(config, sched.placement, vocab_size=tiny.vocab_size,
                                max_sequence_length=tiny.seq_length,
                                transformer_layer_spec=te_double.te_double_block_spec if te else None,
                                share_embeddings_and_output_weights=tiny.tied_embeddings,
                                split_backward=sched.split_backward)
    load_weights(chunks, tiny.seed)
    for chunk in chunks:  # after construction: megatron-core's own linears refuse fusion without apex
        for module in chunk.modules():
            if hasattr(module, "gradient_accumulation_fusion"):
                module.gradient_accumulation_fusion = fused
            if hasattr(module, "fuse_wgrad_accumulation"):
                module.fuse_wgrad_accumulation = fused
    names = {id(p): n for chunk in chunks for n, p in global_named_parameters(chunk)}
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=None)
    if te:
        defer_te_wgrad(chunks[0].config, ddp_config)
    hooks, current = [], te_double._current
    make_hook = DDP._make_backward_post_hook

    def logged(self, param):  # megatron-core's hook, and a record of when it fired
        hook = make_hook(self, param)

        def run(*args):
            hooks.append((names[id(param)], current["op"]))
            return hook(*args)
        return run

    with mock.patch("torch.cuda.current_device", lambda: "cpu"), \
            mock.patch.object(DDP, "_make_backward_post_hook", logged):
        model = [DDP(chunk.config, ddp_config, chunk, disable_bucketing=c > 0) for c, chunk in enumerate(chunks)]
    cfg = chunks[0].config
    cfg.no_sync_func = [d.no_sync for d in model]
    te_double.LOG.clear()
    fb = get_forward_backward_func(name, p2p_timeout=120, stats=te_double.OpTracker())
    for d in model:
        d.zero_grad_buffer()
    res = fb(forward_step_func=forward_step, data_iterator=data_iterators(tiny, 0, m, len(chunks)), model=model,
       num_microbatches=m, seq_length=tiny.seq_length, micro_batch_size=tiny.micro_batch_size)
    for d in model:
        d.finish_grad_sync()
    log = [(kind, op, pushed) for kind, _, op, pushed in te_double.LOG]
    losses = [[microbatch_loss(d) for d in res]] if rank == world_size - 1 else None
    return portable({"losses": losses, "grads": [named_grads(chunks)], "hooks": hooks, "fifo": log})


def _job(rank, world_size, cases):
    """Every case on the two pipeline ranks, then the references without pipelining, split over the
    two data-parallel replicas of a pp=1 layout (spawning dominates the cost on small machines)."""
    from megatron_vshape.testing.tiny_gpt import init_parallel, reference_run

    results = {case: _ddp_case(rank, world_size, *case) for case in cases}
    init_parallel(1, 1, Placement("single", 1), seed=cases[0][0].seed)
    keys = list(dict.fromkeys((tiny, m) for tiny, _, m, _, _ in cases))
    refs = {key: reference_run(*key, steps=1, initialise=False) for key in keys[rank::world_size]}
    return {"results": results, "refs": refs}


# (tiny, schedule, microbatches, TE double, gradient-accumulation fusion): the cases of both tests below.
TIED, UNTIED, M = TinyGPT(num_layers=4, seq_length=8, tied_embeddings=True), TinyGPT(num_layers=4, seq_length=8), 4
FUSED_TIED = [(TIED, name, M, False, True) for name in ("v-half", "v-zb")]
TE = [(UNTIED, name, M, True, fused) for name, fused in (("v-half", False), ("v-half", True), ("zb-h1", False),
                                                         ("v-min", True))]


@pytest.fixture(scope="module")
def runs():
    """{case: (the two ranks' results, the gradients' difference from the model without pipelining)}."""
    cases = FUSED_TIED + TE
    jobs = launch(_job, 2, (cases,), timeout=400)
    refs = {k: v for job in jobs for k, v in job["refs"].items()}
    out = {}
    for case in cases:
        mine = [job["results"][case] for job in jobs]
        out[case] = mine, compare(refs[(case[0], case[2])], mine)
    return out


@pytest.mark.timeout(450)
@pytest.mark.parametrize("case", FUSED_TIED, ids=[c[1] for c in FUSED_TIED])
def test_tied_embedding_with_gradient_accumulation_fusion_on_the_v(runs, case):
    """#35 item 2: every embedding-lookup gradient reaches main_grad through megatron-core's own hook."""
    _, diff = runs[case]
    print(case[1], diff)
    assert diff["max_rel_grad_diff"] <= TOL, diff


def _split_ops(name, m):
    sched = registry.build(name, 2, m)
    return {(op.stage, op.microbatch): str(op) for ops in sched.ranks for op in ops if op.kind in ("W", "BW")}


@pytest.mark.timeout(450)
@pytest.mark.parametrize("case", TE, ids=[f"{c[1]}-{'fused' if c[4] else 'unfused'}" for c in TE])
def test_te_layers_defer_to_w_in_b_order_and_hooks_fire_once_after_w(runs, case):
    """#35 item 1, against the TEST DOUBLE of TE's contract (te_double): TE layers built for a split
    schedule defer their weight GEMMs; each W runs them for its own microbatch (the FIFO pops in B order);
    megatron-core's DDP hook fires exactly once per TE weight and bias per microbatch, inside that W; the
    gradients equal the model's without pipelining."""
    _, name, m, _, _ = case
    jobs, diff = runs[case]
    assert diff["max_rel_grad_diff"] <= TOL, diff
    w_ops = _split_ops(name, m)
    for rank, job in enumerate(jobs):
        fifo = job["fifo"]
        pushes = [op for kind, op, _ in fifo if kind == "push"]
        pops = [(op, pushed) for kind, op, pushed in fifo if kind == "pop"]
        assert pushes and len(pops) == len(pushes), (rank, len(pushes), len(pops))
        for op, pushed in pops:  # W k@s (or BW k@s) took what B k@s (or BW k@s) deferred
            assert op.lstrip("BW") == pushed.lstrip("BW") and op.startswith(("W", "BW")), (rank, op, pushed)
        te_hooks = {}
        for param, op in job["hooks"]:
            if any(k in param for k in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")):
                te_hooks.setdefault(param, []).append(op)
            else:
                assert op is None or not op.startswith("W") or "output_layer" in param, (rank, param, op)
        assert te_hooks, rank
        for param, ops in te_hooks.items():
            stage = int(ops[0].split("@")[1])
            want = sorted(w_ops[(stage, k)] for k in range(m))
            assert sorted(ops) == want, (rank, param, ops, want)  # once per microbatch, in its W


def _double(delay, hooked=True):
    from types import SimpleNamespace

    from te_double import TELinearDouble

    cfg = SimpleNamespace(params_dtype=torch.float32, gradient_accumulation_fusion=False, delay_wgrad_compute=delay)
    layer = TELinearDouble(4, 4, config=cfg, init_method=torch.nn.init.normal_)
    if hooked:
        layer.register_wgrad_accumulation_and_reduce_hooks(lambda: None)
    return torch.nn.Sequential(layer)


def test_te_layers_the_step_cannot_honour_are_refused_before_it_starts():
    from megatron_vshape.runtime.wgrad import check_te_split
    from megatron_vshape.schedule.errors import ConfigError
    from test_executor_linear import build

    ops = registry.build("v-half", 2, 4).ranks[0]
    assert len(check_te_split([_double(True)], ops, split=True)[0]) == 1
    with pytest.raises(ConfigError, match=r"W3@. would take the weight gradient of microbatch 0"):
        check_te_split([_double(True)], build("local/v/split/reversed", 2, 4).ranks[0], split=True)
    with pytest.raises(ConfigError, match=r"compute their weight gradients in B.*split_backward=True"):
        check_te_split([_double(False)], ops, split=True)
    assert check_te_split([_double(False)], ops, split=False) == [[]]  # BW ops: TE's own backward
    with pytest.raises(ConfigError, match=r"no gradient hook.*ddp_config.delay_wgrad_compute=True"):
        check_te_split([_double(True, hooked=False)], ops, split=True)
    with pytest.raises(ConfigError, match=r"tp_comm_overlap=True .*userbuffer"):
        check_te_split([_double(True)], ops, split=True, tp_comm_overlap=True)
