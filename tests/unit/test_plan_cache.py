"""planner/plan_cache.py: plans kept on disk under MEGATRON_VSHAPE_PLAN_CACHE are read back by
another process instead of searched again, and never across a changed planner or problem."""
import json
import os
import subprocess
import sys
import warnings

import pytest

from megatron_vshape.planner import plan_cache, search
from megatron_vshape.schedule.ops import Costs, stage_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COSTS = Costs(2, 2.2, 1.6, 0.05).per_stage(2)
ARGS = ("v-half", 3, 5, COSTS, stage_table(COSTS, 6, None), 0.75)


class Counted:
    def __init__(self):
        self.calls = 0
        self.search = search._plan.fn  # the search itself (tests/unit/conftest.py keeps the session's plans)

    def __call__(self, *args):
        self.calls += 1
        return self.search(*args)


def test_a_plan_on_disk_is_read_by_another_cache_and_cleared_means_plan_again(tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.ENV, str(tmp_path))
    first, second = Counted(), Counted()
    planned = plan_cache.PlanCache(first)(*ARGS)
    assert first.calls == 1 and len(list(tmp_path.glob("*.json"))) == 1
    reader = plan_cache.PlanCache(second)
    assert reader(*ARGS) == planned and second.calls == 0  # read, with tuples as planned
    reader.cache_clear()
    assert reader(*ARGS) == planned and second.calls == 1  # planned again, not read from before the clear
    other = ARGS[:-1] + (0.875,)
    reader(*other)
    assert second.calls == 2 and len(list(tmp_path.glob("*.json"))) == 2


def test_a_damaged_or_foreign_file_is_planned_again_and_a_changed_planner_reads_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.ENV, str(tmp_path))
    counted = Counted()
    planned = plan_cache.PlanCache(counted)(*ARGS)
    (path,) = tmp_path.glob("*.json")
    path.write_text(path.read_text()[:40])
    assert plan_cache.PlanCache(counted)(*ARGS) == planned and counted.calls == 2
    data = json.loads(path.read_text())  # rewritten whole
    data["args"] = data["args"].replace("0.75", "0.5")
    path.write_text(json.dumps(data))
    assert plan_cache.PlanCache(counted)(*ARGS) == planned and counted.calls == 3
    monkeypatch.setattr(plan_cache, "code_version", lambda: "another planner")
    assert plan_cache.PlanCache(counted)(*ARGS) == planned and counted.calls == 4
    assert len(list(tmp_path.glob("*.json"))) == 2 and not list(tmp_path.glob(".plan-*"))


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(plan_cache.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    counted = Counted()
    cache = plan_cache.PlanCache(counted)
    cache(*ARGS)
    cache(*ARGS)
    assert counted.calls == 1 and list(tmp_path.iterdir()) == []


PLAN = ("from megatron_vshape.planner import search; from megatron_vshape.schedule import registry;{}"
        "s = registry.build('v-auto', 3, 4, memory_budget=0.75); print(s.ranks)")


def test_a_second_process_takes_the_first_ones_plan_without_searching(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, **{plan_cache.ENV: str(tmp_path)})
    first = subprocess.run([sys.executable, "-c", PLAN.format("")], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert len(list(tmp_path.glob("*.json"))) == 2  # v-auto's and the named plan it includes (v-half's)
    # The second process's search fails if it runs at all; its plan is verified like any other.
    no_search = " search._plan.fn = None;"
    second = subprocess.run([sys.executable, "-c", PLAN.format(no_search)], env=env, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    env.pop(plan_cache.ENV)
    third = subprocess.run([sys.executable, "-c", PLAN.format(no_search)], env=env, capture_output=True, text=True,
                           timeout=120)
    assert third.returncode != 0 and "NoneType" in third.stderr  # without the folder it searches


def test_an_unwritable_folder_is_said_once_and_planning_goes_on(tmp_path, monkeypatch):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    monkeypatch.setenv(plan_cache.ENV, str(blocked))
    counted = Counted()
    cache = plan_cache.PlanCache(counted)
    with pytest.warns(RuntimeWarning, match="plans are not kept in"):
        planned = cache(*ARGS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache(*ARGS[:-1] + (0.875,))
    assert planned == counted.search(*ARGS) and counted.calls == 2
