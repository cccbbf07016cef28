"""--pipeline-schedule's options on a parser, and their validation against Megatron-LM's sizes
before any process group exists (a plain Namespace with Megatron-LM attribute names)."""
import argparse

import pytest

from megatron_vshape.integration.args import add_pipeline_arguments, validate_pipeline_args
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.simulate import peak_vs_1f1b, simulate


def _args(*argv, **megatron):
    parser = add_pipeline_arguments(argparse.ArgumentParser())
    ns = parser.parse_args(list(argv))
    sizes = dict(num_layers=8, pipeline_model_parallel_size=4, tensor_model_parallel_size=1, micro_batch_size=1,
                 global_batch_size=8, world_size=4, transformer_impl="local")
    sizes.update(megatron)
    for k, v in sizes.items():
        setattr(ns, k, v)
    return ns


def test_every_registered_schedule_is_a_choice_and_builds_for_megatron_sizes():
    for name in registry.names():
        plan = validate_pipeline_args(_args("--pipeline-schedule", name))
        assert plan.name == name and plan.num_microbatches == 8 and plan.data_parallel_size == 1
        assert plan.schedule.pp == 4 and plan.schedule.microbatches == 8
        want_vp = plan.schedule.placement.chunks if plan.schedule.placement.chunks > 1 else None
        assert plan.virtual_pipeline_model_parallel_size == want_vp


def test_unset_schedule_is_megatrons_own():
    assert validate_pipeline_args(_args()) is None


def test_microbatches_count_data_parallel_replicas():
    plan = validate_pipeline_args(_args("--pipeline-schedule", "v-half", world_size=8, global_batch_size=16,
                                        micro_batch_size=2))
    assert (plan.data_parallel_size, plan.num_microbatches) == (2, 4)


def test_interleaved_takes_megatrons_virtual_pipeline_flags():
    plan = validate_pipeline_args(_args("--pipeline-schedule", "1f1b-interleaved", num_layers=12,
                                        num_layers_per_virtual_pipeline_stage=1))
    assert plan.schedule.placement.chunks == 3 and plan.options == {"chunks": 3}


@pytest.mark.parametrize("argv, sizes, words", [
    (["--pipeline-schedule", "v-half", "--pipeline-layout", "1,2,1"], {},
     ["--pipeline-layout 1,2,1 gives 3 stages", "v-half at pp=4 has 8", "give 8 counts in model order"]),
    (["--pipeline-schedule", "1f1b", "--pipeline-layout", "2,2,2,1"], {},
     ["--pipeline-layout 2,2,2,1 sums to 7 layers but --num-layers=8", "make them equal"]),
    (["--pipeline-schedule", "v-zb", "--pipeline-layout", "2,-1,1,1,1,1,1,2"], {}, ["stage 1 has -1 layers", ">= 0"]),
    (["--pipeline-schedule", "v-zb", "--pipeline-layout", "2,0,1,1,1,1,1,1"], {}, ["stage 1 has no layers"]),
    (["--pipeline-schedule", "v-zb", "--pipeline-layout", "1,2,x"], {}, ["'x' is not a layer count", "whole numbers"]),
    (["--pipeline-schedule", "v-zb", "--pipeline-layout", "1,1,1,1,1,1,1,1"], dict(decoder_first_pipeline_num_layers=1),
     ["gives every stage's layers", "unset --decoder-first-pipeline-num-layers"]),
    (["--pipeline-schedule", "v-half"], dict(decoder_first_pipeline_num_layers=1, account_for_loss_in_pipeline_split=True),
     ["cannot be combined"]),
    (["--pipeline-schedule", "v-half"], dict(decoder_first_pipeline_num_layers=9), ["leave -1 layers"]),
    (["--pipeline-schedule", "v-half", "--pipeline-balance", "auto", "--pipeline-layout", "1,1,1,1,1,1,1,1"], {},
     ["--pipeline-balance auto chooses every stage's layers", "unset --pipeline-layout"]),
    (["--pipeline-schedule", "v-half", "--pipeline-balance", "auto"], {}, ["give --hidden-size, --seq-length, --vocab-size"]),
    (["--pipeline-schedule", "1f1b", "--pipeline-balance", "auto", "--pipeline-memory-budget", "0.1"],
     dict(hidden_size=1024, seq_length=1024, vocab_size=128000), ["fits --pipeline-memory-budget 0.1", "raise"]),
    (["--pipeline-schedule", "v-min"], dict(global_batch_size=6, micro_batch_size=4),
     ["--global-batch-size=6", "--global-batch-size=8"]),
    (["--pipeline-schedule", "1f1b-interleaved"], dict(global_batch_size=2),
     ["microbatches=2", "--global-batch-size=2", "raise --global-batch-size"]),
    (["--pipeline-schedule", "v-half"], dict(pipeline_model_parallel_layout="Et|t|tL"),
     ["--pipeline-model-parallel-layout Et|t|tL gives 3 stages"]),
    (["--pipeline-schedule", "v-half"], dict(virtual_pipeline_model_parallel_size=4), ["virtual pipeline size is 4"]),
    (["--pipeline-schedule", "zb-h1"], dict(virtual_pipeline_model_parallel_size=2), ["1f1b-interleaved"]),
    (["--pipeline-schedule", "v-half"], dict(mtp_num_layers=1), ["--mtp-num-layers=1"]),
    (["--pipeline-schedule", "v-half"], dict(pipeline_model_parallel_size=1, world_size=1), ["pipeline-model-parallel-size >= 2"]),
    (["--pipeline-schedule", "v-half"], dict(world_size=6), ["world size 6", "multiple of 4"]),
    (["--pipeline-schedule", "v-half", "--pipeline-p2p-timeout", "0"], {}, ["--pipeline-p2p-timeout=0"]),
    (["--pipeline-schedule", "v-half", "--pipeline-memory-budget", "-1"], {}, ["--pipeline-memory-budget=-1"]),
    (["--pipeline-schedule", "v-half", "--pipeline-costs", "1,x,1"], {}, ["1,x,1"]),
])
def test_bad_combinations_name_the_value_and_the_fix(argv, sizes, words):
    with pytest.raises(ConfigError) as e:
        validate_pipeline_args(_args(*argv, **sizes))
    for w in words:
        assert w in str(e.value)


def test_transformer_engine_is_checked_where_the_schedule_splits_the_backward(monkeypatch):
    from megatron_vshape.integration import args as mod

    # The reason an older TE cannot, by release (TE's source history; README "Transformer Engine").
    for version, reason in (((2, 1), "came in 2.3"), ((2, 6), "fires no gradient hook"), ((2, 7), "fixed in 2.8")):
        monkeypatch.setattr(mod, "_te_version", lambda version=version: version)
        with pytest.raises(ConfigError, match=f"from 2.8; found {version[0]}.{version[1]}, whose .*{reason}"):
            validate_pipeline_args(_args("--pipeline-schedule", "v-half", transformer_impl="transformer_engine"))
    # 1F1B has no W: any TE will do
    assert validate_pipeline_args(_args("--pipeline-schedule", "1f1b", transformer_impl="transformer_engine"))
    monkeypatch.setattr(mod, "_te_version", lambda: (2, 8))
    assert validate_pipeline_args(_args("--pipeline-schedule", "v-half", transformer_impl="transformer_engine"))


def test_non_v_layer_split_follows_megatrons_rule():
    plan = validate_pipeline_args(_args("--pipeline-schedule", "1f1b", num_layers=8,
                                        decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=2))
    assert plan.name == "1f1b"
    assert plan.stage_layers == (2, 2, 2, 2)
    # What does not divide goes to the middle stages (Megatron itself would refuse it).
    plan = validate_pipeline_args(_args("--pipeline-schedule", "1f1b", num_layers=9, decoder_first_pipeline_num_layers=2))
    assert plan.stage_layers == (2, 2, 3, 2)


@pytest.mark.parametrize("argv, sizes, want", [
    ([], dict(num_layers=30), (3, 4, 4, 4, 4, 4, 4, 3)),  # any layer count, remainder in the middle
    (["--pipeline-layout", "3,4,4,4,4,4,4,3"], dict(num_layers=30), (3, 4, 4, 4, 4, 4, 4, 3)),
    (["--pipeline-layout", "Et*3|(t*4|)*6t*3L"], dict(num_layers=30), (3, 4, 4, 4, 4, 4, 4, 3)),
    ([], dict(num_layers=30, pipeline_model_parallel_layout="E|t*5|(t*4|)*5t*5L"), (0, 5, 4, 4, 4, 4, 4, 5)),
    # Megatron's meaning on the V: first = stage 0, last = stage 2p-1, both on rank 0.
    ([], dict(num_layers=32, decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=3),
     (2, 4, 5, 5, 5, 4, 4, 3)),
    ([], dict(num_layers=30, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
     (3, 4, 4, 4, 4, 4, 4, 3)),
])
def test_v_layouts_from_every_flag(argv, sizes, want):
    plan = validate_pipeline_args(_args("--pipeline-schedule", "v-half", *argv, **sizes))
    assert plan.stage_layers == want


def test_auto_picks_a_schedule_within_the_budget_and_says_why():
    from megatron_vshape.integration.args import schedule_choices

    assert "auto" in schedule_choices()
    plan = validate_pipeline_args(_args("--pipeline-schedule", "auto", "--pipeline-memory-budget", "0.6",
                                        "--pipeline-costs", "2,2.2,1.6,0.05"))
    assert plan.reason and plan.name in plan.reason and plan.name in registry.names()
    assert max(simulate(plan.schedule).peak_vs_1f1b) <= 0.6 + 1e-9
    with pytest.raises(ConfigError, match="--pipeline-memory-budget"):
        validate_pipeline_args(_args("--pipeline-schedule", "auto"))


def test_auto_in_training_weighs_v_auto_below_the_budget():
    """The training caller of choose.fastest_within: at pp=6, m=24, 2,2,2,0.25 v-auto's own search
    at budget 16/12 ends at 150.75, a step below at 150.25 (test_search's instance); --pipeline-schedule
    auto at 16/12 trains the 150.25 plan, planned at 15/12, and says so."""
    plan = validate_pipeline_args(_args("--pipeline-schedule", "auto", "--pipeline-memory-budget", str(16 / 12),
                                        "--pipeline-costs", "2,2,2,0.25", num_layers=12, pipeline_model_parallel_size=6,
                                        global_batch_size=24, world_size=6))
    assert plan.name == "v-auto" and plan.schedule.memory_budget == 15 / 12
    assert simulate(plan.schedule).makespan == 150.25 and "planned at budget 1.25" in plan.reason
    # Rebuilt by name (Megatron-LM's hook, another microbatch count of a ramp) it is the same plan, at 15/12:
    # the options carry the budget it was planned at, not the generator's default (1.0).
    assert plan.options == {"memory_budget": 15 / 12}
    assert registry.build(plan.name, 6, 24, plan.costs, **plan.options).ranks == plan.schedule.ranks


def test_v_auto_in_training_plans_under_the_memory_budget():
    """--pipeline-schedule v-auto --pipeline-memory-budget X plans under X (it planned under 1.0, 1F1B's
    memory, whatever X said), and keeps X in the options the executor rebuilds it with."""
    costs = ("--pipeline-costs", "2,2.2,1.6,0.05")
    plan = validate_pipeline_args(_args("--pipeline-schedule", "v-auto", "--pipeline-memory-budget", "0.5", *costs))
    assert plan.options == {"memory_budget": 0.5} and plan.schedule.memory_budget == 0.5
    assert max(simulate(plan.schedule).peak_vs_1f1b) <= 0.5 + 1e-9
    assert plan.schedule.ranks == registry.build("v-auto", 4, 8, plan.costs, memory_budget=0.5).ranks
    wide = validate_pipeline_args(_args("--pipeline-schedule", "v-auto", "--pipeline-memory-budget", "5", *costs))
    assert wide.options == {"memory_budget": 2.0}  # beyond 2.0 every V-shape order fits: the same plans
    with pytest.raises(ConfigError, match=r"--pipeline-memory-budget 0.3 is below V-Min's 0.5 at pp=4"):
        validate_pipeline_args(_args("--pipeline-schedule", "v-auto", "--pipeline-memory-budget", "0.3", *costs))


def test_a_schedule_over_the_memory_budget_is_refused(tmp_path):
    """--pipeline-memory-budget is a cap for every schedule: one that does not plan under it (a named one,
    a file's) and holds more on some rank is refused at validation, with the ways out."""
    from megatron_vshape.schedule.export import to_json

    v_half = registry.build("v-half", 4, 8)
    peak = max(peak_vs_1f1b(v_half))
    assert validate_pipeline_args(_args("--pipeline-schedule", "v-half", "--pipeline-memory-budget", str(peak)))
    with pytest.raises(ConfigError, match=rf"--pipeline-schedule v-half holds up to {peak:.3g} .* over "
                                          r"--pipeline-memory-budget 0.4; pass --pipeline-schedule auto"):
        validate_pipeline_args(_args("--pipeline-schedule", "v-half", "--pipeline-memory-budget", "0.4"))
    path = tmp_path / "v_half.json"
    path.write_text(to_json(v_half))
    with pytest.raises(ConfigError, match=rf"--pipeline-schedule-file {path} holds up to {peak:.3g}"):
        validate_pipeline_args(_args("--pipeline-schedule-file", str(path), "--pipeline-memory-budget", "0.4"))


def test_balance_auto_plans_the_layout_it_prints():
    plan = validate_pipeline_args(_args("--pipeline-schedule", "v-half", "--pipeline-balance", "auto", num_layers=16,
                                        hidden_size=1024, seq_length=1024, vocab_size=128000, global_batch_size=16))
    assert sum(plan.stage_layers) == 16 and plan.stage_layers != (2,) * 8
    assert plan.as_built and plan.schedule.stage_costs is not None  # the executor runs the order planned for it
    assert "even 2,2,2,2,2,2,2,2" in plan.balance and f"balanced {','.join(map(str, plan.stage_layers))}" in plan.balance


@pytest.mark.parametrize("argv, named", [
    (["--pipeline-layout", "1,3,3,1"], "--pipeline-layout applies"),
    (["--pipeline-memory-budget", "0.5", "--pipeline-costs", "1,2,1"], "--pipeline-memory-budget, --pipeline-costs apply"),
    (["--pipeline-balance", "auto"], "--pipeline-balance auto applies"),
    (["--pipeline-replan-after", "2"], "--pipeline-replan-after applies"),
])
def test_schedule_flags_without_a_schedule_are_refused(argv, named):
    """Without --pipeline-schedule (Megatron-LM's hook: Megatron's own schedules run) the flags that only a
    megatron_vshape schedule reads would be dropped without a word; at pp=1 the driver names them itself."""
    with pytest.raises(ConfigError, match=f"{named} to a --pipeline-schedule of megatron_vshape, but none is given"):
        validate_pipeline_args(_args(*argv))
    assert validate_pipeline_args(_args()) is None  # Megatron's own schedule, nothing of ours asked for
    assert validate_pipeline_args(_args(*argv[:1] + argv[1:2], pipeline_model_parallel_size=1)) is None


def test_the_microbatch_group_flag_is_refused_where_it_cannot_apply(tmp_path):
    """--microbatch-group-size-per-virtual-pipeline-stage orders 1f1b-interleaved as built by name: a file's
    order or auto's choice (built at the defaults) would silently run without it."""
    from megatron_vshape.schedule.export import to_json

    path = tmp_path / "interleaved.json"
    path.write_text(to_json(registry.build("1f1b-interleaved", 4, 8)))
    assert registry.build("1f1b-interleaved", 4, 8, group=8).ranks != registry.build("1f1b-interleaved", 4, 8).ranks
    with pytest.raises(ConfigError, match=rf"=8 orders 1f1b-interleaved .* but --pipeline-schedule-file {path} holds"):
        validate_pipeline_args(_args("--pipeline-schedule-file", str(path), microbatch_group_size_per_vp_stage=8))
    with pytest.raises(ConfigError, match="but --pipeline-schedule auto weighs each schedule at its defaults"):
        validate_pipeline_args(_args("--pipeline-schedule", "auto", "--pipeline-memory-budget", "1",
                                     microbatch_group_size_per_vp_stage=8))
    plan = validate_pipeline_args(_args("--pipeline-schedule", "1f1b-interleaved", microbatch_group_size_per_vp_stage=8))
    assert plan.options["group"] == 8


def test_the_memory_budget_weighs_an_uneven_layout():
    """A schedule planned for equal stages holds more on a rank whose stages hold more layers: the budget is
    checked on the layout that runs (v-half at pp=4 holds 0.75 of 1F1B on equal stages)."""
    even = validate_pipeline_args(_args("--pipeline-schedule", "v-half", "--pipeline-memory-budget", "0.75",
                                        num_layers=16))
    assert max(peak_vs_1f1b(even.schedule)) == 0.75
    with pytest.raises(ConfigError, match=r"v-half holds up to 1.62 of 1F1B's activation memory \(rank 0 with layers "
                                          r"per stage 4,1,1,1,1,1,1,6\), over --pipeline-memory-budget 0.75; .*"
                                          r"--pipeline-balance auto"):
        validate_pipeline_args(_args("--pipeline-schedule", "v-half", "--pipeline-memory-budget", "0.75",
                                     "--pipeline-layout", "4,1,1,1,1,1,1,6", num_layers=16))
    with pytest.raises(ConfigError, match=r"v-auto holds up to 1.12 .* over --pipeline-memory-budget 0.5"):
        validate_pipeline_args(_args("--pipeline-schedule", "v-auto", "--pipeline-memory-budget", "0.5",
                                     "--pipeline-layout", "4,1,1,1,1,1,1,6", num_layers=16))
    with pytest.raises(ConfigError, match=r"^--pipeline-schedule auto's choice v-half \(weighed on equal stages\) holds "
                                          r"up to 1.62 .*; pass --pipeline-balance auto \(the layout planned within the "
                                          r"budget\), or raise the budget$"):
        validate_pipeline_args(_args("--pipeline-schedule", "auto", "--pipeline-memory-budget", "0.8",
                                     "--pipeline-layout", "4,1,1,1,1,1,1,6", num_layers=16))


def test_a_budget_beyond_two_plans_as_two_with_or_without_balance():
    """Beyond 2.0 of 1F1B every V-shape order fits: v-auto plans at 2.0, whether the layout is given or
    balanced (balance refused it, naming the planner's --memory-budget)."""
    shape = dict(hidden_size=256, seq_length=256, vocab_size=1000)
    plain = validate_pipeline_args(_args("--pipeline-schedule", "v-auto", "--pipeline-memory-budget", "3", **shape))
    balanced = validate_pipeline_args(_args("--pipeline-schedule", "v-auto", "--pipeline-memory-budget", "3",
                                            "--pipeline-balance", "auto", **shape))
    assert plain.schedule.memory_budget == 2.0 and balanced.balance and balanced.schedule.placement.kind == "v"
