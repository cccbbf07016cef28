"""Executor numerics on a stack of megatron-core Column/RowParallelLinear stages.

Every registered schedule, pp in {2, 3, 4}, microbatches {pp, 2pp+1, 4pp} (and 1 where the
schedule allows it): per-microbatch losses and every parameter's gradient against a
single-process run of the same megatron-core layers on the same weights and data.  One spawned
job per pp runs all cases (spawning dominates the cost on small CI machines).
"""
from __future__ import annotations

import functools
import zlib

import pytest
import torch

from megatron_vshape.integration.launch import launch
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.errors import ConfigError
from ddp_like import DDPLike

HIDDEN, SEQ, MBS = 8, 4, 2


# ---- the model: stage s = x + fc2(gelu(fc1(x))), a norm and an MSE loss after the last stage ----

def _config(tp=1, sequence_parallel=False):
    from megatron.core.model_parallel_config import ModelParallelConfig

    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                              pipeline_dtype=torch.float32, params_dtype=torch.float32,
                              use_cpu_initialization=True, perform_initialization=False,
                              deallocate_pipeline_outputs=True)
    cfg.hidden_size = HIDDEN  # what a TransformerConfig carries; the executor sizes messages with it
    return cfg


def _full(stage, name, shape, seed=7):
    g = torch.Generator().manual_seed(seed * 1000 + stage * 10 + zlib.crc32(name.encode()) % 7)
    return torch.randn(shape, generator=g) * 0.3


class Stage(torch.nn.Module):
    def __init__(self, config, stage, num_stages, tp_rank=0, tp=1):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        from megatron.core.enums import ModelType

        super().__init__()
        self.model_type = ModelType.encoder_or_decoder
        self.config, self.stage, self.last = config, stage, stage == num_stages - 1
        self.fc1 = ColumnParallelLinear(HIDDEN, 2 * HIDDEN, config=config, init_method=lambda w: None, bias=True,
                                        gather_output=False, skip_bias_add=False)
        self.fc2 = RowParallelLinear(2 * HIDDEN, HIDDEN, config=config, init_method=lambda w: None, bias=False,
                                     input_is_parallel=True, skip_bias_add=False)
        self.norm = torch.nn.LayerNorm(HIDDEN) if self.last else None
        rows = 2 * HIDDEN // tp
        with torch.no_grad():
            self.fc1.weight.copy_(_full(stage, "fc1.weight", (2 * HIDDEN, HIDDEN))[tp_rank * rows:(tp_rank + 1) * rows])
            self.fc1.bias.copy_(_full(stage, "fc1.bias", (2 * HIDDEN,))[tp_rank * rows:(tp_rank + 1) * rows])
            self.fc2.weight.copy_(_full(stage, "fc2.weight", (HIDDEN, 2 * HIDDEN))[:, tp_rank * rows:(tp_rank + 1) * rows])
        self.input_tensor = None

    def set_input_tensor(self, t):
        self.input_tensor = t[0] if isinstance(t, list) else t

    def forward(self, x):
        if self.input_tensor is not None:
            x = self.input_tensor
        h, _ = self.fc1(x)
        y, _ = self.fc2(torch.nn.functional.gelu(h))
        y = x + y
        return self.norm(y) if self.last else y


def _batch(mb, seed=3):
    g = torch.Generator().manual_seed(seed * 100 + mb)
    return {"x": torch.randn(SEQ, MBS, HIDDEN, generator=g), "target": torch.randn(SEQ, MBS, HIDDEN, generator=g)}


def _loss(target, out):
    loss = torch.nn.functional.mse_loss(out, target)
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["x"] if model.stage == 0 else None)
    return out, functools.partial(_loss, b["target"])


def _names(stage_module):
    return {f"stage{stage_module.stage}.{n}": p for n, p in stage_module.named_parameters()}


def _grad(p):
    g = p.main_grad if hasattr(p, "main_grad") else p.grad
    return None if g is None else g.detach().clone()


def reference(num_stages, m):
    """All stages on one rank, microbatches in order, loss scaled by 1/m as Megatron does."""
    cfg = _config()
    stages = [Stage(cfg, s, num_stages) for s in range(num_stages)]
    losses = []
    for mb in range(m):
        b = _batch(mb)
        y = b["x"]
        for st in stages:
            y = st(y)
        loss = torch.nn.functional.mse_loss(y, b["target"])
        losses.append(loss.item())
        (loss / m).backward()
    grads = {k: _grad(p) for st in stages for k, p in _names(st).items()}
    return losses, grads


def local_schedule(name, pp, m):
    """Hand-built schedules that do not depend on the generators.

    Ops in one global topological order (each microbatch through all stages and back), split
    by rank; `late-w` variants move every W to the end of its rank's list, in B order
    (`fifo`) or reversed, so W runs long after its B and out of order.
    """
    from megatron_vshape.schedule.ops import Costs, Op, Placement, Schedule
    from megatron_vshape.schedule.verify import verify

    kind, split, late = name.split("/")[1:]
    pl = Placement(kind, pp, 1 if kind == "single" else 2)
    ranks = [[] for _ in range(pp)]
    for mb in range(m):
        for st in range(pl.num_stages):
            ranks[pl.rank_of(st)].append(Op("F", mb, st))
        for st in reversed(range(pl.num_stages)):
            if split == "bw":
                ranks[pl.rank_of(st)].append(Op("BW", mb, st))
            else:
                ranks[pl.rank_of(st)].append(Op("B", mb, st))
                if late == "now":
                    ranks[pl.rank_of(st)].append(Op("W", mb, st))
    if late != "now":
        for r, ops in enumerate(ranks):
            ws = [Op("W", op.microbatch, op.stage) for op in ops if op.kind == "B"]
            ops.extend(reversed(ws) if late == "reversed" else ws)
    return verify(Schedule(name, pl, m, Costs().per_stage(pl.chunks), ranks))


LOCAL = ["local/v/bw/now", "local/v/split/now", "local/v/split/fifo", "local/v/split/reversed",
         "local/loop/split/reversed", "local/single/split/fifo"]


def build(name, pp, m, options=()):
    return local_schedule(name, pp, m) if name.startswith("local/") else registry.build(name, pp, m, **dict(options))


def _run_case(name, pp, m, options, rank, ddp_like=False):
    from megatron_vshape.runtime.executor import get_forward_backward_func

    sched = build(name, pp, m, options)
    pl = sched.placement
    cfg = _config()
    chunks = [Stage(cfg, s, pl.num_stages) for s in pl.stages_of(rank)]
    # megatron-core's own (unsplit) backward needs apex's CUDA kernel for gradient_accumulation_fusion.
    hooks = DDPLike(chunks, cfg, fusion=sched.split_backward, names=_names) if ddp_like else None
    fb = get_forward_backward_func(sched if name.startswith("local/") else name, p2p_timeout=60,
                                   schedule_options=dict(options))
    iters = [iter([_batch(mb) for mb in range(m)]) for _ in chunks]
    for c in chunks:
        c.config = cfg
    out = fb(forward_step_func=forward_step, data_iterator=iters, model=chunks, num_microbatches=m,
             seq_length=SEQ, micro_batch_size=MBS)
    grads = {k: _grad(p) for c in chunks for k, p in _names(c).items()}
    return {"losses": [d["loss"].item() for d in out], "grads": grads,
            "hooks": hooks.report() if hooks else None}


def _job(rank, world_size, cases, with_reference):
    from megatron_vshape.runtime.groups import destroy_megatron, init_megatron

    init_megatron(tp=1, pp=world_size)
    results = {}
    for case in cases:
        results[case] = _run_case(*case[:4], rank=rank, ddp_like=case[4])
    refs = {}
    if rank == 0 and with_reference:
        for name, pp, m, options, _ in cases:
            stages = build(name, pp, m, options).num_stages
            if (stages, m) not in refs:
                refs[(stages, m)] = reference(stages, m)
    destroy_megatron()
    return {"results": results, "refs": refs}


def schedule_cases(pp, names=None, counts=None):
    """(name, m, generator options) for the schedules (default: all registered) and microbatch
    counts (default 1, pp, 2pp+1, 4pp; 1 only where the schedule allows it)."""
    out = []
    for name in names or registry.names():
        for m in counts or sorted({1, pp, 2 * pp + 1, 4 * pp}):
            options = ()
            if name.startswith("local/"):
                out.append((name, m, options))
                continue
            try:
                registry.build(name, pp, m)
            except ConfigError:
                if m == 1:
                    continue  # schedules that need more microbatches than 1
                if name != "1f1b-interleaved":
                    raise
                # Megatron's interleaving groups microbatches by pp; one group of m runs any m.
                options = (("group", m),)
                registry.build(name, pp, m, **dict(options))
            out.append((name, m, options))
    return out


def _cases(pp, ddp_like=False, names=None):
    """(name, pp, m, generator options, ddp_like) for every schedule and microbatch count."""
    return [(name, pp, m, options, ddp_like) for name, m, options in schedule_cases(pp, names)]


def _check(cases, jobs):
    ref_by = jobs[0]["refs"]
    bitwise, worst = 0, 0.0
    for case in cases:
        name, pp, m, options, _ = case
        S = build(name, pp, m, options).num_stages
        ref_losses, ref_grads = ref_by[(S, m)]
        last = jobs[pp - 1]["results"][case]
        assert len(last["losses"]) == m, f"{case}: {len(last['losses'])} loss dicts on the last rank"
        for r in range(pp - 1):
            assert jobs[r]["results"][case]["losses"] == [], f"{case}: rank {r} returned losses"
        torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        grads = {}
        for job in jobs:
            grads.update(job["results"][case]["grads"])
        assert grads.keys() == ref_grads.keys()
        for k, ref in ref_grads.items():
            got = grads[k]
            assert got is not None, f"{case}: {k} has no gradient"
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            assert err <= 1e-6, f"{case}: {k} relative error {err:.2e}"
            bitwise += bool(torch.equal(got, ref))
            worst = max(worst, err)
    print(f"{len(cases)} cases, bitwise-equal gradients: {bitwise}, worst relative error {worst:.2e}")


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_every_schedule_matches_reference(pp):
    """Every registered schedule, and hand-built V, loop and single schedules (BW, and B/W split
    with W deferred to the end of the list in B order or reversed), in one spawned job per pp."""
    cases = _cases(pp) + _cases(pp, names=LOCAL)
    jobs = launch(_job, pp, (cases, True), timeout=300)
    _check(cases, jobs)


def test_grad_hooks_see_each_gradient_once_and_complete():
    """DDP-style hooks (main_grad, gradient_accumulation_fusion, per-chunk no_sync): while sync is
    on, each parameter's hook fires exactly once, after its last contribution (B for biases and
    norms, the last W for split weights), and never with a missing gradient."""
    pp = 2
    names = ["1f1b", "zb-h1", "local/v/split/reversed", "local/v/split/now", "local/loop/split/reversed"]
    cases = [(n, pp, m, (), True) for n in names for m in (2, 5)]
    jobs = launch(_job, pp, (cases, True), timeout=240)
    _check(cases, jobs)
    for case in cases:
        for job in jobs:
            res = job["results"][case]
            hooks = res["hooks"]
            assert hooks["none_grad"] == [], f"{case}: hooks fired without a gradient: {hooks['none_grad']}"
            fired = {}
            for name, grad in hooks["fired"]:
                # No parameter is borrowed here; a tied weight may register twice (test_executor_gpt).
                assert name not in fired, f"{case}: {name} registered twice while sync was on"
                fired[name] = grad
            assert fired.keys() == res["grads"].keys(), f"{case}: hooks missing for {res['grads'].keys() - fired.keys()}"
            for name, grad in fired.items():
                assert torch.equal(grad, res["grads"][name]), f"{case}: {name} hook fired before its gradient was complete"


def test_borrowed_parameters_are_found_through_wrappers():
    """The executor finds a chunk's `borrowed_parameters` under Megatron-style wrappers (each
    holding the next in `.module`), and none on a chunk without them."""
    from megatron_vshape.runtime.executor import _borrowed_parameters

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    owner, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    head.borrowed_parameters = (owner.weight,)
    found = _borrowed_parameters(Wrapper(Wrapper(head)))
    assert len(found) == 1 and found[0] is owner.weight
    assert _borrowed_parameters(Wrapper(owner)) == ()
