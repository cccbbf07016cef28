"""What every test directory shares: the run's folder, and the plans the run makes.

Every process of a run (both `make test` workers, the ranks they launch, the commands they start)
reads and keeps the search's plans in one folder (planner/plan_cache.py): a problem another
process planned already is read, not searched again.  Tests that compare two builds clear the
cache, which makes their process plan again (tests/unit/conftest.py)."""
import os

import pytest

from megatron_vshape.planner import plan_cache


@pytest.fixture(scope="session")
def run_folder(tmp_path_factory):
    """The folder of this pytest run, shared by its workers under pytest-xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def plans_shared_by_the_run(run_folder):
    """The run's plans folder in the environment every process of the run inherits (a folder of
    this run, whatever the caller's environment names: plans of other runs stay out)."""
    before = os.environ.get(plan_cache.ENV)
    os.environ[plan_cache.ENV] = str(run_folder / "plans")
    yield
    if before is None:
        os.environ.pop(plan_cache.ENV, None)
    else:
        os.environ[plan_cache.ENV] = before
