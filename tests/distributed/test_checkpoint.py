"""Checkpoints resume under another schedule, pp or tp and continue the same loss curve.

Each case trains the tiny GPT (megatron_vshape.testing.tiny_gpt: weights and data are pure
functions of seed and step) for K steps under schedule A with Adam and a StepLR scheduler, saves,
and trains N more steps (the uninterrupted run).  Then, in a fresh parallel state (for pp/tp
changes a fresh launch with another world size), schedule B builds the model from scratch, loads
the checkpoint and trains the same N steps.  Checked:

* the parameters and Adam's exp_avg/exp_avg_sq right after loading equal those at saving, bit for
  bit, by global name (whatever the layouts), and the scheduler's learning rate is restored;
* the N losses and the final parameters equal the uninterrupted run's bit for bit: every schedule
  adds each gradient in the same order (one contribution per microbatch, in microbatch order, as
  the executor tests prove against the non-pipelined model).  Tied cases use one microbatch per
  step, where that holds for the tied weight too (with several, its two uses reach the gradient in
  a schedule-dependent order);
* after a tp change the losses agree within TP_TOL (sharded GEMMs and their all-reduce round
  differently; Adam then turns rounding-level differences of near-zero gradients into visible
  parameter differences, so parameters are only compared at load).

Cases, one mechanism each: V -> single (v-half -> 1f1b), V -> loop (v-min -> 1f1b-interleaved),
pp 4 -> pp 2 on the V (v-half -> v-zb), tp 1 -> 2 (tied, v-zb -> v-half), and tied embeddings
between the V (one weight on rank 0) and the single placement (the last rank's copy, which
megatron-core checkpoints as a replica of the embedding) both ways: 1f1b -> v-zb, v-half -> 1f1b.  Plus the errors: no checkpoint, and a checkpoint of other model sizes.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import pytest
import torch

from megatron_vshape.integration.launch import launch
from megatron_vshape.testing.tiny_gpt import TinyGPT

K, N, M = 2, 2, 4  # steps before the save, steps after it, microbatches per step
ADAM = functools.partial(torch.optim.Adam, lr=0.02, betas=(0.8, 0.9))
TP_TOL = 1e-4
UNTIED = TinyGPT(num_layers=8, seq_length=8)
TIED = TinyGPT(num_layers=8, seq_length=8, tied_embeddings=True)


def _optimizer(chunks):
    from megatron_vshape.testing.tiny_gpt import unique_parameters

    opt = ADAM(unique_parameters(chunks))
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


def _setup(tiny, name, tp, pp, m):
    """Parallel state and this rank's chunks for schedule `name`, weights as initialised."""
    from megatron_vshape.schedule import registry
    from megatron_vshape.testing.tiny_gpt import build_chunks, init_parallel

    placement = registry.build(name, pp, m).placement
    init_parallel(tp, pp, placement, seed=tiny.seed)
    return build_chunks(tiny, placement, tp=tp)


def _train(tiny, name, m, chunks, opt, sched, steps):
    """Train `steps` (global step numbers); per step the microbatch losses (last pipeline rank) or None."""
    from megatron.core import parallel_state as ps

    from megatron_vshape.runtime.chunks import allreduce_tied_embedding
    from megatron_vshape.runtime.executor import get_forward_backward_func
    from megatron_vshape.testing.tiny_gpt import data_iterators, forward_step, microbatch_loss

    fb = get_forward_backward_func(name, p2p_timeout=120)
    losses = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        res = fb(forward_step_func=forward_step, data_iterator=data_iterators(tiny, step, m, len(chunks)),
                 model=chunks, num_microbatches=m, seq_length=tiny.seq_length, micro_batch_size=tiny.micro_batch_size)
        losses.append([microbatch_loss(d) for d in res])
        allreduce_tied_embedding(chunks)  # single/loop placements: first and last rank's copies
        opt.step()
        sched.step()
    last = ps.get_pipeline_model_parallel_rank() == ps.get_pipeline_model_parallel_world_size() - 1
    return losses if last and ps.get_tensor_model_parallel_rank() == 0 else None


def _params(chunks, opt=None):
    """{global name: full tensor} of this rank's parameters (tensor-parallel shards gathered),
    with `opt`: also their optimizer state, as "name#exp_avg" etc."""
    from megatron_vshape.runtime.chunks import global_named_parameters
    from megatron_vshape.testing.tiny_gpt import _tp_layout, full_grads, portable

    named = {}
    for c in chunks:
        for n, p in global_named_parameters(c):
            named[n] = {"grad": p.detach().clone(), "layout": _tp_layout(p)}
            for k, v in (opt.state.get(p, {}) if opt is not None else {}).items():
                named[f"{n}#{k}"] = {"grad": v.detach().clone(), "layout": _tp_layout(p) if v.dim() else None}
    return portable(full_grads(named))


def _allow_writer_processes():
    """megatron-core's torch_dist writer forks writer processes (and a results-queue manager);
    torchrun's ranks may, but `launch` starts its ranks daemonic, which forbids children."""
    import multiprocessing

    multiprocessing.current_process().daemon = False


def _save(case, root):
    """Schedule A: K steps, save, N more steps (the uninterrupted run)."""
    from megatron_vshape.integration.checkpoint import save_checkpoint

    tiny, a, tp, pp = dataclasses.replace(case["tiny"], pipeline_layout=case["layout_a"]), case["a"], case["tp_a"], \
        case["pp_a"]
    chunks = _setup(tiny, a, tp, pp, case["m"])
    opt, sched = _optimizer(chunks)
    before = _train(tiny, a, case["m"], chunks, opt, sched, range(K))
    path = save_checkpoint(os.path.join(root, case["id"]), K, chunks, opt, sched, extra={"schedule": a, "pp": pp, "tp": tp})
    at_save = _params(chunks, opt)
    after = _train(tiny, a, case["m"], chunks, opt, sched, range(K, K + N))
    return {"before": before, "after": after, "params": _params(chunks), "state": at_save, "path": path}


def _resume(case, root):
    """Schedule B: build from scratch, load, the same N steps."""
    from megatron_vshape.integration.checkpoint import load_checkpoint

    tiny, b, tp, pp = dataclasses.replace(case["tiny"], pipeline_layout=case["layout_b"]), case["b"], case["tp_b"], \
        case["pp_b"]
    chunks = _setup(tiny, b, tp, pp, case["m"])
    opt, sched = _optimizer(chunks)
    iteration, extra = load_checkpoint(os.path.join(root, case["id"]), chunks, opt, sched)
    assert iteration == K and extra == {"schedule": case["a"], "pp": case["pp_a"], "tp": case["tp_a"]}, (iteration, extra)
    lr, at_load = opt.param_groups[0]["lr"], _params(chunks, opt)
    after = _train(tiny, b, case["m"], chunks, opt, sched, range(iteration, iteration + N))
    return {"after": after, "params": _params(chunks), "state": at_load, "lr": lr}


def _job(rank, world_size, cases, root, save, errors):
    """Resume the cases saved earlier that this world size resumes, then save those it saves."""
    _allow_writer_processes()
    out = {"resumed": {}, "saved": {}}
    for case in cases:
        if case["tp_b"] * case["pp_b"] == world_size and os.path.isdir(os.path.join(root, case["id"])):
            out["resumed"][case["id"]] = _resume(case, root)
    for case in cases:
        if save and case["tp_a"] * case["pp_a"] == world_size:
            out["saved"][case["id"]] = _save(case, root)
    if errors:
        out["errors"] = _errors(world_size, root, cases[0]["id"])
    return out


def _errors(world_size, root, saved):
    """ConfigError on every rank: no checkpoint; a checkpoint of another model; a checkpoint without
    checksums whose shard was cut short (torch's CheckpointException, a BaseException, passed by)."""
    import glob
    import shutil

    import torch.distributed as dist

    from megatron_vshape.integration import ckpt_integrity
    from megatron_vshape.integration.checkpoint import find_checkpoint, load_checkpoint
    from megatron_vshape.schedule.errors import ConfigError

    damaged = os.path.join(root, "damaged-" + saved)
    if dist.get_rank() == 0:
        shutil.copytree(find_checkpoint(os.path.join(root, saved)), damaged)
        os.remove(os.path.join(damaged, ckpt_integrity.MANIFEST))
        shard = sorted(glob.glob(os.path.join(damaged, "*.distcp")))[0]
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    dist.barrier()
    messages = []
    for tiny, path in ((UNTIED, os.path.join(root, "nothing-here")),
                       (TinyGPT(num_layers=4, hidden_size=48, seq_length=16), os.path.join(root, saved)),
                       (UNTIED, damaged),
                       (dataclasses.replace(UNTIED, vocab_size=2 * UNTIED.vocab_size), os.path.join(root, saved))):
        chunks = _setup(tiny, "1f1b", 1, world_size, M)
        opt, sched = _optimizer(chunks)
        try:
            load_checkpoint(path, chunks, opt, sched)
            messages.append(None)
        except ConfigError as e:
            messages.append(str(e))
    return messages


def _case(id_, tiny, a, b, pp_a=2, pp_b=2, tp_a=1, tp_b=1, m=M, layout_a=None, layout_b=None):
    return {"id": id_, "tiny": tiny, "a": a, "b": b, "pp_a": pp_a, "pp_b": pp_b, "tp_a": tp_a, "tp_b": tp_b, "m": m,
            "layout_a": layout_a, "layout_b": layout_b}


def _merge(jobs):
    out = {}
    for job in jobs:
        for key, r in job.items():
            o = out.setdefault(key, {"params": {}, "state": {}})
            o["params"].update(r["params"])
            o["state"].update(r["state"])
            for k, v in r.items():
                if k not in ("params", "state") and (v is not None or k not in o):
                    o[k] = v
    return out


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))


def _check(case, saved, resumed):
    tol = TP_TOL if case["tp_a"] != case["tp_b"] else 0.0
    label = (f"{case['a']} pp={case['pp_a']} tp={case['tp_a']} layout={case['layout_a']} -> {case['b']} "
             f"pp={case['pp_b']} tp={case['tp_b']} layout={case['layout_b']}" + (" tied" if case["tiny"].tied_embeddings else ""))
    s, r = saved[case["id"]], resumed[case["id"]]
    assert os.path.basename(s["path"]) == f"iter_{K:07d}", s["path"]
    assert r["lr"] == pytest.approx(ADAM.keywords["lr"] * 0.7 ** K), "scheduler state not restored"
    assert s["params"].keys() == r["params"].keys() and s["state"].keys() == r["state"].keys()
    assert any(k.endswith("#exp_avg_sq") for k in s["state"]), "no optimizer state saved"
    # What was loaded is what was saved, bit for bit, whatever the layouts: parameters and Adam's state.
    loaded_exactly = all(np.array_equal(s["state"][n], r["state"][n]) for n in s["state"])
    loss_diff = _rel(s["after"], r["after"])
    param_diff = max(_rel(s["params"][n], r["params"][n]) for n in s["params"])
    print(f"{label}: losses before save {np.round(s['before'], 6).tolist()}\n"
          f"  after: uninterrupted {np.round(s['after'], 6).tolist()}\n"
          f"         resumed       {np.round(r['after'], 6).tolist()}\n"
          f"  loaded parameters and optimizer state {'equal' if loaded_exactly else 'DIFFER FROM'} the saved ones; "
          f"after {N} more steps, max relative difference: loss {loss_diff:.1e}, parameters {param_diff:.1e}")
    if not loaded_exactly:
        return False
    if tol == 0.0:
        return s["after"] == r["after"] and all(np.array_equal(s["params"][n], r["params"][n]) for n in s["params"])
    # After a tp change, Adam (update ~ m / sqrt(v)) turns rounding-level differences of near-zero
    # gradient entries into visible parameter differences: the loss curve is what must agree.
    return loss_diff <= tol


CASES = [_case("v-half_to_1f1b", UNTIED, "v-half", "1f1b"),
         _case("tied_1f1b_to_v-zb", TIED, "1f1b", "v-zb", m=1),
         _case("v-min_to_interleaved", UNTIED, "v-min", "1f1b-interleaved"),
         _case("tied_v-half_to_1f1b", TIED, "v-half", "1f1b", m=1),
         _case("tied_tp1_to_tp2", TIED, "v-zb", "v-half", tp_b=2, m=1),
         _case("pp4_to_pp2", UNTIED, "v-half", "v-zb", pp_a=4)]


# Uneven layouts: global layer numbers do not depend on the layout, so a checkpoint moves between them.
LAYOUT_CASES = [_case("uneven_v_to_another", UNTIED, "v-zb", "v-half", layout_a=(3, 1, 2, 2), layout_b=(1, 3, 3, 1)),
                _case("tied_uneven_v_to_uneven_1f1b", TIED, "v-half", "1f1b", m=1, layout_a=(2, 2, 3, 1),
                      layout_b=(5, 3))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case of both tests below, in three launches (spawning dominates the cost): 2 ranks save
    (pp=2), 4 ranks resume the tp change and save pp=4, 2 ranks resume the rest and meet the errors."""
    root, saved, resumed, errors = str(tmp_path_factory.mktemp("checkpoints")), {}, {}, None
    for world_size, save, errors_too in ((2, True, False), (4, True, False), (2, False, True)):
        jobs = launch(_job, world_size, (CASES + LAYOUT_CASES, root, save, errors_too), timeout=290)
        saved.update(_merge([job["saved"] for job in jobs]))
        resumed.update(_merge([job["resumed"] for job in jobs]))
        errors = errors or jobs[0].get("errors")
    return saved, resumed, errors


@pytest.mark.timeout(900)  # three launches, each bounded by its own timeout
def test_resume_under_another_schedule_pp_and_tp(runs):
    saved, resumed, errors = runs
    failed = [case["id"] for case in CASES if not _check(case, saved, resumed)]
    assert not failed, failed
    missing, other_model, damaged, other_vocab = errors
    # the vocabulary alone: what a tp change pads differently, with the flag that pads it as saved
    assert other_vocab and "vocab_size=" in other_vocab and "--make-vocab-size-divisible-by" in other_vocab, other_vocab
    assert missing and "no checkpoint to load at" in missing and "nothing-here" in missing, missing
    assert other_model and "num_layers=8 (this model: 4)" in other_model and "hidden_size=32 (this model: 48)" in other_model, other_model
    assert "max_sequence_length=8 (this model: 16)" in other_model, other_model  # learned positions' rows
    assert damaged and "cannot be read (CheckpointException" in damaged and "checksums.json" in damaged, damaged
    print("errors:", missing, other_model, damaged, sep="\n  ")


@pytest.mark.timeout(900)  # the launches, if this test runs first
def test_resume_under_another_layout(runs):
    saved, resumed, _ = runs
    failed = [case["id"] for case in LAYOUT_CASES if not _check(case, saved, resumed)]
    assert not failed, failed


def test_which_checkpoint_a_path_names(tmp_path):
    """No ranks needed: the tracker, an iter_* directory, and what is not a checkpoint."""
    from megatron_vshape.integration.checkpoint import TRACKER, find_checkpoint, iteration_dir
    from megatron_vshape.schedule.errors import ConfigError

    with pytest.raises(ConfigError, match="no checkpoint to load at .*: it does not exist"):
        find_checkpoint(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=f"has no {TRACKER} and is no checkpoint"):
        find_checkpoint(str(tmp_path))
    (tmp_path / TRACKER).write_text("release\n")
    with pytest.raises(ConfigError, match="'release', not an iteration number"):
        find_checkpoint(str(tmp_path))
    (tmp_path / TRACKER).write_text("6\n")
    with pytest.raises(ConfigError, match="names iteration 6, but .*iter_0000006 holds no complete checkpoint"):
        find_checkpoint(str(tmp_path))
    done = iteration_dir(str(tmp_path), 6)
    os.makedirs(done)
    open(os.path.join(done, "metadata.json"), "w").write("{}")
    assert find_checkpoint(str(tmp_path)) == done == find_checkpoint(done)


def _wrapped_job(rank, world_size, root):
    """Saved from chunks inside megatron-core's data-parallel wrapper (as the driver's on GPUs), loaded into wrapped
    and into plain chunks: the GPTModel's own keys either way."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    from megatron_vshape.integration.checkpoint import load_checkpoint, save_checkpoint

    _allow_writer_processes()
    wrap = lambda chunks: [_BaseDataParallel(c.config, c) for c in chunks]  # noqa: E731 - what DDP takes its methods from
    chunks = _setup(UNTIED, "v-half", 1, world_size, M)
    opt, sched = _optimizer(chunks)
    _train(UNTIED, "v-half", M, chunks, opt, sched, range(K))
    save_checkpoint(root, K, wrap(chunks), opt, sched)
    saved, out = _params(chunks, opt), {}
    for how in ("wrapped", "plain"):
        fresh = _setup(UNTIED, "v-half", 1, world_size, M)
        opt, sched = _optimizer(fresh)
        load_checkpoint(root, wrap(fresh) if how == "wrapped" else fresh, opt, sched)
        out[how] = _params(fresh, opt)
    return saved, out


def test_chunks_in_the_data_parallel_wrapper_save_and_load_by_the_models_keys(tmp_path):
    for saved, loaded in launch(_wrapped_job, 2, args=(str(tmp_path),), timeout=240):
        for how, params in loaded.items():
            assert sorted(params) == sorted(saved), how
            assert all(np.array_equal(params[k], saved[k]) for k in saved), how
