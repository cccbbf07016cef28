"""scripts/bench/*.py are programs, not a package: their tests load one as a module by its path."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "scripts", "bench")
if BENCH not in sys.path:  # as when one runs as a script: its siblings (parallel.py) import by name
    sys.path.append(BENCH)


def load_bench(name: str, module_name: str = ""):
    """scripts/bench/<name>.py as a module, registered under `module_name` (default `name`):
    dataclasses look their module up in sys.modules."""
    spec = importlib.util.spec_from_file_location(module_name or name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
