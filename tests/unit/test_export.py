"""The JSON export of docs/architecture.md round-trips; torch-csv speaks torch.distributed.pipelining's actions."""
import json

import pytest

from megatron_vshape.schedule import export, registry
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import B, BW, F, W, Costs
from megatron_vshape.schedule.simulate import simulate
from megatron_vshape.schedule.verify import InvalidSchedule, forward_only_view

DESIGN_KEYS = {"schedule", "pp", "microbatches", "placement", "costs", "ranks", "makespan", "bubble_rate",
               "span_bubble_rate", "peak_activations", "peak_vs_1f1b"}


@pytest.mark.parametrize("name", registry.names())
def test_json_has_designs_keys_and_round_trips(name, tmp_path):
    costs = Costs(2, 2.2, 1.6, 0.05)
    s = registry.build(name, 4, 8, costs)
    path = tmp_path / "s.json"
    export.write(s, str(path), "json")
    data = json.loads(path.read_text())
    assert DESIGN_KEYS <= set(data)
    assert (data["schedule"], data["pp"], data["microbatches"], data["placement"]) == (name, 4, 8, s.placement.kind)
    assert data["costs"] == s.costs.to_dict()  # per stage, as simulated
    assert data["ranks"][0][0] == {"op": s.ranks[0][0].kind, "stage": s.ranks[0][0].stage, "microbatch": s.ranks[0][0].microbatch}
    sim = simulate(s)
    assert data["makespan"] == sim.makespan and data["peak_vs_1f1b"] == sim.peak_vs_1f1b
    back = export.load_json(str(path))
    assert back.ranks == s.ranks and back.placement == s.placement and back.costs == s.costs
    assert back.meta.get("group") == s.meta.get("group")  # interleaved's group: what the papers' prediction reads


def test_the_interleaved_group_survives_an_export_and_so_does_its_prediction(tmp_path):
    from megatron_vshape.cli import prediction_of

    s = registry.build("1f1b-interleaved", 4, 12, chunks=3, group=6)
    path = tmp_path / "grouped.json"
    export.write(s, str(path), "json")
    back = export.load_json(str(path))
    assert back.meta["group"] == 6 and prediction_of(back) == prediction_of(s) != prediction_of(
        registry.build("1f1b-interleaved", 4, 12, chunks=3))


def test_loader_verifies_and_rejects_garbage(tmp_path):
    data = export.to_dict(registry.build("zb-h1", 3, 4))
    data["ranks"][1] = [d for d in data["ranks"][1] if not (d["op"] == "W" and d["microbatch"] == 2)]
    with pytest.raises(InvalidSchedule, match="microbatch 2 stage 1"):
        export.from_dict(data)
    with pytest.raises(ConfigError, match="not a schedule export"):
        export.from_dict({"schedule": "x"})
    header = {"schedule": "x", "microbatches": 1, "placement": "single", "ranks": []}
    for broken in ({**header, "pp": 0}, {**header, "pp": 2, "costs": [1, 1, 1]}):
        with pytest.raises(ConfigError, match="not a schedule export|pp=0"):
            export.from_dict(broken)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        export.load_json(str(bad))


def test_forward_only_view_round_trips_and_stays_checked():
    s = forward_only_view(registry.build("v-half", 4, 8))
    data = json.loads(export.to_json(s))
    assert data["forward_only"] is True and "forward_only" not in export.to_dict(registry.build("v-half", 4, 8))
    back = export.from_dict(data)
    assert back.ranks == s.ranks and back.meta["forward_only"]
    data["ranks"][0].append({"op": "BW", "stage": 0, "microbatch": 0})
    with pytest.raises(InvalidSchedule, match="in a forward-only schedule"):
        export.from_dict(data)


def test_loader_infers_chunks_when_absent():
    data = export.to_dict(registry.build("1f1b-interleaved", 2, 4, chunks=3))
    del data["chunks"]
    assert export.from_dict(data).placement.chunks == 3


def test_torch_letters_and_stage_indices():
    s = registry.build("zb-h1", 2, 2)
    rows = export.to_torch_rows(s)
    assert rows[0] == [f"0{x}" for x in ("F0", "F1", "I0", "W0", "I1", "W1")]
    assert rows[1][:2] == ["1F0", "1I0"]
    assert export.to_torch_rows(registry.build("1f1b", 2, 1)) == [["0F0", "0B0"], ["1F0", "1B0"]]  # torch's B is our BW


@pytest.mark.parametrize("name", registry.names())
def test_torch_csv_round_trips(name):
    s = registry.build(name, 4, 8)
    text = export.to_torch_csv(s)
    assert len(text.splitlines()) == s.pp
    assert export.parse_torch_csv(text) == s.ranks


def test_torch_parses_our_actions():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    s = registry.build("v-half", 4, 8)
    kinds = {F: schedules.FORWARD, B: schedules.BACKWARD_INPUT, W: schedules.BACKWARD_WEIGHT, BW: schedules.FULL_BACKWARD}
    for ops, row in zip(s.ranks, export.to_torch_rows(s)):
        for op, cell in zip(ops, row):
            action = schedules._Action.from_str(cell)
            assert (action.stage_index, action.computation_type, action.microbatch_index) == (op.stage, kinds[op.kind], op.microbatch)


def test_parse_rejects_communication_actions():
    with pytest.raises(ConfigError, match="compute action"):
        export.parse_torch_csv("0F0,0SEND_F0\n")


def test_unknown_format():
    with pytest.raises(ConfigError, match="json, torch-csv"):
        export.render(registry.build("1f1b", 2, 2), "yaml")
