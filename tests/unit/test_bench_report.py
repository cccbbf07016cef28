"""scripts/bench/report.py on logs a SLURM grid leaves: a run submitted again into the same folder appends
to its log (submit_grid.py, sbatch --open-mode=append), and only its last attempt may count."""
import json

from bench_scripts import load_bench

report = load_bench("report")

RUN = {"config_name": "tiny-cpu", "schedule": "v-half", "num_microbatches": 8, "pp": 4, "tp": 1, "dp": 1}
SUMMARY = {"status": "ok", "schedule": "v-half", "pp": 4, "tp": 1, "dp": 1, "world_size": 4, "num_microbatches": 8,
           "tokens_per_s": 600.0, "first_loss": 5.5, "final_loss": 4.5}


def _log(path, *attempts):
    lines = []
    for records in attempts:
        lines += [f"{marker} {json.dumps(payload)}" for marker, payload in records]
    path.write_text("\n".join(lines + ["slurmstepd: error: *** JOB 13 ON n1 CANCELLED DUE TO TIME LIMIT ***"]) + "\n")
    return path


def test_an_earlier_attempts_summary_does_not_stand_for_a_later_one(tmp_path):
    done = [("VSHAPE_RUN", RUN), ("VSHAPE_SUMMARY", SUMMARY), ("VSHAPE_EXIT", {"exit_code": 0})]
    killed = _log(tmp_path / "killed.out", done, [("VSHAPE_RUN", RUN)])  # resubmitted, then killed or pending
    (run,) = report.collect([str(killed)])
    assert run.status == "FAILED" and "no VSHAPE_SUMMARY" in run.reason and run.tokens_per_s is None
    again = _log(tmp_path / "again.out", [("VSHAPE_RUN", RUN), ("VSHAPE_EXIT", {"exit_code": 1})], done)
    (run,) = report.collect([str(again)])  # failed first, then completed: the completed attempt counts
    assert run.status == "ok" and run.tokens_per_s == 600.0 and run.exit_code == 0


def test_the_planner_prediction_is_for_the_schedule_as_trained(tmp_path):
    """A v-auto run under --pipeline-memory-budget 0.5: the prediction simulates v-auto planned under 0.5, as
    the driver built it (its summary's schedule_options), not under the generator's default 1.0."""
    from megatron_vshape.schedule import registry
    from megatron_vshape.schedule.ops import Costs
    from megatron_vshape.schedule.simulate import simulate

    costs = {"F": 2.0, "B": 2.2, "W": 1.6, "C": 0.05}
    summary = dict(SUMMARY, schedule="v-auto", schedule_options={"memory_budget": 0.5}, measured_costs=costs)
    log = _log(tmp_path / "v-auto.out", [("VSHAPE_RUN", dict(RUN, schedule="v-auto")), ("VSHAPE_SUMMARY", summary),
                                         ("VSHAPE_EXIT", {"exit_code": 0})])
    (run,) = report.collect([str(log)])
    c = Costs(**costs)
    base = simulate(registry.build("1f1b", 4, 8, c)).makespan
    planned = {b: simulate(registry.build("v-auto", 4, 8, c, memory_budget=b)).makespan for b in (0.5, 1.0)}
    assert planned[0.5] != planned[1.0]
    assert report.predicted_speedup(run)[0] == base / planned[0.5]
