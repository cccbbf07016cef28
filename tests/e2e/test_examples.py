"""examples/ run as their docstrings say, under torchrun, and train."""
import os
import re

from bounded_runs import REPO as ROOT, TORCHRUN, run_bounded


def test_v_half_gpt_trains_over_two_gloo_ranks():
    r = run_bounded([TORCHRUN, "--standalone", "--nproc-per-node", "2", "examples/v_half_gpt.py", "--steps", "4"], 280,
                    env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(x) for x in re.findall(r"^v-half pp=2 step \d+ loss ([\d.]+)$", r.stdout, re.M)]
    assert len(losses) == 4, r.stdout  # one line per step, from the last pipeline rank only
    assert losses[-1] < losses[0]  # Adam on a fixed dataset
    assert "Apex" not in r.stderr and "Transformer Engine" not in r.stderr


def test_example_command_is_the_one_its_docstring_and_the_readme_print():
    doc = open(os.path.join(ROOT, "examples", "v_half_gpt.py")).read()
    readme = open(os.path.join(ROOT, "README.md")).read()
    command = ".venv/bin/torchrun --standalone --nproc-per-node 2 examples/v_half_gpt.py"
    assert command in doc and command in readme
