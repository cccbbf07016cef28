"""`make test` runs the suite on two workers (pytest-xdist, --dist loadgroup): every test goes with
the rest of its file, so a module's fixtures are built once, and the files that read the one
quickstart demo (tests/e2e/conftest.py) go together, so it runs once."""
import os

import pytest

SHARED = {"test_pretrain_cli.py": "quickstart", "test_readme.py": "quickstart"}


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        name = os.path.basename(str(item.path))
        item.add_marker(pytest.mark.xdist_group(SHARED.get(name, str(item.path))))
