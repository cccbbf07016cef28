"""Layers per stage (schedule/layout.py) and the balanced layout from the model's shape
(schedule/balance.py): pure Python, no ranks."""
import pytest

from megatron_vshape.schedule import layout
from megatron_vshape.schedule.balance import CPU, ModelShape, Part, PartCosts, balance, measured_parts
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Placement, StageCost
from megatron_vshape.schedule.simulate import simulate

V4 = Placement("v", 4, 2)


def test_even_puts_the_remainder_in_the_middle():
    assert layout.even(30, 8) == (3, 4, 4, 4, 4, 4, 4, 3)
    assert layout.even(8, 4) == (2, 2, 2, 2)
    assert layout.even(5, 4) == (1, 2, 1, 1)


def test_megatron_split_on_the_v_and_on_interleaving():
    # first = stage 0 and last = stage 2p-1 on the V (both rank 0)
    assert layout.megatron_split(30, V4, first=2, last=2) == (2, 4, 4, 5, 5, 4, 4, 2)
    # interleaved: the first rank's chunks share `first`, as in Megatron
    loop = layout.megatron_split(14, Placement("loop", 2, 2), first=2)
    assert (loop[0], loop[2]) == (1, 1) and sum(loop) == 14
    # the embedding and the loss count as a layer of the end stages
    assert layout.megatron_split(30, V4, embedding=True, loss=True) == (3, 4, 4, 4, 4, 4, 4, 3)
    with pytest.raises(ConfigError, match="multiple of 2"):
        layout.megatron_split(16, Placement("loop", 2, 2), first=3)
    with pytest.raises(ConfigError, match="cannot be combined"):
        layout.megatron_split(16, V4, first=1, loss=True)


def test_parse_both_syntaxes_and_megatron_round_trip():
    assert layout.parse("3,4, 4,3") == (3, 4, 4, 3)
    assert layout.parse("Et*3|t*4|t*4|t*3L") == (3, 4, 4, 3)
    assert layout.parse("E|(t*2|)*2tL") == (0, 2, 2, 1)
    assert layout.parse(layout.to_megatron((0, 2, 5, 1))) == (0, 2, 5, 1)
    for bad, words in (("1,x", "'x' is not a layer count"), ("t|tL", "the embedding E must open"),
                       ("Et|m|tL", "unknown layer character(s) m")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            layout.parse(bad)


@pytest.mark.parametrize("bad, words", [
    ((3, 4, 4), "gives 3 stages; --pipeline-schedule v-half at pp=4 has 8 (2 per rank, along the V)"),
    ((3, 4, 4, 4, 4, 4, 4, 2), "sums to 29 layers but --num-layers=30"),
    ((3, 4, -1, 4, 4, 4, 4, 8), "stage 2 has -1 layers; give counts >= 0"),
    ((3, 4, 0, 4, 4, 4, 4, 7), "stage 2 has no layers and neither the embedding nor the loss"),
])
def test_check_names_the_value_and_the_fix(bad, words):
    with pytest.raises(ConfigError) as e:
        layout.check(bad, 30, V4, "v-half")
    assert words in str(e.value) and str(e.value).count("\n") == 0


def test_estimate_counts_the_head_and_the_embedding_on_the_end_stages():
    shape = ModelShape(num_layers=32, hidden_size=4096, seq_length=4096, vocab_size=128256, ffn_hidden_size=11008)
    costs = shape.stage_costs(layout.even(32, 16), 8)
    middle = costs[5]
    assert costs[1] == middle  # plain stages alike
    assert costs[15].F > 2 * middle.F and costs[15].W > 2 * middle.W and costs[15].size > 2  # 128k-vocab head
    assert middle.size == pytest.approx(1.0) and middle.F == pytest.approx(0.5)  # half a rank's share on the V
    # GPU, bf16: the head's F is its GEMM (2hV FLOPs per token) and the loss's passes over fp32 logits
    # (8 of 4V bytes, and the cast from bf16: 6V); a layer's F its GEMMs and attention and its activation
    # (17h elements of 2 bytes) written and read; a rank's share is 4 layers (32 layers, pp=8).
    h, V, T = 4096, 128256, 4096
    f_layer = (2 * (4 * h * h + 2 * h * 11008) + 4 * T * h) * T / 989e12 + 2 * 17 * h * 2 * T / 3.35e12
    f_head = 2 * h * V * T / 989e12 + (8 * 4 * V + 6 * V) * T / 3.35e12
    assert costs[15].F - middle.F == pytest.approx(f_head / (4 * f_layer), rel=1e-9)


def test_the_estimate_prices_the_machine_the_run_is_on():
    """FLOPs alone over-price the output layer on small CPU runs (a layer's operators and memory
    traffic cost as much as its GEMMs there) and under-price it on GPUs (the fp32 loss over a large
    vocabulary streams about as long as its GEMM)."""
    flops_ratio = lambda s: (2 * s.hidden_size * s.vocab_size) / (  # noqa: E731
        2 * (4 * s.hidden_size ** 2 + 2 * s.hidden_size * s.ffn) + 4 * s.seq_length * s.hidden_size)
    cpu = ModelShape(8, 256, 128, 32000, dtype_bytes=4, machine=CPU)
    gpu = ModelShape(32, 4096, 4096, 128256, ffn_hidden_size=11008)
    for shape, cheaper in ((cpu, True), (gpu, False)):
        layer, head = shape.layer(), shape.head()
        ratio = sum(head[:3]) / sum(layer[:3])
        assert (ratio < flops_ratio(shape)) == cheaper, (shape.machine.name, ratio, flops_ratio(shape))
    # The embedding's dense gradient is autograd's (B), not a deferred weight gradient (W).
    assert cpu.embedding()[1] > cpu.embedding()[2] == 0.0


def test_balance_moves_layers_off_rank_0_for_a_large_vocabulary_and_not_for_a_small_one():
    big = ModelShape(num_layers=16, hidden_size=1024, seq_length=1024, vocab_size=128000)
    result = balance(big, "v-half", 4, 16)
    assert sum(result.layout) == 16 and result.even_layout == (2,) * 8
    rank0 = result.layout[0] + result.layout[-1]
    assert rank0 < 4 and result.sim.makespan < result.even_sim.makespan * 0.99, result.summary()
    assert simulate(result.schedule).makespan == pytest.approx(result.sim.makespan)
    assert "even 2,2,2,2,2,2,2,2" in result.summary() and "balanced" in result.summary()
    small = ModelShape(num_layers=16, hidden_size=4096, seq_length=2048, vocab_size=1024)
    assert balance(small, "v-half", 4, 16).layout == (2,) * 8


@pytest.mark.parametrize("name, budget", [("v-auto", 1.25), ("v-auto", 1.5), ("v-auto", 2.0), ("v-zb", None),
                                          ("v-half", None), ("1f1b", None)])
def test_a_changed_layout_is_min_gain_faster_than_the_even_split_planned_for_the_same_costs(name, budget):
    # At a 1k vocabulary the head is worth about a layer: some layouts simulate a little faster than the
    # even split in the order an even run uses, but not than the even split planned for its costs (v-auto
    # at budget 1.5 chose 1,3,2,2 for 0.1% there).  No layout may be reported for less than MIN_GAIN.
    from megatron_vshape.schedule import registry
    from megatron_vshape.schedule.balance import MIN_GAIN

    shape = ModelShape(8, 256, 128, 1024)
    result = balance(shape, name, 2, 4, memory_budget=budget)
    options = {"memory_budget": budget} if budget is not None else {}
    planned = registry.build(name, 2, 4, stage_costs=shape.stage_costs(result.even_layout, 2), **options)
    even = simulate(planned).makespan
    assert result.sim.makespan <= even + 1e-9  # never slower than the even split's own plan
    if result.layout != result.even_layout:
        assert result.sim.makespan <= even * (1 - MIN_GAIN) + 1e-12, result.summary()
        assert result.sim.makespan <= result.even_sim.makespan * (1 - MIN_GAIN) + 1e-12  # under what it prints
    else:
        assert "the same layout" in result.summary().splitlines()[1]


def test_balance_respects_the_memory_budget_and_says_when_nothing_fits():
    big = ModelShape(num_layers=16, hidden_size=1024, seq_length=1024, vocab_size=128000)
    free = balance(big, "1f1b", 4, 16)
    capped = balance(big, "1f1b", 4, 16, memory_budget=1.0)
    assert max(capped.sim.peak_vs_1f1b) <= 1.0 + 1e-9
    assert capped.sim.makespan >= free.sim.makespan - 1e-9
    with pytest.raises(ConfigError, match=r"no layout of 16 layers fits --pipeline-memory-budget 0.1 .* raise"):
        balance(big, "1f1b", 4, 16, memory_budget=0.1)


def test_cli_compare_and_plan_take_the_model_shape(capsys, tmp_path):
    import json

    from megatron_vshape.cli import main

    assert main(["compare", "--pp", "4", "--microbatches", "8", "--model", "configs/gpt/gpt-1.3b.yaml",
                 "--vocab-size", "128256", "--json"]) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert {"1f1b", "v-half", "v-zb", "v-min"} <= set(rows) and "v-auto" not in rows  # v-auto only with a budget
    for r in rows.values():
        assert sum(r["layout"]) == 24 and r["balanced"]["makespan"] <= r["even"]["makespan"] + 1e-9
    assert rows["v-zb"]["layout"] != rows["v-zb"]["even_layout"]  # a 128k vocabulary: rank 0 sheds layers
    assert main(["plan", "--schedule", "v-half", "--pp", "4", "--microbatches", "8", "--model",
                 "configs/gpt/gpt-1.3b.yaml"]) == 0
    out = capsys.readouterr().out
    assert "even 3,3,3,3,3,3,3,3" in out and "balanced" in out
    bad = tmp_path / "m.yaml"
    bad.write_text("num-layers: 8\nhidden-size: 64\n")
    assert main(["compare", "--pp", "2", "--microbatches", "4", "--model", str(bad)]) == 2
    assert "has no seq-length, vocab-size" in capsys.readouterr().err


def _stages(parts, layout):
    """Per-stage costs a run would measure under `layout` if each part cost what `parts` says."""
    last = len(layout) - 1
    return [StageCost(*(n * getattr(parts.layer, k) + (s == 0) * getattr(parts.embedding, k)
                        + (s == last) * getattr(parts.head, k) for k in ("F", "B", "W", "size")))
            for s, n in enumerate(layout)]


def test_measured_stage_costs_split_into_the_parts_that_made_them():
    truth = PartCosts(8, Part(1.0, 1.1, 0.9, 1.0), Part(0.1, 0.0, 0.3, 0.0), Part(5.0, 4.0, 4.5, 2.0))
    for lay in ((2, 2, 2, 2), (1, 3, 2, 2), (0, 4, 3, 1)):  # the V at pp=2: middle stages give the layer
        got = measured_parts(_stages(truth, lay), lay, ModelShape(8, 64, 64, 1000).parts())
        for part in ("layer", "embedding", "head"):
            assert list(vars(getattr(got, part)).values()) == pytest.approx(list(vars(getattr(truth, part)).values()))
    # One chunk per rank at pp=2: no middle stage; the layer is solved with the prior's ratio of the
    # embedding to a layer (here the truth's own), then the head is what the last stage holds beyond.
    prior = PartCosts(8, Part(2.0, 2.2, 1.8, 2.0), Part(0.2, 0.0, 0.6, 0.0), Part(1.0, 1.0, 1.0, 1.0))
    got = measured_parts(_stages(truth, (5, 3)), (5, 3), prior)
    assert [got.layer.F, got.head.F, got.head.W] == pytest.approx([1.0, 5.0, 4.5])
    with pytest.raises(ConfigError, match="measured costs of 3 stages for a layout of 4"):
        measured_parts(_stages(truth, (2, 2, 4)), (2, 2, 2, 2), prior)


def test_measured_costs_feed_the_same_search_and_keep_the_incumbent_without_a_real_gain():
    heavy = PartCosts(8, Part(1.0, 1.0, 1.0, 1.0), Part(0.0, 0.0, 0.0, 0.0), Part(6.0, 5.0, 5.0, 1.0))
    moved = balance(heavy, "v-half", 2, 8, incumbent=(2, 2, 2, 2))
    assert moved.even_layout == (2, 2, 2, 2) and moved.layout != (2, 2, 2, 2)
    assert moved.layout[0] + moved.layout[-1] < 4 and moved.sim.makespan < moved.even_sim.makespan
    assert "current 2,2,2,2" in moved.summary(("current", "re-balanced"))
    # Measured costs that the incumbent already suits: it stays.
    assert balance(heavy, "v-half", 2, 8, incumbent=moved.layout).layout == moved.layout
    light = PartCosts(8, Part(1.0, 1.0, 1.0, 1.0), Part(0.0, 0.0, 0.0, 0.0), Part(0.01, 0.01, 0.01, 0.0))
    assert balance(light, "v-half", 2, 8, incumbent=(2, 2, 2, 2)).layout == (2, 2, 2, 2)


@pytest.mark.parametrize("argv, message", [
    (["--pipeline-replan-after", "2"], "--pipeline-replan-after=2 with --pipeline-balance auto re-balances the layout "
                                       "at a checkpoint"),
    (["--pipeline-replan-after", "4", "--save", "SAVE"], "--pipeline-replan-after=4 is not below --train-iters=4"),
    (["--pipeline-replan-after", "2", "--save", "SAVE", "--pipeline-layout", "1,3,3,1"],
     "--pipeline-balance auto chooses every stage's layers; unset --pipeline-layout"),
])
def test_rebalancing_refuses_what_it_cannot_do_before_any_group(argv, message, tmp_path, capsys, monkeypatch):
    from megatron_vshape.integration import train

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: main() exits before any group exists

    argv = [str(tmp_path / "ckpt") if a == "SAVE" else a for a in argv]
    base = ["--mock-data", "--vocab-size", "63", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "4", "--train-iters", "4", "--pipeline-schedule", "v-half",
            "--pipeline-balance", "auto"]
    with pytest.raises(ConfigError) as e:
        train.validate(train.parse_args(base + argv), world_size=2)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert train.main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_replan_after_needs_a_pipeline():
    from megatron_vshape.integration import train

    args = train.parse_args(["--mock-data", "--vocab-size", "63", "--pipeline-replan-after", "1"])
    with pytest.raises(ConfigError, match=r"--pipeline-replan-after=1 re-plans a pipeline schedule; it needs "
                                          r"--pipeline-model-parallel-size >= 2 \(got 1\)"):
        train.validate(args, world_size=1)


def test_a_run_resumed_past_the_rebalance_says_so_and_names_the_layout_that_keeps_going():
    from types import SimpleNamespace

    from megatron_vshape.integration.rebalance import resumed_past

    args = SimpleNamespace(pipeline_replan_after=2)
    plan = SimpleNamespace(balance="auto's report", stage_layers=(1, 3, 3, 1),
                           schedule=SimpleNamespace(placement=Placement("v", 2, 2)))
    assert resumed_past(args, plan, 1, None) is None  # before N: the re-balance still happens
    assert resumed_past(SimpleNamespace(pipeline_replan_after=None), plan, 5, None) is None
    moved = resumed_past(args, plan, 2, [2, 2, 3, 1])
    assert moved == ("  --pipeline-replan-after=2: resumed at iteration 2, so the re-balance at iteration 2 is past and "
                     "not redone: layout in use 1,3,3,1 (layers per rank 2, 6), the estimate's; the checkpoint's run "
                     "went on with 2,2,3,1: to keep it, resume with --pipeline-layout 2,2,3,1 instead of "
                     "--pipeline-balance auto")
    assert resumed_past(args, plan, 4, [1, 3, 3, 1]).endswith("layout in use 1,3,3,1 (layers per rank 2, 6) "
                                                              "(the checkpoint's)")
    assert resumed_past(args, plan, 4, None).endswith("(layers per rank 2, 6)")  # a checkpoint that did not record it
    order_only = SimpleNamespace(balance=None, stage_layers=(2, 2, 2, 2), schedule=plan.schedule)
    assert "re-plan at iteration 2 is past and not redone" in resumed_past(args, order_only, 3, None)
