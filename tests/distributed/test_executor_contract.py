"""Megatron's forward-backward contract, on the linear stack: forward_only, non-loss data,
per-token loss with the token count on the last pipeline rank, grad_scale_func, grad/param
sync callbacks derived from the op list, losses shipped from rank 0 (V shape) to rank p-1,
and a stuck receive that becomes an error naming the rank, the op and the peer."""
from __future__ import annotations

import functools

import pytest
import torch

from megatron_vshape.integration.launch import LaunchError, launch
from test_executor_linear import HIDDEN, MBS, SEQ, Stage, _batch, _config, _grad, _names, build, forward_step, reference

SCHEDULES = ["1f1b", "v-zb", "local/v/split/reversed"]


def _chunks(sched, rank, cfg):
    return [Stage(cfg, s, sched.placement.num_stages) for s in sched.placement.stages_of(rank)]


def _iters(chunks, m):
    return [iter([_batch(mb) for mb in range(m)]) for _ in chunks]


def _fb(name, sched, **kw):
    from megatron_vshape.runtime.executor import get_forward_backward_func

    kw.setdefault("p2p_timeout", 60)
    return get_forward_backward_func(sched if name.startswith("local/") else name, **kw)


def _non_loss(target, out, non_loss_data=False):
    assert non_loss_data
    return {"first": out.detach()[0, 0, :2].clone()}


def _forward_step_non_loss(data_iterator, model):
    b = next(data_iterator)
    out = model(b["x"] if model.stage == 0 else None)
    return out, functools.partial(_non_loss, b["target"])


def _per_token_loss(target, out):
    loss = torch.nn.functional.mse_loss(out, target, reduction="sum")
    tokens = torch.tensor(target.numel(), dtype=torch.int)
    return loss, tokens, {"loss": loss.detach().clone()}


def _forward_step_per_token(data_iterator, model):
    b = next(data_iterator)
    out = model(b["x"] if model.stage == 0 else None)
    return out, functools.partial(_per_token_loss, b["target"])


def _job(rank, world_size, m):
    from megatron_vshape.runtime.groups import destroy_megatron, init_megatron

    init_megatron(tp=1, pp=world_size)
    out = {}
    for name in SCHEDULES:
        sched = build(name, world_size, m)
        res = out[name] = {}

        # forward_only evaluation: losses on the last rank, no gradients anywhere
        cfg = _config()
        chunks = _chunks(sched, rank, cfg)
        with torch.no_grad():
            losses = _fb(name, sched)(forward_step_func=forward_step, data_iterator=_iters(chunks, m), model=chunks,
                                      num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, forward_only=True)
        res["eval_losses"] = [d["loss"].item() for d in losses]
        res["eval_grads"] = [n for c in chunks for n, p in _names(c).items() if p.grad is not None]

        # collect_non_loss_data
        with torch.no_grad():
            data = _fb(name, sched)(forward_step_func=_forward_step_non_loss, data_iterator=_iters(chunks, m),
                                    model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS,
                                    forward_only=True, collect_non_loss_data=True)
        res["non_loss"] = [d["first"] for d in data]

        # evaluation with one microbatch, a count the fixed schedule was not built for: the forward ops in
        # pipeline order on its placement (Megatron-LM's --eval-global-batch-size may give any count)
        with torch.no_grad():
            one = _fb(name, sched)(forward_step_func=forward_step, data_iterator=_iters(chunks, 1), model=chunks,
                                   num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS, forward_only=True)
        res["eval_one"] = [d["loss"].item() for d in one]

        # per-token loss, grad_scale_func, finalize/grad-sync/param-sync callbacks
        cfg = _config()
        cfg.calculate_per_token_loss = True
        cfg.grad_scale_func = lambda loss: loss * 4.0
        chunks = _chunks(sched, rank, cfg)
        events = res["events"] = []
        snapshots = res["grad_at_sync"] = {}

        def grad_sync(c, params):
            events.append(("grad_sync", c))
            snapshots.update({k: _grad(p) for k, p in _names(chunks[c]).items()})

        def param_sync(c, params):
            events.append(("param_sync", c, all(p.grad is None for p in chunks[c].parameters())))

        def finalize(model, num_tokens, pg_collection=None, force_all_reduce=False):
            events.append(("finalize", None if num_tokens is None else int(num_tokens)))

        cfg.grad_sync_func = [functools.partial(grad_sync, c) for c in range(len(chunks))]
        cfg.param_sync_func = [functools.partial(param_sync, c) for c in range(len(chunks))]
        cfg.finalize_model_grads_func = finalize
        from megatron_vshape.runtime.stats import Recorder

        recorder = Recorder()
        losses = _fb(name, sched, stats=recorder)(
            forward_step_func=_forward_step_per_token, data_iterator=_iters(chunks, m), model=chunks,
            num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
        res["stats"] = recorder.to_dict()
        res["plan"] = [(op.kind, op.microbatch, op.stage) for op in sched.ranks[rank]]
        res["token_losses"] = [d["loss"].item() for d in losses]
        res["grads"] = {k: _grad(p) for c in chunks for k, p in _names(c).items()}
        if rank == 0:  # megatron-core's layers need the parallel state of a launched rank
            res["reference"] = reference(sched.num_stages, m)
    # v-half cannot hold one microbatch under its memory limit at pp=3 (its build refuses it): evaluating one still runs
    v_half = build("v-half", world_size, m)
    chunks = _chunks(v_half, rank, _config())
    with torch.no_grad():
        one = _fb("v-half", v_half)(forward_step_func=forward_step, data_iterator=_iters(chunks, 1), model=chunks,
                                    num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS, forward_only=True)
    out["v-half eval_one"] = [d["loss"].item() for d in one]
    out["misuse"] = _misuse(rank, world_size, m)
    destroy_megatron()
    return out


def _step_or_refusal(schedule, model, m):
    """One training step's losses (this rank's: [] off the last rank), or the ConfigError's text."""
    from megatron_vshape.schedule.errors import ConfigError

    try:
        losses = _fb("local/", schedule)(forward_step_func=forward_step, data_iterator=_iters(model, m), model=model,
                                         num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
        return [d["loss"].item() for d in losses]
    except ConfigError as exc:
        return str(exc)


def _misuse(rank, pp, m):
    """Configuration mistakes raise ConfigError on every rank before any message moves."""
    sched = build("local/v/split/now", pp, m)
    messages = []
    for model, schedule, no_sync in [
        (_chunks(sched, rank, _config())[:1], sched, None),  # one chunk for a V schedule
        (_chunks(sched, rank, _config()), build("local/v/split/now", pp, m + 1), None),  # built for other sizes
        (_chunks(sched, rank, _config()), sched, lambda: None),  # one no_sync for two chunks
    ]:
        if no_sync is not None:
            model[0].config.no_sync_func = no_sync
        messages.append(_step_or_refusal(schedule, model, m))
    # Ranks that planned differently are refused on every rank before any message moves: other
    # messages, or other W's alone (a tensor-parallel W may gather); with the same planner sources
    # (other flags) or other ones (another megatron_vshape on a node, as rank 0's here), while
    # other sources that planned the same schedule run.
    from megatron_vshape.planner import plan_cache

    real = plan_cache.code_version
    for first, sources in [("local/v/split/reversed", real), ("v-zb", real), ("local/v/split/now", "another"),
                           ("v-zb", "another")]:
        mine = build(first, pp, m) if rank == 0 else sched
        if rank == 0 and sources != real:
            plan_cache.code_version = lambda: sources
        try:
            messages.append(_step_or_refusal(mine, _chunks(mine, rank, _config()), m))
        finally:
            plan_cache.code_version = real
    return messages


@pytest.mark.parametrize("pp", [2, 3])
def test_contract(pp):
    m = 2 * pp + 1
    jobs = launch(_job, pp, (m,), timeout=240)
    for job in jobs:
        one_chunk, other_sizes, one_no_sync, w_apart, order_apart, sources_apart, both_apart = job["misuse"]
        for said in (w_apart, order_apart, both_apart):
            assert isinstance(said, str) and "the pipeline ranks planned schedule" in said, said
            assert "ranks [0]: schedule" in said
        assert "give every rank the same schedule, costs, memory budget and layout" in w_apart + order_apart
        assert "install the same megatron_vshape on every node: the planner sources differ" in both_apart
        assert not isinstance(sources_apart, str), sources_apart  # the same schedule from other sources runs
        assert one_chunk and "places 2 model chunk(s) per rank" in one_chunk
        assert other_sizes and f"microbatches={m + 1}" in other_sizes and f"num_microbatches={m}" in other_sizes
        assert one_no_sync and "pass a list with one per chunk" in one_no_sync
    torch.testing.assert_close(torch.tensor(jobs[pp - 1]["misuse"][5]),  # other sources, the same schedule
                               torch.tensor(jobs[0]["v-zb"]["reference"][0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(jobs[pp - 1]["v-half eval_one"]),
                               torch.tensor(jobs[0]["v-zb"]["reference"][0][:1]), rtol=1e-6, atol=0)
    for name in SCHEDULES:
        ref_losses, ref_grads = jobs[0][name]["reference"]
        last = jobs[pp - 1][name]
        for r in range(pp - 1):
            assert jobs[r][name]["eval_losses"] == [] and jobs[r][name]["non_loss"] == []
            assert jobs[r][name]["token_losses"] == []
        torch.testing.assert_close(torch.tensor(last["eval_losses"]), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(last["eval_one"]), torch.tensor(ref_losses[:1]), rtol=1e-6, atol=0)
        assert all(jobs[r][name]["eval_one"] == [] for r in range(pp - 1))
        assert len(last["non_loss"]) == m
        elems = SEQ * MBS * HIDDEN
        torch.testing.assert_close(torch.tensor(last["token_losses"]), torch.tensor(ref_losses) * elems,
                                   rtol=1e-5, atol=0)
        for r, job in enumerate(jobs):
            res = job[name]
            assert res["eval_grads"] == [], f"{name}: forward_only left gradients on rank {r}"
            chunks = build(name, pp, m).placement.chunks
            finals = [e for e in res["events"] if e[0] == "finalize"]
            assert len(finals) == 1
            if r == pp - 1:  # Megatron reads the token count on the last pipeline rank
                assert finals[0][1] == m * elems, f"{name}: rank {r} token count {finals[0][1]}"
            assert sorted(e[1] for e in res["events"] if e[0] == "grad_sync") == list(range(chunks))
            param_syncs = [e for e in res["events"] if e[0] == "param_sync"]
            assert sorted(e[1] for e in param_syncs) == list(range(chunks)) and all(e[2] for e in param_syncs)
            assert res["events"][-1][0] == "finalize"
            # stats: every op of the rank's list, in order, timed; activation memory all released
            st = res["stats"]
            assert [op[:3] for op in st["ops"]] == res["plan"]
            assert all(a <= b for *_, a, b in st["ops"])
            assert st["peak_bytes"] > 0 and st["current_bytes"] == 0, st["current_bytes"]
            # grad_sync comes after the chunk's last gradient contribution
            for k, g in res["grad_at_sync"].items():
                assert torch.equal(g, res["grads"][k]), f"{name}: {k} changed after grad_sync"
            # loss * 4 (grad_scale_func), summed not averaged (per-token): grads = ref * 4 * m * elems
            for k, g in res["grads"].items():
                want = ref_grads[k] * 4 * m * elems
                err = ((g - want).abs().max() / want.abs().max()).item()
                assert err < 1e-5, f"{name}: {k} relative error {err:.1e}"


def _stuck_job(rank, world_size, steps_before):
    """Rank 1 never joins step `steps_before` + 1: rank 0 must fail with a clear error instead of
    hanging (at the first step, where the ranks compare plans, or at a later one's receive)."""
    from megatron_vshape.runtime.groups import destroy_megatron, init_megatron
    from megatron_vshape.runtime.p2p import directional_groups

    init_megatron(tp=1, pp=world_size)
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    directional_groups(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
    sched = build("local/v/split/now", world_size, 2)
    cfg = _config()
    chunks = _chunks(sched, rank, cfg)
    # Steps both ranks run get a timeout no loaded machine reaches; the stuck one 2 s, from a barrier.
    step = _fb("local/v", sched, p2p_timeout=2 if steps_before == 0 else 120)
    for k in range(steps_before + 1):
        if k == steps_before > 0:
            dist.barrier()
            step.p2p_timeout = 2
        if rank == 1 and k == steps_before:
            import time

            time.sleep(30)
            return None
        step(forward_step_func=forward_step, data_iterator=_iters(chunks, 2), model=chunks, num_microbatches=2,
             seq_length=SEQ, micro_batch_size=MBS)
    destroy_megatron()


def _apart_job(rank, world_size, tp, ep):
    """Two pipelines of two ranks, each agreeing within itself, on different schedules: tensor-
    parallel peers (tp=2), or data-parallel replicas that share experts (ep=2)."""
    from megatron_vshape.runtime.groups import destroy_megatron, init_megatron
    from megatron.core import parallel_state as ps

    init_megatron(tp=tp, pp=2, expert_model_parallel_size=ep)
    m, tp_rank = 5, ps.get_tensor_model_parallel_rank()
    other = tp_rank if tp > 1 else ps.get_data_parallel_rank()
    sched = build("v-zb" if other == 1 else "local/v/split/now", 2, m)
    cfg = _config()
    model = [Stage(cfg, s, sched.placement.num_stages, tp_rank, tp)
             for s in sched.placement.stages_of(ps.get_pipeline_model_parallel_rank())]
    said = _step_or_refusal(sched, model, m)
    destroy_megatron()
    return said


@pytest.mark.parametrize("peers, tp, ep", [("tensor-parallel", 2, 1), ("expert-parallel", 1, 2)])
def test_peers_that_planned_apart_are_refused_on_every_rank(peers, tp, ep):
    for said in launch(_apart_job, 4, (tp, ep), timeout=240):
        assert said and f"the {peers} ranks planned schedule" in said, said
        assert "give every rank the same schedule" in said


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo"])
def test_stuck_receive_names_rank_op_and_peer(backend):
    """Also when the default group's backend string is not plain "gloo" (init_process_group("cpu:gloo,cuda:nccl")
    or with none given): the transport's waits follow the tensors' device, not that string."""
    with pytest.raises(LaunchError, match=r"rank 0 of 2 failed(.|\n)*P2PTimeout: rank 0: F0@3 waiting to receive "
                                          r"act0:2->3 from rank 1: nothing arrived within 2s "
                                          r"\(raise --pipeline-p2p-timeout"):  # the driver's flag
        # The 2 s receive timeout runs once the ranks are ready; the groups' own timeout is far longer.
        launch(_stuck_job, 2, (1,), timeout=240, backend=backend, pg_timeout=200)


def test_a_rank_missing_its_first_step_is_named_where_the_ranks_compare_plans():
    with pytest.raises(LaunchError, match=r"rank 0 of 2 failed(.|\n)*P2PTimeout: rank 0: comparing plans with the other "
                                          r"pipeline ranks, not every one arrived within 2s \(raise --pipeline-p2p-timeout"):
        launch(_stuck_job, 2, (0,), timeout=240, pg_timeout=200)
