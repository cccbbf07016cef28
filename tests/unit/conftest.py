"""One plan per problem for the whole session: search._plan's own memory holds 256 plans, fewer than
the generator grid (pp up to 16, m up to 128, about a second each), so other files planned the same
problems again.  Outside a cleared test a problem is read through search._plan's own cache (the
run's plans folder, tests/conftest.py); a test that calls search._plan.cache_clear() plans for real
for the rest of itself, reading and keeping nothing on disk; the session's plans come back after
it, and the plans it made are dropped."""
import pytest

from megatron_vshape.planner import search


class SessionPlans:
    """search._plan's results by its arguments, unbounded; cache_clear() as lru_cache's, for one test.

    Plans made after a cache_clear() come from the search itself (`fn`) and are dropped when the
    test ends, never kept for the session nor on disk: the tests that clear the cache are the
    ones that patch the search's constants.  Other plans come through `shared` (the package's
    cache: memory and the run's folder)."""

    def __init__(self, shared):
        self.shared, self.fn, self.live, self.saved = shared, shared.__wrapped__, {}, None

    def __call__(self, *args):
        if args not in self.live:
            self.live[args] = (self.fn if self.saved is not None else self.shared)(*args)
        return self.live[args]

    def cache_clear(self):
        if self.saved is None:
            self.saved = self.live
        self.live = {}

    def end_test(self):
        if self.saved is not None:
            self.live, self.saved = self.saved, None


search._plan = SessionPlans(search._plan)


@pytest.fixture(autouse=True)
def _session_plans_back_after_each_test():
    yield
    search._plan.end_test()


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """megatron-core's parallel state on a world of one gloo rank, for a module's tests."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
