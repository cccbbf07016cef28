"""`--pipeline-schedule-file` as users run it: v-half exported by `megatron-vshape export`, its first
stage's first two forwards swapped by hand, `megatron-vshape check` accepts it, and training with it
under torchrun gives v-half's losses (each microbatch trains on its own data whatever the order)."""
import json
import os
import subprocess
import sys

import pytest

from bounded_runs import pretrain, tagged

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "3e-3",
         "--mock-data", "--vocab-size", "63", "--make-vocab-size-divisible-by", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--log-interval", "1", "--pipeline-model-parallel-size", "2"]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


def _losses(*argv):
    run = pretrain([*FLAGS, *argv], timeout=200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [m["loss"] for m in tagged(run.stdout, "VSHAPE_METRICS")], run.stdout


@pytest.mark.timeout(400)
def test_training_on_a_hand_reordered_export_gives_the_generated_schedules_losses(tmp_path):
    path = str(tmp_path / "v-half.json")
    cli = [sys.executable, "-m", "megatron_vshape.cli"]
    subprocess.run(cli + ["export", "--schedule", "v-half", "--pp", "2", "--microbatches", "4", "--output", path],
                   cwd=ROOT, env=_env(), check=True, timeout=60)
    data = json.load(open(path))
    ops = data["ranks"][0]
    i, j = [k for k, op in enumerate(ops) if op["op"] == "F" and op["stage"] == 0][:2]
    ops[i], ops[j] = ops[j], ops[i]
    json.dump(data, open(path, "w"))
    check = subprocess.run(cli + ["check", path], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "F0@0 runs after F1@0" in check.stdout, check.stdout + check.stderr

    generated, _ = _losses("--pipeline-schedule", "v-half")
    edited, out = _losses("--pipeline-schedule-file", path)
    assert "schedule read from --pipeline-schedule-file" in out
    assert len(edited) == 2 and edited == generated
