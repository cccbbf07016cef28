"""The `megatron-vshape` console script, run as a user runs it."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_vshape.schedule import export, registry
from megatron_vshape.schedule.ops import Costs

EXE = shutil.which("megatron-vshape", path=os.path.dirname(sys.executable)) or shutil.which("megatron-vshape")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


def run(*args):
    # The console script as installed, but importing this checkout's package (first on the
    # path): an editable install may point at another checkout.
    assert EXE, "megatron-vshape is not installed (pip install -e .)"
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120, env=ENV)


def test_the_script_runs_this_checkouts_package():
    shebang = open(EXE).readline()[2:].strip()
    out = subprocess.run([shebang, "-c", "import megatron_vshape; print(megatron_vshape.__file__)"],
                         capture_output=True, text=True, timeout=60, env=ENV)
    assert out.stdout.strip().startswith(os.path.join(ROOT, "megatron_vshape")), out


def test_plan_prints_the_figures_and_writes_files(tmp_path):
    pic, exp = tmp_path / "out" / "zb.svg", tmp_path / "out" / "zb.json"
    r = run("plan", "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8", "--export", str(exp), "--picture", str(pic))
    assert r.returncode == 0, r.stderr
    for word in ("bubble rate       11.11%", "span bubble rate", "makespan          27", "peak activations  4 4 4 4",
                 "peak vs 1F1B      1 1 1 1", "(p-1)/(3m+p-1) = 11.11%"):
        assert word in r.stdout
    assert pic.stat().st_size > 0
    assert export.load_json(str(exp)).ranks == registry.build("zb-h1", 4, 8).ranks


def test_plan_json_and_options():
    r = run("plan", "--schedule", "1f1b-interleaved", "--pp", "4", "--microbatches", "8", "--chunks", "3",
            "--costs", "2,2.2,1.6,0.05", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["placement"] == "loop" and out["chunks"] == 3
    assert out["costs"] == {"F": 2 / 3, "B": 2.2 / 3, "W": 1.6 / 3, "C": 0.05}
    assert len(out["peak_vs_1f1b"]) == 4 and 0 < out["bubble_rate"] < 1 and "ranks" not in out


def test_plan_prints_the_lower_bound_of_a_v_shape_plan():
    # V-ZB at pp=4, m=8, costs 1,1,1,0 has no bubble but rank 3's wait for its first F: it
    # reaches the bound (3 * 0.5 + 8 * 3); a tight budget leaves its plan above it.  Only the V
    # plans have one.
    r = run("plan", "--schedule", "v-zb", "--pp", "4", "--microbatches", "8")
    assert r.returncode == 0, r.stderr
    assert "lower bound       25.5  (no order of these ops is shorter, whatever the memory: reached, so the plan is optimal)" in r.stdout
    assert "(reaches the lower bound: optimal)" in r.stdout
    r = run("plan", "--schedule", "v-min", "--pp", "4", "--microbatches", "8", "--json")
    out = json.loads(r.stdout)
    assert out["lower_bound"] == pytest.approx(25.5) and out["makespan"] > out["lower_bound"]
    assert "lower bound" not in run("plan", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8").stdout


def test_compare_has_every_schedule_and_reasons_instead_of_crashes():
    r = run("compare", "--pp", "4", "--microbatches", "6", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["schedule"]: row for row in json.loads(r.stdout)["rows"]}
    assert list(rows) == registry.names()
    assert "last group of 2 < pp=4" in rows["1f1b-interleaved"]["error"]  # Megatron cannot serve m=6
    assert rows["1f1b"]["bubble_rate"] == pytest.approx(3 / 9)
    assert rows["1f1b"]["prediction"]["bubble_rate"] == pytest.approx(3 / 9)
    text = run("compare", "--pp", "4", "--microbatches", "6")
    assert text.returncode == 0 and "cannot serve: 1f1b-interleaved" in text.stdout
    for name in registry.names():
        assert any(line.startswith(name + " ") for line in text.stdout.splitlines())


def test_compare_rows_builds_only_the_named_schedules_in_their_order():
    """The selection callers (tests) use to skip planning schedules they do not look at."""
    from megatron_vshape import cli
    from megatron_vshape.schedule.ops import Costs

    full = {row["schedule"]: row for row in cli.compare_rows(4, 6, Costs())}
    picked = cli.compare_rows(4, 6, Costs(), names=["v-half", "1f1b-interleaved", "1f1b"])
    assert [row["schedule"] for row in picked] == ["v-half", "1f1b-interleaved", "1f1b"]
    assert all(row == full[row["schedule"]] for row in picked)  # same rows as the full table's


@pytest.mark.parametrize("fmt", ["json", "torch-csv"])
def test_export(fmt, tmp_path):
    path = tmp_path / f"s.{fmt}"
    r = run("export", "--schedule", "zb-h2", "--pp", "4", "--microbatches", "8", "--format", fmt, "--output", str(path))
    assert r.returncode == 0, r.stderr
    s = registry.build("zb-h2", 4, 8)
    if fmt == "json":
        assert export.load_json(str(path)).ranks == s.ranks
    else:
        assert export.parse_torch_csv(path.read_text()) == s.ranks


def test_plan_and_export_auto_give_what_pipeline_schedule_auto_runs(tmp_path):
    """--schedule auto: the schedule choose.fastest_within picks (what --pipeline-schedule auto trains
    with), its reason printed; plan --export and export write that schedule's op lists."""
    from megatron_vshape.planner.choose import fastest_within

    sizes = ("--pp", "4", "--microbatches", "8", "--costs", "2,2.2,1.6,0.05", "--memory-budget", "0.7")
    best, why = fastest_within(4, 8, Costs(2, 2.2, 1.6, 0.05), 0.7)
    planned, exported = tmp_path / "plan.json", tmp_path / "export.json"
    r = run("plan", "--schedule", "auto", *sizes, "--json", "--export", str(planned))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["schedule"] == best.name and out["chosen"] == why
    r = run("export", "--schedule", "auto", *sizes, "--output", str(exported))
    assert r.returncode == 0 and f"chosen by auto: {why}" in r.stdout, r.stderr
    assert export.load_json(str(planned)).ranks == export.load_json(str(exported)).ranks == best.ranks


@pytest.mark.parametrize("args, message", [
    (("plan", "--schedule", "v-max", "--pp", "4", "--microbatches", "8"), "unknown schedule 'v-max'"),
    (("plan", "--schedule", "1f1b", "--pp", "1", "--microbatches", "8"), "pp >= 2"),
    (("plan", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--chunks", "2"), "chunks"),
    (("plan", "--schedule", "1f1b-interleaved", "--pp", "4", "--microbatches", "3"), "microbatches >= 4"),
    (("compare", "--pp", "4", "--microbatches", "8", "--costs", "1,2"), "expected 3 or 4 numbers"),
    (("compare", "--pp", "1", "--microbatches", "8"), "pp >= 2"),
    (("compare", "--pp", "4", "--microbatches", "0", "--json"), "microbatches >= 1"),
    (("export", "--schedule", "1f1b", "--pp", "4", "--microbatches", "0", "--output", "x.json"), "microbatches >= 1"),
    (("plan", "--schedule", "auto", "--pp", "4", "--microbatches", "8"), "give X"),
    (("plan", "--schedule", "auto", "--pp", "4", "--microbatches", "8", "--memory-budget", "0.7", "--optimal"),
     "unset --optimal"),
    (("export", "--schedule", "auto", "--pp", "4", "--microbatches", "8", "--memory-budget", "0.7", "--chunks", "2",
      "--output", "x.json"), "unset --chunks"),
    # Options that would change nothing where they are given: refused, not ignored.
    (("frontier", "--pp", "4", "--microbatches", "8", "--memory-budget", "0.7"), "frontier plans every budget"),
    (("plan", "--schedule", "v-half", "--pp", "4", "--microbatches", "8", "--vocab-size", "128256"),
     "--vocab-size 128256 replaces the vocabulary of --model's shape; give --model"),
    (("frontier", "--pp", "4", "--microbatches", "8", "--picture", "f.pdf"), "unsupported extension '.pdf'"),
])
def test_config_errors_exit_2_without_traceback(args, message):
    r = run(*args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"megatron-vshape {args[0]}: error:")


def test_unwritable_output_exits_1_without_traceback(tmp_path):
    r = run("export", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--output", str(tmp_path))  # a directory
    assert r.returncode == 1
    assert r.stderr.startswith("megatron-vshape export: error:") and "Traceback" not in r.stderr


def test_usage_errors_exit_2():
    r = run("plan", "--pp", "4")
    assert r.returncode == 2 and "--schedule" in r.stderr


def _model_file(tmp_path, vocab=32000, layers=8):
    """A small GPT shape whose output layer outweighs a layer (a vocabulary of `vocab`)."""
    path = tmp_path / f"model-{vocab}-{layers}.yaml"
    path.write_text(f"num-layers: {layers}\nhidden-size: 256\nseq-length: 128\nvocab-size: {vocab}\n")
    return str(path)


def test_v_auto_is_balanced_at_the_budget_given(tmp_path, capsys):
    # --memory-budget reached balance() twice (as the fit and as v-auto's option): a TypeError.
    from megatron_vshape import cli

    for budget in (0.75, 1.5):
        assert cli.main(["plan", "--schedule", "v-auto", "--pp", "3", "--microbatches", "6", "--model",
                         _model_file(tmp_path, vocab=4096, layers=12), "--memory-budget", str(budget), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["memory_budget"] == budget and max(out["peak_vs_1f1b"]) <= budget + 1e-9
    assert cli.main(["compare", "--pp", "2", "--microbatches", "4", "--model", _model_file(tmp_path, vocab=4096),
                     "--memory-budget", "1.5", "--json"]) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert "error" not in rows["v-auto"] and rows["v-auto"]["balanced"]["peak_vs_1f1b"] <= 1.5 + 1e-9


def test_plan_with_a_model_draws_and_prints_the_balanced_timeline(tmp_path, capsys):
    """plan --model took --picture and --text and drew nothing (it returned before plan's drawing)."""
    from megatron_vshape import cli

    svg, exported = tmp_path / "balanced.svg", tmp_path / "balanced.json"
    assert cli.main(["plan", "--schedule", "v-half", "--pp", "2", "--microbatches", "4", "--model",
                     _model_file(tmp_path, vocab=8192), "--picture", str(svg), "--text", "--export", str(exported)]) == 0
    out = capsys.readouterr().out
    assert svg.read_text().startswith("<svg") and f"wrote             {svg}" in out
    assert f"wrote             {exported}" in out and "rank 0" in out  # the text timeline, one row per rank


def test_frontier_with_a_model_prints_and_draws_even_and_balanced(tmp_path, capsys):
    from megatron_vshape import cli

    model, svg = _model_file(tmp_path, vocab=8192), tmp_path / "f.svg"
    args = ["frontier", "--pp", "2", "--microbatches", "4", "--model", model]
    assert cli.main(args + ["--json", "--picture", str(svg)]) == 0
    out = json.loads(capsys.readouterr().out)
    even, balanced = out["points"], out["balanced"]
    assert {p["schedule"] for p in even} == {p["schedule"] for p in balanced}
    assert all(p["layout"] is None for p in even) and all(sum(p["layout"]) == 8 for p in balanced)
    assert str(svg) in out["written"] and "balanced layout" in svg.read_text()
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "even split and balanced layout" in lines[0]
    assert lines[1].split()[:4] == ["schedule", "budget", "even:", "peak"] and "balanced layout" in lines[1]
    rows = {(l.split()[0], l.split()[1]): l.split() for l in lines[3:] if l.split() and l.split()[0] in
            {p["schedule"] for p in even}}
    for p in balanced:  # each balanced point is in its row: layout, time vs 1F1B, speed-up over the even split
        row = rows[(p["schedule"], "-" if p["memory_budget"] is None else f"{p['memory_budget']:.4g}")]
        e = next(q for q in even if (q["schedule"], q["memory_budget"]) == (p["schedule"], p["memory_budget"]))
        assert row[5:] == [",".join(map(str, p["layout"])), f"{p['peak_vs_1f1b']:.3g}", f"{100 * p['bubble_rate']:.2f}%",
                           f"{p['vs_1f1b']:.3f}", f"{e['makespan'] / p['makespan'] - 1:+.1%}"]


@pytest.mark.parametrize("extra, message", [
    (("--model", "no-such.yaml"), "--model no-such.yaml: No such file or directory"),
    (("--model", "configs/gpt/gpt-1.3b.yaml", "--stage-costs", "examples/stage_costs_pp4.json"), "pass one"),
    (("--model", "configs/gpt/gpt-1.3b.yaml", "--vocab-size", "0"), "--vocab-size: got 0"),
    (("--model", "README.md"), "--model README.md"),
])
def test_frontier_refuses_a_bad_model_in_one_line(extra, message):
    r = run("frontier", "--pp", "4", "--microbatches", "8", *extra)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("megatron-vshape frontier: error:")


@pytest.mark.parametrize("command", [["frontier"], ["plan", "--schedule", "v-half"], ["compare"],
                                     ["export", "--schedule", "v-zb", "--output", "x.json"]])
def test_a_model_with_fewer_layers_than_the_vs_middle_stages_is_refused_in_one_line(command, tmp_path, capsys):
    # 5 layers for the 8 stages of the V at pp=4: the even split would leave middle stages empty, which
    # frontier drew and plan/export planned.  compare still serves the schedules that can split them.
    from megatron_vshape import cli

    model = _model_file(tmp_path, vocab=8192, layers=5)
    code = cli.main(command + ["--pp", "4", "--microbatches", "8", "--model", model])
    out, err = capsys.readouterr()
    message = f"--model {model}: num-layers=5 is too few for"
    if command == ["compare"]:
        assert code == 0 and "cannot serve: " + message in out and "1f1b  " in out
        return
    assert code == 2 and err.count("\n") == 1 and message in err and "use at least 6 layers" in err, err


def test_the_end_stages_of_the_even_split_may_hold_only_the_embedding_or_the_loss(tmp_path, capsys):
    # 7 layers on the V's 8 stages: the last stage holds only the output layer and the loss, which the
    # driver trains (schedule/layout.py even_split); planned, not refused.
    from megatron_vshape import cli

    assert cli.main(["plan", "--schedule", "v-half", "--pp", "4", "--microbatches", "8", "--model",
                     _model_file(tmp_path, vocab=256, layers=7)]) == 0
    assert "even 1,1,1,1,1,1,1,0:" in capsys.readouterr().out


def test_machine_chooses_what_the_model_estimate_prices_and_is_said(tmp_path, capsys):
    from megatron_vshape import cli
    from megatron_vshape.schedule.balance import CPU, GPU, ModelShape

    model = _model_file(tmp_path, vocab=8192)
    base = ["plan", "--schedule", "v-zb", "--pp", "2", "--microbatches", "4", "--model", model]
    figures = {}
    for machine, priced, dtype in (("gpu", GPU, 2), ("cpu", CPU, 4)):
        extra = [] if machine == "gpu" else ["--machine", "cpu"]  # gpu is the default
        assert cli.main(base + extra + ["--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        shape = ModelShape(8, 256, 128, 8192, dtype_bytes=dtype, machine=priced)
        want = shape.stage_costs(out["layout"], 2)
        assert out["machine"] == machine
        assert [c[k] for c in out["stage_costs"] for k in "FBW"] == pytest.approx([getattr(c, k) for c in want
                                                                                   for k in "FBW"])
        figures[machine] = out["stage_costs"]
        assert cli.main(base + extra) == 0
        assert f"priced for {priced.about} (--machine {machine})" in capsys.readouterr().out
    assert figures["gpu"] != figures["cpu"]
    assert cli.main(["compare", "--pp", "2", "--microbatches", "4", "--model", model, "--machine", "cpu"]) == 0
    assert "priced for a CPU core per rank (--machine cpu)" in capsys.readouterr().out.splitlines()[0]
    r = run("compare", "--pp", "2", "--microbatches", "4", "--machine", "cpu")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--machine cpu prices the stage costs estimated " \
        "from --model" in r.stderr, r.stderr
