"""install()'s wrappers for the hook points newer Megatron-LM releases moved or extended, in one process
without a Megatron-LM checkout (CI has none; tests/e2e/test_megatron_lm_real.py runs them in real checkouts).
The wrapped functions here are test doubles with the documented signatures of those releases."""
from __future__ import annotations

import pytest

from megatron_vshape.integration import megatron_lm
from megatron_vshape.integration.args import PipelinePlan
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Costs


def _plan(name="v-half", pp=2, m=4):
    return PipelinePlan(name=name, schedule=registry.build(name, pp, m), pp=pp, data_parallel_size=1,
                        num_microbatches=m, costs=Costs())


@pytest.fixture
def v_plan(monkeypatch):
    plan = _plan()
    monkeypatch.setattr(megatron_lm, "_plan", plan)
    return plan


def _executor(**kwargs):
    return kwargs


_executor.__name__ = "forward_backward_v-half"


def test_schedule_pg_collection_of_core_v0_19_becomes_the_groups_of_calls_that_pass_none(v_plan):
    class Groups:  # a ProcessGroupCollection: it has a pp group
        pp = object()

    groups = Groups()
    fb = megatron_lm._with_schedule_groups(_executor, v_plan, {"schedule_pg_collection": groups})
    assert fb.__name__ == "forward_backward_v-half"
    assert fb(model=1)["pg_collection"] is groups
    other = Groups()
    assert fb(model=1, pg_collection=other)["pg_collection"] is other  # the call's own wins
    assert megatron_lm._with_schedule_groups(_executor, v_plan, {}) is _executor


def test_a_multi_module_collection_and_other_sizes_are_refused(v_plan):
    class MultiModuleProcessGroupCollection:  # megatron-core's cross-grid collection: no single pp group
        pass

    with pytest.raises(ConfigError, match="multi-module MultiModuleProcessGroupCollection is not supported"):
        megatron_lm._with_schedule_groups(_executor, v_plan,
                                          {"schedule_pg_collection": MultiModuleProcessGroupCollection()})
    with pytest.raises(ConfigError, match=r"get_forward_backward_func\(pp_size=4\) but --pipeline-schedule v-half "
                                          r"runs pp_size=2"):
        megatron_lm._with_schedule_groups(_executor, v_plan, {"pp_size": 4})
    with pytest.raises(ConfigError, match="vp_size=2"):
        megatron_lm._with_schedule_groups(_executor, v_plan, {"vp_size": 3})
    assert megatron_lm._with_schedule_groups(_executor, v_plan, {"pp_size": 2, "vp_size": 2}) is _executor


def test_the_wrapper_passes_the_keywords_each_release_takes(monkeypatch):
    def core_v0_19(pp_size=None, vp_size=None, schedule_pg_collection=None):  # megatron-core's own, unhooked
        return "megatron-core's"

    monkeypatch.setattr(megatron_lm, "_plan", None)
    wrapped = megatron_lm._get_forward_backward_func(core_v0_19)
    assert wrapped(schedule_pg_collection=None) == "megatron-core's"
    monkeypatch.setattr(megatron_lm, "_plan", _plan())
    with pytest.raises(TypeError):  # a keyword this release does not take fails as it would unhooked
        wrapped(new_keyword=1)


def _batch_core_v0_19(batch, has_cu_seqlens, is_hybrid_cp, create_attention_mask_in_dataloader, broadcast_src_rank,
                      broadcast_group, cp_size, tp_rank, micro_batch_size, seq_length, mtp_on_this_rank,
                      pipeline_model_parallel_size=1, is_pipeline_first_stage=False, is_pipeline_last_stage=False):
    return mtp_on_this_rank, batch, seq_length


def _batch_core_v0_16(data_iterator, mtp_on_this_rank: bool = False):
    return mtp_on_this_rank, data_iterator


@pytest.mark.parametrize("rank,want", [(0, True), (1, False)])
def test_v_rank_0_gets_every_field_with_either_signature(v_plan, monkeypatch, rank, want):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: rank)
    new = megatron_lm._get_batch_on_this_tp_rank(_batch_core_v0_19)
    got = new({"tokens": 1}, has_cu_seqlens=False, is_hybrid_cp=False, create_attention_mask_in_dataloader=False,
              broadcast_src_rank=0, broadcast_group=None, cp_size=1, tp_rank=0, micro_batch_size=2, seq_length=16,
              mtp_on_this_rank=False, pipeline_model_parallel_size=2, is_pipeline_first_stage=True)
    assert got == (want, {"tokens": 1}, 16)
    old = megatron_lm._get_batch_on_this_tp_rank(_batch_core_v0_16)
    assert old("iterator") == (want, "iterator") and old("iterator", mtp_on_this_rank=False) == (want, "iterator")


def test_the_executor_reads_megatron_lms_rerun_data_iterator():
    """Megatron-LM's train_step passes megatron-core's RerunDataIterator (next() but no iter()), every tag."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    from megatron_vshape.runtime.microbatch_data import bind, for_op

    (data,) = bind([RerunDataIterator(iter(["mb0", "mb1"]))], shared=True)
    assert next(for_op(data, 1)) == "mb1" and next(for_op(data, 0)) == "mb0"


def _ramp_args(plan_args, start, increment=1):
    """The validated flags with Megatron-LM's --rampup-batch-size START INCREMENT 100 (one sample a microbatch)."""
    from argparse import Namespace

    return Namespace(**{**vars(plan_args), "rampup_batch_size": [str(start), str(increment), "100"]})


def test_a_ramp_is_checked_at_the_budget_the_executor_plans_under():
    """A ramp's other microbatch counts are rebuilt by name with the plan's options: v-auto under
    --pipeline-memory-budget 0.5 cannot hold one microbatch at pp=4 (under 1.0, its default, it can), so a
    ramp starting at one sample is refused, naming where it may start."""
    from megatron_vshape.integration.args import validate_pipeline_args
    from test_integration_args import _args

    flags = _args("--pipeline-schedule", "v-auto", "--pipeline-memory-budget", "0.5")
    plan = validate_pipeline_args(flags)
    assert megatron_lm._runs_by_name(plan) and plan.options == {"memory_budget": 0.5}
    megatron_lm._check_rampup(_ramp_args(flags, 2), plan)
    with pytest.raises(ConfigError, match=r"starts at 1 samples = 1 microbatches, which --pipeline-schedule v-auto "
                                          r"cannot run .*start the ramp at >= 2 samples"):
        megatron_lm._check_rampup(_ramp_args(flags, 1), plan)


def test_a_ramp_is_refused_for_a_layout_planned_for_one_microbatch_count():
    """--pipeline-balance auto's schedule runs as planned for its layout (not rebuilt by name), so it
    has no op list for a ramp's other counts: refused at validation, not at the ramp's first step."""
    from megatron_vshape.integration.args import validate_pipeline_args
    from test_integration_args import _args

    flags = _args("--pipeline-schedule", "v-half", "--pipeline-balance", "auto", num_layers=16, hidden_size=1024,
                  seq_length=1024, vocab_size=128000, global_batch_size=16)
    plan = validate_pipeline_args(flags)
    assert not megatron_lm._runs_by_name(plan)
    with pytest.raises(ConfigError, match="--pipeline-balance auto planned one op list of v-half for 16 microbatches"):
        megatron_lm._check_rampup(_ramp_args(flags, 4), plan)


def test_a_ramp_is_checked_at_every_batch_size_it_reaches():
    """1f1b-interleaved at pp=4 runs 4 and 8 microbatches but not 6 (a last group shorter than pp): a ramp
    4, 6, 8 would stop at 6, hours in; it is refused at validation, naming that size."""
    from megatron_vshape.integration.args import validate_pipeline_args
    from test_integration_args import _args

    flags = _args("--pipeline-schedule", "1f1b-interleaved")
    plan = validate_pipeline_args(flags)
    megatron_lm._check_rampup(_ramp_args(flags, 4, 4), plan)  # 4, 8
    with pytest.raises(ConfigError, match=r"reaches 6 samples = 6 microbatches, which --pipeline-schedule "
                                          r"1f1b-interleaved cannot run \(.*last group of 2 < pp=4"):
        megatron_lm._check_rampup(_ramp_args(flags, 4, 2), plan)


@pytest.mark.parametrize("flags,said", [({"use_distributed_optimizer": True, "save": "ckpt"}, True),
                                        ({"use_distributed_optimizer": True, "save": "ckpt",
                                          "dist_ckpt_optim_fully_reshardable": True}, False),
                                        ({"use_distributed_optimizer": False, "save": "ckpt"}, False)])
def test_distributed_optimizer_checkpoints_on_the_v_say_where_they_resume(v_plan, capsys, flags, said):
    """Megatron-LM's default distributed-optimizer state (dp_reshardable) is by gradient-buffer position, which the
    V's placement changes; its load checks only tp and pp sizes, so the start-up line says what resumes where."""
    import argparse

    megatron_lm._announce(v_plan, argparse.Namespace(rank=0, **flags))
    out = capsys.readouterr().out
    assert ("--dist-ckpt-optim-fully-reshardable" in out) == said, out
