"""Every registered generator, pp 2..16, m < pp, m = pp, m = 2pp+1, m = 8pp: a verified
schedule, or a ConfigError whose stated minimum really is one."""
import re

import pytest

from megatron_vshape.planner import search

from megatron_vshape.schedule import registry
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.ops import Costs
from megatron_vshape.schedule.simulate import simulate
from megatron_vshape.schedule.verify import problems

BASELINES = ("1f1b", "1f1b-interleaved", "zb-h1", "zb-h2")
PAPER = ("v-zb", "v-half", "v-min")


def _counts(pp):
    return sorted({1, pp - 1, pp, 2 * pp + 1, 8 * pp} - {0})


def _serves(name, pp, m):
    """Which sizes the baselines must serve (the V-shapes say so in their errors)."""
    if name == "1f1b-interleaved":
        return m >= pp and m % pp == 0  # Megatron's default group of pp microbatches
    return True


def test_all_schedules_are_registered():
    assert set(BASELINES) <= set(registry.names())
    missing = set(PAPER) - set(registry.names())
    if missing:  # the V-shapes live in planner/generators.py; never pass silently without them
        pytest.fail(f"not registered: {sorted(missing)}")


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("pp", range(2, 17))
def test_generator_output_verifies_or_names_its_minimum(name, pp):
    for m in _counts(pp):
        try:
            schedule = registry.build(name, pp, m)
        except ConfigError as exc:
            text = str(exc)
            if name in BASELINES:
                assert not _serves(name, pp, m), f"{name} must serve pp={pp}, m={m}: {text}"
            assert f"microbatches={m}" in text, text
            minimum = re.search(r"microbatches >= (\d+)", text)
            if minimum:  # the minimum it names must work
                assert int(minimum.group(1)) > m
                assert problems(registry.build(name, pp, int(minimum.group(1)))) == []
            continue
        assert name not in BASELINES or _serves(name, pp, m)
        assert (schedule.pp, schedule.microbatches) == (pp, m)
        assert problems(schedule) == [], f"{name} pp={pp} m={m}"
        assert simulate(schedule).makespan > 0


@pytest.mark.parametrize("name", registry.names())
def test_generators_are_pure_functions(name):
    costs = Costs(2, 2.2, 1.6, 0.05)
    a = registry.build(name, 4, 16, costs)
    search._plan.cache_clear()  # the second build plans again rather than reading the first's plan
    b = registry.build(name, 4, 16, costs)
    assert a.ranks == b.ranks and a.costs == b.costs


def test_unknown_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown schedule 'v-max'.*1f1b"):
        registry.build("v-max", 4, 8)
