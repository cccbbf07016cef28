"""Our entry points hide megatron-core's notices about optional packages (Transformer Engine,
Apex) in their own process and in the ranks they start; every other warning still shows."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAM = """
import multiprocessing as mp, importlib, sys, warnings
if sys.argv[1] == "quiet":
    from megatron_vshape.argtypes import quiet_megatron_notices
    quiet_megatron_notices()
if __name__ == "__main__":
    if sys.argv[1] == "quiet":  # a spawned rank imports megatron-core before any code of ours runs
        child = mp.get_context("spawn").Process(target=importlib.import_module, args=("megatron.core.models.backends",))
        child.start()
        child.join()
    import megatron.core.optimizer, megatron.core.models.backends
    warnings.warn("a warning of our own")
"""


def _stderr(mode):
    r = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": ""}, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_only_megatron_core_optional_package_notices_are_hidden():
    loud, quiet = _stderr("loud"), _stderr("quiet")
    # without the filter they are printed (so this test can fail)
    assert "Transformer Engine and Apex are not installed" in loud and "Apex is not installed" in loud
    assert "Apex is not installed" not in quiet and "Transformer Engine" not in quiet
    assert "a warning of our own" in loud and "a warning of our own" in quiet
