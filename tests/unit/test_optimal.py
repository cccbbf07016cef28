"""The exact reference (planner/optimal.py, OR-Tools CP-SAT) on small instances: its schedule
verifies and re-simulates to the makespan it claims, it is never worse than a generator, the
planner's schedules are within 2% of it, and the CLI reports and exports it."""
import functools
import json
import subprocess
import sys

import pytest

from megatron_vshape.planner import optimal, search

from megatron_vshape.schedule import export, registry
from megatron_vshape.schedule.ops import Costs, StageCost
from megatron_vshape.schedule.simulate import simulate

try:
    import ortools.sat.python.cp_model  # noqa: F401
    HAVE_ORTOOLS = True
except ImportError:
    HAVE_ORTOOLS = False

needs_ortools = pytest.mark.skipif(not HAVE_ORTOOLS, reason="OR-Tools is not installed: pip install '.[optimal]' "
                                                            "(requirements-cpu.txt pins ortools==9.15.6755)")
TIME_LIMIT = 600.0  # wall-clock guard only: every solve here stops at its deterministic WORK first
WORK = 1.5  # CP-SAT's deterministic time per solve (its own count of work, the same on any machine), one worker

# Small instances (pp 2..4, m <= 10): V schedules under their own budgets, the single placement
# with a B/W split, and a combined backward; each with its proven optimum.  A test cannot wait
# for the hard ones to be proven (up to minutes on a loaded machine), so the optima are stored:
# `python tests/unit/test_optimal.py` proves every one again (CP-SAT, all workers, up to 900 s
# each) and prints any that differs; each also is `megatron-vshape plan --schedule NAME --pp P
# --microbatches M --costs C [--memory-budget B] --optimal --time-limit 900`.  Those marked
# quick are proven within half of WORK on one worker, which the tests check.
INSTANCES = [
    ("v-half", 2, 4, "2,2.2,1.6,0.05"),
    ("v-min", 3, 3, "2,2.2,1.6,0.05"),
    ("v-min", 4, 4, "2,2.2,1.6,0.05"),
    ("v-zb", 4, 4, "2,2,2,0.25"),
    ("v-zb", 2, 6, "2,2,2,0.25"),
    ("v-half", 4, 4, "1,1,1,0"),
    # v-auto across its budgets (fractions of 1F1B's activation memory) at pp=4, m=4
    *[("v-auto", 4, 4, "2,2.2,1.6,0.05", budget) for budget in (0.5, 0.625, 0.75, 0.875, 1.0)],
    # between V-Min's and V-Half's caps with more microbatches, where only relax() gets close
    # (the last two 2.35% and 3.32% above the optimum before its chain moves)
    ("v-auto", 4, 5, "2,2.2,1.6,0.05", 0.625),
    ("v-auto", 4, 5, "2,2,2,0.25", 0.625),
    ("v-auto", 4, 7, "2,2.2,1.6,0.05", 0.625),
    # between V-Half's and V-ZB's caps with m > p, where only delay_search() gets close (3.35%,
    # 2.25% and 2.06% above the optimum without it)
    ("v-auto", 3, 5, "2,2.2,1.6,0.05", 5 / 6),
    ("v-auto", 3, 7, "2,2.2,1.6,0.05", 5 / 6),
    ("v-auto", 4, 5, "2,2.2,1.6,0.05", 0.875),
    # there with a hop latency, where justify_search's kicked restarts get within 2% (2.44% and
    # 1.89% above the optimum without them); the first delay_search() reaches (test_search.py)
    ("v-auto", 3, 5, "2,2,2,0.25", 5 / 6),
    ("v-auto", 3, 6, "2,2,2,0.25", 5 / 6),
    ("v-auto", 3, 8, "2,2,2,0.25", 5 / 6),
    # beyond m = 8: the largest gap at pp 2 and 3 with m = 9, 10, 12 (1.62%; 36 instances, all
    # proven, docs/planner.md "Against the exact reference")
    ("v-auto", 3, 10, "2,2.2,1.6,0.05", 5 / 6),
    # other cost sets than the benchmark grid's three, where the planner was furthest off until
    # relax() ran at the named caps and above V-ZB's (the first two 1.98% and 2.25% before)
    ("v-auto", 3, 6, "3,2,2,1", 7 / 6),
    ("v-auto", 4, 6, "1,1.5,0.5,0.25", 1.25),
    ("v-auto", 3, 8, "1,2,1,0.1", 5 / 6),
    ("v-min", 3, 9, "1,1.5,0.5,0.25"),
    ("v-zb", 3, 4, "1,3,2,0.2"),
    ("zb-h1", 4, 8, "2,2.2,1.6,0.05"),
    ("1f1b", 3, 6, "1,1,1,0"),
    # pinned in test_search.py: relax() between V-Min's and V-Half's caps, and two named plans
    ("v-auto", 4, 6, "2,2.2,1.6,0.05", 0.625),
    ("v-half", 4, 8, "2,2.2,1.6,0.05"),
    ("v-zb", 4, 12, "2,2,2,0.25"),
]
ID = lambda inst: f"{inst[0]}-pp{inst[1]}-m{inst[2]}-{inst[3]}" + (f"-budget{inst[4]}" if inst[4:] else "")  # noqa: E731
PROVEN = {  # ID: (the proven optimum, proven within half of WORK on one worker: "quick")
    "v-half-pp2-m4-2,2.2,1.6,0.05": (24.45, True),
    "v-min-pp3-m3-2,2.2,1.6,0.05": (24, True),
    "v-min-pp4-m4-2,2.2,1.6,0.05": (36.4, True),
    "v-zb-pp4-m4-2,2,2,0.25": (29.25, True),
    "v-zb-pp2-m6-2,2,2,0.25": (37.75, True),
    "v-half-pp4-m4-1,1,1,0": (14.5, True),
    "v-auto-pp4-m4-2,2.2,1.6,0.05-budget0.5": (36.4, True),
    "v-auto-pp4-m4-2,2.2,1.6,0.05-budget0.625": (33.5, True),
    "v-auto-pp4-m4-2,2.2,1.6,0.05-budget0.75": (30.6, True),
    "v-auto-pp4-m4-2,2.2,1.6,0.05-budget0.875": (28.2, True),
    "v-auto-pp4-m4-2,2.2,1.6,0.05-budget1.0": (26.95, True),
    "v-auto-pp4-m5-2,2.2,1.6,0.05-budget0.625": (39.3, True),
    "v-auto-pp4-m5-2,2,2,0.25-budget0.625": (42.5, True),
    "v-auto-pp4-m7-2,2.2,1.6,0.05-budget0.625": (51.2, False),
    "v-auto-pp3-m5-2,2.2,1.6,0.05-budget0.8333333333333334": (32.8, True),
    "v-auto-pp3-m7-2,2.2,1.6,0.05-budget0.8333333333333334": (44.4, False),
    "v-auto-pp4-m5-2,2.2,1.6,0.05-budget0.875": (34, False),  # proven in 1.34 of WORK: too near to promise
    "v-auto-pp3-m5-2,2,2,0.25-budget0.8333333333333334": (35, True),
    "v-auto-pp3-m6-2,2,2,0.25-budget0.8333333333333334": (41, False),
    "v-auto-pp3-m8-2,2,2,0.25-budget0.8333333333333334": (53, False),
    "v-auto-pp3-m10-2,2.2,1.6,0.05-budget0.8333333333333334": (61.8, False),
    "v-auto-pp3-m6-3,2,2,1-budget1.1666666666666667": (50.5, False),
    "v-auto-pp4-m6-1,1.5,0.5,0.25-budget1.25": (22.25, True),
    "v-auto-pp3-m8-1,2,1,0.1-budget0.8333333333333334": (35.7, False),
    "v-min-pp3-m9-1,1.5,0.5,0.25": (36.5, False),
    "v-zb-pp3-m4-1,3,2,0.2": (28.2, True),
    "zb-h1-pp4-m8-2,2.2,1.6,0.05": (54.8, True),
    "1f1b-pp3-m6-1,1,1,0": (24, True),
    "v-auto-pp4-m6-2,2.2,1.6,0.05-budget0.625": (45.1, False),
    "v-half-pp4-m8-2,2.2,1.6,0.05": (53.8, False),
    "v-zb-pp4-m12-2,2,2,0.25": (77.25, False),
}


def optimum(inst) -> float:
    return PROVEN[ID(inst)][0]


def _build(name, pp, m, costs, budget=None):
    return registry.build(name, pp, m, Costs.parse(costs), **({} if budget is None else {"memory_budget": budget}))


@functools.lru_cache(maxsize=None)
def _solved(name, pp, m, costs, budget=None):
    schedule = _build(name, pp, m, costs, budget)
    return schedule, optimal.solve(optimal.problem_of(schedule), TIME_LIMIT, hint=schedule, work_limit=WORK)


@needs_ortools
@pytest.mark.parametrize("inst", INSTANCES, ids=ID)
def test_solution_verifies_and_resimulates_to_its_claim(inst):
    schedule, result = _solved(*inst)
    value, quick = PROVEN[ID(inst)]
    assert result.bound <= value + 1e-9, result.to_dict()  # no proven bound passes the optimum
    if quick:
        assert result.status == "optimal", result.to_dict()
    if result.schedule is None:  # a hard instance, no schedule within WORK (the same on every machine)
        return
    solved = result.schedule
    assert solved.placement == schedule.placement and solved.split_backward == schedule.split_backward
    export.from_dict(export.to_dict(solved))  # verifies, memory budget included
    sim = simulate(solved)
    assert sim.makespan == pytest.approx(result.makespan, abs=1e-9)
    # The stored optimum lies between the solver's bound and its schedule, and is both when proven.
    assert value <= result.makespan + 1e-9
    if result.status == "optimal":
        assert result.makespan == pytest.approx(value, abs=1e-9) == pytest.approx(result.bound, abs=1e-9)
    budget = optimal.problem_of(schedule).cap  # the schedule's budget (or its own peak) in stage-activations
    assert max(sim.peak_activations) <= budget + 1e-9
    assert result.makespan <= simulate(schedule).makespan + 1e-9  # the generator is one solution


@pytest.mark.parametrize("inst", INSTANCES, ids=ID)
def test_planner_within_two_percent_of_optimum(inst):
    planned = simulate(_build(*inst)).makespan
    assert planned >= optimum(inst) - 1e-9  # nothing beats a proven optimum (else the model or the table is wrong)
    gap = planned / optimum(inst) - 1
    assert gap <= 0.02, f"{ID(inst)}: planner {planned:g} vs optimum {optimum(inst):g}: {gap:.2%}"


@pytest.mark.parametrize("inst", [i for i in INSTANCES if i[0].startswith("v-")], ids=ID)
def test_the_planners_lower_bound_is_below_the_optimum(inst):
    # The searches stop at problem.Problem.bound: it must never pass a proven optimum.
    assert search.lower_bound(_build(*inst)) <= optimum(inst) + 1e-9


@needs_ortools
def test_unequal_stages_and_sizes_are_modelled():
    # pp=2 V: the embedding stage and the output stage heavier, the output stage's activation larger.
    stages = [StageCost(1.5, 1.0, 1.0, 1.5), StageCost(1, 1, 1), StageCost(1, 1, 1), StageCost(1, 2.5, 1.5, 2)]
    schedule = registry.build("v-zb", 2, 4, Costs(2, 2, 2, 0.25), stage_costs=stages)
    problem = optimal.problem_of(schedule, memory_budget=1.0)  # 4 size-weighted stage-activations per rank
    result = optimal.solve(problem, TIME_LIMIT, hint=schedule, work_limit=WORK)
    assert result.status == "optimal", result.to_dict()
    sim = simulate(result.schedule)
    assert result.schedule.stage_costs == tuple(stages)
    assert sim.makespan == pytest.approx(result.makespan, abs=1e-9)
    assert max(sim.peak_activations) <= 4 + 1e-9
    # Rank 0 holds stages 0 and 3 (1.5 + 2): one microbatch at a time fits, two do not.
    assert sim.peak_activations[0] == pytest.approx(3.5)


@needs_ortools
def test_a_heavier_embedding_stage_is_solved():
    # pp=2, m=5, 2,3,1,0.5 at V-Min's budget, the embedding stage 1.3x the activations: the
    # optimum test_search.py's test_named_plans_relax_too reaches.
    sc = [StageCost(1.4, 1.95, 0.75, 1.3)] + [StageCost(1, 1.5, 0.5)] * 3
    schedule = registry.build("v-min", 2, 5, Costs(2, 3, 1, 0.5), stage_costs=sc)
    result = optimal.solve(optimal.problem_of(schedule), TIME_LIMIT, hint=schedule, work_limit=WORK)
    assert result.status == "optimal" and result.makespan == pytest.approx(38.2)


@needs_ortools
def test_tighter_budget_is_never_faster():
    schedule = registry.build("v-zb", 3, 3, Costs(2, 2.2, 1.6, 0.05))
    loose = optimal.solve(optimal.problem_of(schedule, memory_budget=1.0), TIME_LIMIT, hint=schedule, work_limit=WORK)
    tight = optimal.solve(optimal.problem_of(schedule, memory_budget=2 / 3), TIME_LIMIT, hint=schedule, work_limit=WORK)
    assert loose.status == tight.status == "optimal"
    assert tight.makespan > loose.makespan  # 4 stage-activations per rank cost time at these sizes
    assert max(simulate(tight.schedule).peak_activations) <= 4


def test_time_scale_is_exact_for_decimals_and_rounds_measured_seconds():
    assert optimal.time_scale([1, 1.1, 0.8, 0.05]) == (20, False)
    assert optimal.time_scale([1, 1, 1, 0.25]) == (4, False)
    scale, rounded = optimal.time_scale([0.0123456789, 0.0211, 0.0003])
    assert rounded and 0.0003 * scale >= optimal.ROUNDING


def test_schedule_package_does_not_need_ortools():
    code = ("import sys; sys.modules['ortools'] = None\n"
            "from megatron_vshape.planner import optimal\nfrom megatron_vshape.schedule import registry\n"
            "s = registry.build('v-half', 2, 4); p = optimal.problem_of(s)\n"
            "try:\n    optimal.solve(p, 1)\nexcept optimal.ConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install" in out.stdout and "ortools==9.15.6755" in out.stdout


def test_cli_optimal_without_ortools_is_one_line_and_exit_2():
    code = ("import sys; sys.modules['ortools'] = None\n"
            "from megatron_vshape.cli import main\n"
            "sys.exit(main(['plan', '--schedule', 'v-half', '--pp', '2', '--microbatches', '4', '--optimal']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--optimal" in lines[0] and "pip install" in lines[0], out.stderr


@needs_ortools
def test_cli_prints_bound_and_exports(tmp_path):
    from megatron_vshape.cli import main

    path = tmp_path / "opt.json"
    rc = main(["plan", "--schedule", "v-min", "--pp", "3", "--microbatches", "3", "--costs", "2,2.2,1.6,0.05",
               "--optimal", "--time-limit", str(TIME_LIMIT), "--work-limit", str(WORK), "--export", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    s = export.load_json(str(path))  # verifies, within the recorded memory budget
    assert data["optimal"]["status"] == "optimal" and data["optimal"]["of"] == "v-min"
    assert simulate(s).makespan == pytest.approx(data["makespan"]) == pytest.approx(data["optimal"]["lower_bound"])
    assert data["memory_budget"] == pytest.approx(4 / 6)  # v-min's peak: 4 stage-activations of 1F1B's 6 at pp=3
    assert data["makespan"] <= data["optimal"]["generated_makespan"]


def test_cli_rejects_a_time_limit_of_zero(capsys):
    from megatron_vshape.cli import main

    if not HAVE_ORTOOLS:
        pytest.skip("OR-Tools is not installed: the missing extra is reported first")
    rc = main(["plan", "--schedule", "v-half", "--pp", "2", "--microbatches", "4", "--optimal", "--time-limit", "0"])
    assert rc == 2 and "--time-limit" in capsys.readouterr().err


if __name__ == "__main__":  # prove the stored optima again (minutes)
    for inst in INSTANCES:
        schedule = _build(*inst)
        result = optimal.solve(optimal.problem_of(schedule), 900, hint=schedule)
        same = result.status == "optimal" and abs(result.makespan - optimum(inst)) < 1e-9
        print(f"{ID(inst)}: {result.status} {result.makespan:g} (stored {optimum(inst):g}) "
              f"{'ok' if same else 'DIFFERS'} in {result.wall_s:.0f}s", flush=True)


def test_cli_refuses_a_work_limit_that_is_not_positive(capsys):
    from megatron_vshape.cli import main

    rc = main(["plan", "--schedule", "v-min", "--pp", "3", "--microbatches", "3", "--optimal", "--work-limit", "0"])
    assert rc == 2 and "--work-limit 0: give the solver's deterministic time" in capsys.readouterr().err
