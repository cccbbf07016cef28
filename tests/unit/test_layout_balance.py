"""Layers per stage (schedule/layout.py) and the balanced layout from the model's shape
(schedule/balance.py): pure Python, no ranks."""
import pytest

from megatron_vshape.schedule import layout
from megatron_vshape.schedule.balance import ModelShape, balance
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Placement
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
    # the head's GEMM is 2hV per token against a layer's 2(4h^2 + 2h*ffn) + 4sh forward
    f_layer = 2 * (4 * 4096 ** 2 + 2 * 4096 * 11008) + 4 * 4096 * 4096
    assert costs[15].F - middle.F == pytest.approx((2 * 4096 + 10) * 128256 / (4 * f_layer), rel=1e-9)


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
