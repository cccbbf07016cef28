"""scripts/bench/report.py: logs in the driver's VSHAPE_* format become rows; failed runs are shown
as FAILED, never dropped; speed-ups compare runs of the same sizes; the planner's prediction is the
simulator under the run's measured costs."""
import csv
import json
from pathlib import Path

import pytest
from bench_scripts import load_bench

from megatron_vshape.schedule import registry
from megatron_vshape.schedule.ops import Costs
from megatron_vshape.schedule.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]
report = load_bench("report", "vshape_report")

COSTS = {"F": 1.0, "B": 1.1, "W": 0.8, "C": 0.05}


def summary(schedule, tokens_per_s, act, **over):
    s = {"status": "ok", "schedule": schedule, "pp": 4, "tp": 1, "dp": 1, "world_size": 4, "num_layers": 8,
         "hidden_size": 64, "seq_length": 32, "micro_batch_size": 1, "global_batch_size": 8,
         "num_microbatches": 8, "train_iters": 10, "first_loss": 6.9, "final_loss": 6.1,
         "median_iter_time_s": 0.5, "tokens_per_s": tokens_per_s, "tflops_per_gpu": None,
         "peak_activation_bytes": [act, act / 2, act / 2, act / 4], "peak_allocated_bytes": [None] * 4,
         "measured_costs": COSTS, "measured_bubble_rate": 0.2, "config_name": "tiny-cpu"}
    s.update(over)
    return s


def write(path: Path, *lines) -> Path:
    path.write_text("some human line\n" + "\n".join(lines) + "\n")
    return path


def metrics(i, loss):
    return "VSHAPE_METRICS " + json.dumps({"iteration": i, "loss": loss})


@pytest.fixture
def sweep(tmp_path):
    write(tmp_path / "1f1b.log", metrics(1, 6.9), "VSHAPE_SUMMARY " + json.dumps(summary("1f1b", 1000.0, 4 * 2**20)),
          'VSHAPE_EXIT {"exit_code": 0}')
    # A launcher prefix before the marker (torchrun --tee, srun --label) still parses.
    write(tmp_path / "v-half.log", "[default0]:VSHAPE_SUMMARY " + json.dumps(summary("v-half", 1100.0, 2.5 * 2**20)))
    # Died mid-run: iterations but no summary.
    write(tmp_path / "v-zb.log", 'VSHAPE_RUN {"schedule": "v-zb", "config_name": "tiny-cpu", "pp": 4, "tp": 1, '
          '"dp": 1, "num_microbatches": 8, "micro_batch_size": 1, "seq_length": 32}', metrics(1, 6.9),
          'VSHAPE_SUMMARY {"status": "ok", "sched', 'VSHAPE_EXIT {"exit_code": 143}')
    # A summary, but the launcher recorded a non-zero exit (a rank died at teardown).
    write(tmp_path / "v-min.log", "VSHAPE_SUMMARY " + json.dumps(summary("v-min", 900.0, 1.5 * 2**20)),
          'VSHAPE_EXIT {"exit_code": 1}')
    return tmp_path


def test_rows_speedups_and_failures(sweep):
    runs = {r.schedule: r for r in report.collect([str(sweep)])}
    assert set(runs) == {"1f1b", "v-half", "v-zb", "v-min"}
    assert runs["1f1b"].ok and runs["v-half"].ok
    assert runs["v-half"].speedup == pytest.approx(1.1)
    assert runs["v-half"].activation_vs_1f1b == pytest.approx(2.5 / 4)
    assert runs["1f1b"].speedup == pytest.approx(1.0)
    assert not runs["v-zb"].ok and runs["v-zb"].reason.startswith("exit 143; no VSHAPE_SUMMARY") and runs["v-zb"].exit_code == 143
    assert runs["v-zb"].model == "tiny-cpu" and runs["v-zb"].num_microbatches == 8  # from VSHAPE_RUN
    assert not runs["v-min"].ok and runs["v-min"].reason == "exit 1" and runs["v-min"].speedup is None


def test_prediction_is_the_simulator_under_the_measured_costs(sweep):
    runs = {r.schedule: r for r in report.collect([str(sweep)])}
    costs = Costs(**COSTS)
    expect = simulate(registry.build("1f1b", 4, 8, costs)).makespan / simulate(registry.build("v-half", 4, 8, costs)).makespan
    assert runs["v-half"].predicted_speedup == pytest.approx(expect)
    assert runs["1f1b"].predicted_speedup == pytest.approx(1.0)


def test_runs_of_other_sizes_do_not_compare(tmp_path):
    write(tmp_path / "a.log", "VSHAPE_SUMMARY " + json.dumps(summary("1f1b", 1000.0, 100)))
    write(tmp_path / "b.log", "VSHAPE_SUMMARY " + json.dumps(summary("v-half", 1500.0, 100, num_microbatches=16,
                                                                      global_batch_size=16)))
    runs = {r.schedule: r for r in report.collect([str(tmp_path)])}
    assert runs["v-half"].speedup is None  # no 1F1B run with 16 microbatches


def test_table_csv_plot_and_strict_exit(sweep, tmp_path, capsys):
    out = tmp_path / "out"
    rc = report.main([str(sweep), "--csv", str(out / "r.csv"), "--plot", str(out / "r.png"), "--strict"])
    text = capsys.readouterr().out
    assert rc == 1  # two runs failed
    assert "FAILED (exit 143)" in text and "FAILED (exit 1)" in text
    assert text.count("FAILED:") == 2
    rows = list(csv.DictReader(open(out / "r.csv")))
    assert sorted(r["status"] for r in rows) == ["FAILED", "FAILED", "ok", "ok"]
    assert (out / "r.png").stat().st_size > 1000
    assert report.main([str(sweep / "1f1b.log"), str(sweep / "v-half.log"), "--strict"]) == 0


def test_paper_configs_show_the_papers_figure(tmp_path):
    write(tmp_path / "a.log", "VSHAPE_SUMMARY " + json.dumps(summary("v-zb", 1000.0, 100, config_name="paper-9.6b")))
    (run,) = report.collect([str(tmp_path)])
    assert "abstract" in run.paper  # no per-run figure read for 9.6B: the abstract's range


def _paper_run(path, schedule, tokens_per_s, **over):
    """A run of a paper config as submit_grid.py names it: VSHAPE_RUN (the submit script), then the summary."""
    planned = {k: over[k] for k in ("config_name", "pp", "num_microbatches", "seq_length")}
    s = summary(schedule, tokens_per_s, 100, tflops_per_gpu=150.0, **over)
    write(path, "VSHAPE_RUN " + json.dumps({"schedule": schedule, **planned}), "VSHAPE_SUMMARY " + json.dumps(s),
          'VSHAPE_EXIT {"exit_code": 0}')


def test_paper_figure_with_its_table_beside_the_measured_speedup(tmp_path, capsys):
    # paper-38.5b at m = 16 x pp = 512 (submit_grid --microbatches-per-pp 16): Table 4's column.  The
    # runs hold no measured costs: the simulated figure (test_prediction_is_the_simulator_under_the_
    # measured_costs) would plan V-ZB at pp=32, m=512 for a column this test does not read.
    size = dict(config_name="paper-38.5b", pp=32, num_layers=64, hidden_size=7168, seq_length=1024,
                num_microbatches=512, micro_batch_size=1, global_batch_size=512, world_size=32,
                measured_costs=None)
    _paper_run(tmp_path / "paper-38.5b__1f1b__m512.out", "1f1b", 1000.0, **size)
    _paper_run(tmp_path / "paper-38.5b__v-zb__m512.out", "v-zb", 1200.0, **size)
    _paper_run(tmp_path / "paper-38.5b__v-min__m64.out", "v-min", 900.0, **{**size, "num_microbatches": 64})
    assert report.main([str(tmp_path)]) == 0
    rows = {line.split()[3] + line.split()[2]: line for line in capsys.readouterr().out.splitlines()
            if line.startswith("paper-38.5b")}
    assert "1.200" in rows["v-zb512"] and "1.13x (MFU 53.2% vs 47.1%, Table 4)" in rows["v-zb512"]
    assert "1.00x (MFU 47.1%, Table 4)" in rows["1f1b512"]
    assert "abstract" in rows["v-min64"]  # Table 4's other columns were not read


def test_paper_figure_lookup_by_sequence_length():
    run = report.Run(log="x", config_name="paper-98.5b", schedule="v-half", seq_length=3072, num_microbatches=80)
    assert report.paper_figure(run) == "1.05x (MFU 60.34% vs 57.25%, Table 3)"
    run.seq_length = 1024
    assert report.paper_figure(run) == "1.06x (MFU 52.6% vs 49.81%, Table 3)"
    run.seq_length = 2048  # no such setting in Table 3, and the abstract's range is for pure pipelines
    assert report.paper_figure(run) == ""
    assert report.paper_figure(report.Run(log="x", config_name="tiny-cpu", schedule="v-zb")) == ""


def test_paper_figures_match_the_grids_runs():
    """Every figure's key is a run the SLURM grid can produce from configs/paper/*.yaml: the config's
    file stem (submit_grid.py's and the driver's config_name), a registered schedule, its m reachable
    as --microbatches-per-pp x pp, its sequence length the file's or Table 3's other (3072, SOURCES.md)."""
    yaml = pytest.importorskip("yaml")
    configs = {p.stem: yaml.safe_load(p.read_text()) for p in (ROOT / "configs" / "paper").glob("*.yaml")}
    assert report.PAPER_FIGURES
    for config, schedule, seq, m in report.PAPER_FIGURES:
        assert config in configs and schedule in registry.names()
        pp = configs[config]["pipeline-model-parallel-size"]
        assert m is None or m % pp == 0
        assert seq is None or seq == configs[config]["seq-length"] or seq == 3072
    for name in report.PURE_PP_CONFIGS:
        assert name in configs


def test_no_logs_is_an_error(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "no such log" in capsys.readouterr().err
