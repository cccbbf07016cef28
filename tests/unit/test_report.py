"""scripts/bench/report.py: logs in the driver's VSHAPE_* format become rows; failed runs are shown
as FAILED, never dropped; speed-ups compare runs of the same sizes; the planner's prediction is the
simulator under the run's measured costs."""
import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megatron_vshape.schedule import registry
from megatron_vshape.schedule.ops import Costs
from megatron_vshape.schedule.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("vshape_report", ROOT / "scripts" / "bench" / "report.py")
report = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = report  # dataclasses look their module up
_spec.loader.exec_module(report)

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
    assert "abstract" in run.paper


def test_no_logs_is_an_error(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "no such log" in capsys.readouterr().err
