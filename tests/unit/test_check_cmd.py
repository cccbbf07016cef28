"""`megatron-vshape check FILE.json` and `--pipeline-schedule-file FILE.json` read an export through
the same verifier: a valid (even hand-reordered) export passes with its recomputed figures, a
broken edit is refused with the problems listed (exit 2), and training refuses a file made for
other sizes before any process group exists."""
import json

import pytest

from megatron_vshape import cli
from megatron_vshape.integration import train
from megatron_vshape.schedule import registry
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.export import to_dict


def _export(tmp_path, edit=None, name="v-half", pp=2, m=4):
    data = to_dict(registry.build(name, pp, m))
    if edit:
        edit(data)
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(data))
    return str(path)


def _swap(data):
    ops = data["ranks"][0]
    i, j = [k for k, op in enumerate(ops) if op["op"] == "F" and op["stage"] == 0][:2]
    ops[i], ops[j] = ops[j], ops[i]


def test_check_prints_the_figures_of_a_valid_export(tmp_path, capsys):
    assert cli.main(["check", _export(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "valid: v-half, pp=2, 4 microbatches" in out and "makespan          12.5" in out and "note" not in out


def test_check_notes_a_reordered_export_and_its_stale_figures(tmp_path, capsys):
    assert cli.main(["check", _export(tmp_path, _swap), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] and out["forwards_out_of_order"] == ["rank 0: F0@0 runs after F1@0"]
    assert out["makespan"] == 13.0 and any(s.startswith("makespan recorded 12.5") for s in out["stale_figures"])


def test_check_refuses_a_broken_edit_listing_the_problems(tmp_path, capsys):
    def drop_first_op_of_rank_1(data):
        data["ranks"][1] = data["ranks"][1][1:]

    path = _export(tmp_path, drop_first_op_of_rank_1)
    assert cli.main(["check", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-vshape check: error: {path}: schedule 'v-half'") and "appears 0 times" in err


def test_training_reads_the_file_through_the_verifier_and_checks_its_sizes(tmp_path):
    base = ["--mock-data", "--vocab-size", "63", "--num-layers", "4", "--pipeline-model-parallel-size", "2"]
    args = train.parse_args(base + ["--global-batch-size", "4", "--pipeline-schedule-file", _export(tmp_path, _swap)])
    plan = train.validate(args, world_size=2)
    assert plan.name == "v-half" and plan.as_built and plan.source and plan.schedule.ranks[0][0].microbatch == 1
    with pytest.raises(ConfigError, match="holds v-half for pp=2 and 4 microbatches; this run has pp=2 and 8"):
        train.validate(train.parse_args(base + ["--global-batch-size", "8", "--pipeline-schedule-file",
                                                _export(tmp_path)]), world_size=2)
    with pytest.raises(ConfigError, match="pass one"):
        train.validate(train.parse_args(base + ["--pipeline-schedule", "1f1b", "--pipeline-schedule-file",
                                                _export(tmp_path)]), world_size=2)
