"""conftest.py's session cache of plans keeps cache_clear() meaning what the determinism tests need."""
from megatron_vshape.planner import search
from megatron_vshape.schedule import registry


def test_a_cleared_cache_plans_again_then_reuses(monkeypatch):
    real, calls = search._plan.fn, []
    monkeypatch.setattr(search._plan, "fn", lambda *args: calls.append(args) or real(*args))
    first = registry.build("v-half", 2, 3)  # planned here or earlier in the session
    search._plan.cache_clear()
    before = len(calls)
    again = registry.build("v-half", 2, 3)
    assert len(calls) == before + 1 and again.ranks == first.ranks  # planned for real after the clear
    registry.build("v-half", 2, 3)
    assert len(calls) == before + 1  # then from the cache
    search._plan.end_test()  # as the autouse fixture does after a test
    registry.build("v-half", 2, 3)
    assert len(calls) == before + 1  # the session's plans are back


def test_plans_made_after_a_clear_do_not_outlive_the_test(monkeypatch):
    # The tests that clear the cache patch the search's constants: a plan made then must not be
    # what later tests receive (a full run failed test_optimal's v-auto pp=3 case this way).
    first = registry.build("v-half", 2, 5)  # the session's plan
    search._plan.cache_clear()
    key = next(iter(search._plan.saved))
    monkeypatch.setattr(search._plan, "fn", lambda *args: "patched")
    assert search._plan(*key) == "patched"  # after the clear: planned anew (under a patch here)
    search._plan.end_test()
    assert search._plan(*key) != "patched"  # the session's plan is back
    assert registry.build("v-half", 2, 5).ranks == first.ranks
