"""--pipeline-balance auto with --pipeline-replan-after N on gloo ranks: the driver re-balances the
layout once from the op times measured in iteration N, at a checkpoint boundary (save N, rebuild the
chunks, load), and then trains exactly as a fresh start from that checkpoint with the new layout.

The measured op times are injected (each op's recorded end is moved to start + a synthetic
duration built from per-part costs: the output layer with the loss worth HEAD layers), so the
measured costs, and with them the layout, differ from the shape's estimate deterministically;
everything after the recorder (tally, the collective, the split into per-part costs, the search,
the checkpoint round trip) is the real path.  The same command resumed from that checkpoint says the
re-balance is past and how to keep its layout.  Measured costs that the layout already suits keep
it: no checkpoint at N, and the numbers of the run that never re-planned.  Untied embeddings and no
dropout: the runs compared may take their microbatches in other orders, which then gives the
same floats.
"""
from __future__ import annotations

import contextlib
import io
import os

import pytest

from megatron_vshape.integration.launch import launch

PP, ITERS, AT = 2, 4, 2
LAYER, EMBEDDING, HEAD = (1e-3, 1.2e-3, 0.8e-3), (2e-4, 0.0, 3e-4), (6e-3, 5e-3, 5e-3)  # F, B, W seconds
FLAGS = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-2",
         "--lr-warmup-iters", "1", "--mock-data", "--vocab-size", "63", "--make-vocab-size-divisible-by", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
         "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size", str(PP)]


def _inject(layout, head=HEAD):
    """Recorder.op records a duration from LAYER/EMBEDDING/`head` for `layout`'s stages instead of the real one."""
    from megatron_vshape.runtime import stats

    original = stats.Recorder.op
    last = len(layout) - 1

    @contextlib.contextmanager
    def op(self, kind, microbatch, stage, device):
        with original(self, kind, microbatch, stage, device):
            yield
        k = "FBW".index(kind)
        seconds = layout[stage] * LAYER[k] + (stage == 0) * EMBEDDING[k] + (stage == last) * head[k]
        kind_, mb, stage_, start, _ = self.ops[-1]
        self.ops[-1] = (kind_, mb, stage_, start, start + seconds)

    stats.Recorder.op = op


def _job(rank, world_size, root):
    import multiprocessing

    from megatron_vshape.argtypes import quiet_megatron_notices
    from megatron_vshape.integration import train

    quiet_megatron_notices()
    # megatron-core's checkpoint writer starts processes, which `launch`'s daemonic ranks may not (as torchrun's may).
    multiprocessing.current_process().daemon = False
    balanced = FLAGS + ["--pipeline-schedule", "v-half", "--pipeline-balance", "auto"]
    replan = ["--pipeline-replan-after", str(AT)]
    save = f"{root}/moved"
    # --save-interval AT: the checkpoint due at AT is saved at the re-balance, recording the new layout.
    args = train.parse_args(balanced + replan + ["--save", save, "--save-interval", str(AT)])
    plan = train.validate(args, world_size=world_size)
    first_layout = plan.stage_layers
    _inject(first_layout)
    rebalanced = train.run(args, plan)
    new_layout = ",".join(map(str, rebalanced["replanned"]["layout"]))
    args = train.parse_args(FLAGS + ["--pipeline-schedule", "v-half", "--pipeline-layout", new_layout,
                                     "--load", save, "--ckpt-step", str(AT)])
    fresh = train.run(args, train.validate(args, world_size=world_size))
    # The first command again, resumed from the re-balance's checkpoint: nothing measured here before AT, so
    # the re-balance is past; start-up says so, with the layout in use and the flags that keep the new one.
    args = train.parse_args(balanced + replan + ["--save", f"{root}/resumed", "--load", save, "--ckpt-step", str(AT)])
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        resumed = train.run(args, train.validate(args, world_size=world_size))
    resumed["printed"] = printed.getvalue()
    # Measured costs the layout already suits: it stays, only the order is re-planned, no checkpoint at AT.
    _inject(first_layout, head=LAYER)
    args = train.parse_args(balanced + replan + ["--save", f"{root}/kept"])
    kept = train.run(args, train.validate(args, world_size=world_size))
    args = train.parse_args(balanced)
    plain = train.run(args, train.validate(args, world_size=world_size))
    return {"first_layout": list(first_layout), "rebalanced": rebalanced, "fresh": fresh, "resumed": resumed,
            "kept": kept, "plain": plain}


@pytest.mark.timeout(600)
def test_replan_after_n_rebalances_at_a_checkpoint_and_continues_like_a_fresh_start(tmp_path):
    jobs = launch(_job, PP, (str(tmp_path),), timeout=540)
    info = jobs[0]["rebalanced"]["replanned"]
    assert all(job["rebalanced"]["replanned"] == info for job in jobs)  # every rank decided alike
    assert info["iteration"] == AT and info["changed"] and info["previous_layout"] == jobs[0]["first_layout"]
    layout = info["layout"]
    assert layout != info["previous_layout"] and sum(layout) == 8
    # The head's cost moved layers off rank 0 (stages 0 and 3 on the V).
    assert layout[0] + layout[-1] < info["previous_layout"][0] + info["previous_layout"][-1]
    # The per-part costs are what was injected: a layer from the middle stages, the ends beyond it.
    for part, want in (("layer", LAYER), ("embedding", EMBEDDING), ("head", HEAD)):
        got = info["parts"][part]
        assert [got["F"], got["B"], got["W"]] == pytest.approx(want, rel=1e-6, abs=1e-9), part
    for job in jobs:
        rebalanced, fresh = job["rebalanced"], job["fresh"]
        assert len(rebalanced["losses"]) == ITERS and len(fresh["losses"]) == ITERS - AT
        assert rebalanced["losses"][AT:] == fresh["losses"]  # exact floats
        assert rebalanced["grad_norms"][AT:] == fresh["grad_norms"]
    resumed = jobs[0]["resumed"]
    new = ",".join(map(str, layout))
    assert resumed["replanned"] is None and len(resumed["losses"]) == ITERS - AT
    assert (f"--pipeline-replan-after={AT}: resumed at iteration {AT}, so the re-balance at iteration {AT} is past and "
            f"not redone: layout in use {','.join(map(str, jobs[0]['first_layout']))} (") in resumed["printed"]
    assert f"the checkpoint's run went on with {new}: to keep it, resume with --pipeline-layout {new} " \
        "instead of --pipeline-balance auto" in resumed["printed"]
    # The kept layout: no rebuild, no checkpoint at AT, and the same numbers as the run that never re-planned.
    kept = jobs[0]["kept"]["replanned"]
    assert not kept["changed"] and kept["layout"] == kept["previous_layout"] == jobs[0]["first_layout"]
    assert sorted(os.listdir(tmp_path / "kept")) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(tmp_path / "moved")) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    for job in jobs:
        assert job["kept"]["losses"] == job["plain"]["losses"] and len(job["plain"]["losses"]) == ITERS
