"""`python -m megatron_vshape.launch pretrain_gpt.py ... --pipeline-schedule NAME` against a stand-in for
Megatron-LM's pretrain_gpt.py and megatron.training (same hook points, megatron-core only: CI has no
Megatron-LM checkout).  The schedule must really run: losses equal the non-pipelined model's."""
import os
import subprocess
import sys

import pytest

from bounded_runs import REPO, run_bounded
from megatron_lm_runs import STANDIN, losses, reference_losses, run_launcher
from megatron_vshape.testing.tiny_gpt import TinyGPT

TINY = TinyGPT(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, micro_batch_size=2,
               tied_embeddings=True)
M, ITERS, LR = 4, 3, 0.1
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", str(2 * M),
         "--train-iters", str(ITERS), "--lr", str(LR)]


@pytest.fixture(scope="module")
def reference():
    return reference_losses(TINY, M, ITERS, LR)


@pytest.mark.timeout(240)
def test_v_half_tied_pp2_trains_like_the_unpipelined_model(reference):
    run = run_launcher(STANDIN, MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "v-half"],
                       nproc=2, timeout=200)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "megatron_vshape: pipeline schedule v-half: pp=2, v placement, 2 chunk(s) per rank, 4 microbatches, " \
        "layers per stage 1,1,1,1 (layers per rank 2, 2)" in run.stdout
    assert "forward-backward function: forward_backward_v-half" in run.stdout
    got = losses(run.stdout)
    assert len(got) == ITERS, run.stdout[-3000:]
    # Three SGD steps: a wrong gradient anywhere (the tied weight shared by both V ends included)
    # changes the later losses.  float32 sums of the loss dicts: agree to rounding.
    assert got == pytest.approx(reference, rel=1e-6, abs=1e-6)


@pytest.mark.timeout(240)
def test_uneven_v_from_pipeline_layout_trains_like_the_unpipelined_model():
    """--pipeline-layout on the V through Megatron-LM's hooks: the hook hands Megatron-LM the layout as its
    own --pipeline-model-parallel-layout, and builds the V's chunks from it."""
    tiny = TinyGPT(**{**TINY.__dict__, "num_layers": 5})
    model = MODEL[:1] + ["5"] + MODEL[2:]
    run = run_launcher(STANDIN, model + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "v-zb",
                                         "--pipeline-layout", "2,1,1,1"], nproc=2, timeout=200)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "layers per stage 2,1,1,1 (layers per rank 3, 2)" in run.stdout
    assert losses(run.stdout) == pytest.approx(reference_losses(tiny, M, ITERS, LR), rel=1e-6, abs=1e-6)


@pytest.mark.timeout(120)
def test_a_layout_the_v_cannot_take_exits_2_before_any_process_group():
    args = MODEL + ["--pipeline-layout", "1,2,2"]
    # WORLD_SIZE=2 without torchrun and without MASTER_ADDR: creating a process group would fail differently.
    run = run_launcher(STANDIN, args + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "v-min"],
                       nproc=0, timeout=100, env={"RANK": "0", "WORLD_SIZE": "2"})
    assert run.returncode == 2, (run.stdout[-2000:], run.stderr[-2000:])
    assert "megatron_vshape: error: --pipeline-layout 1,2,2 gives 3 stages; --pipeline-schedule v-min at pp=2 has 4" \
        in run.stderr
    assert "Traceback" not in run.stderr


def test_launcher_without_a_script_says_how_to_call_it():
    run = subprocess.run([sys.executable, "-m", "megatron_vshape.launch", "no_such_script.py"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "no_such_script.py is not a file" in run.stderr


def test_importing_the_package_loads_neither_torch_nor_megatron():
    code = ("import sys, megatron_vshape; assert callable(megatron_vshape.install); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


@pytest.mark.timeout(300)
def test_v_min_tp2_pp2_gives_rank_0_every_field_over_tensor_parallelism(reference):
    """tp=2: TP rank 0 reads the data and broadcasts what the pipeline rank needs; V's rank 0 is first
    and last stage at once, so its TP peers need labels and loss mask too (get_batch_on_this_tp_rank hook)."""
    run = run_launcher(STANDIN, MODEL + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                         "--pipeline-schedule", "v-min"], nproc=4, timeout=280)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "forward-backward function: forward_backward_v-min" in run.stdout
    got = losses(run.stdout)
    assert len(got) == ITERS, run.stdout[-3000:]
    # Tensor parallelism sums partial products in another order than the tp=1 reference.
    assert got == pytest.approx(reference, rel=1e-5)


@pytest.mark.timeout(240)
def test_the_two_line_patch_is_equivalent_to_the_launcher(reference, tmp_path):
    """patches/'s two added lines at the top of (a copy of) the stand-in script, run by torchrun directly."""
    import shutil

    patch = (REPO / "patches" / "megatron-lm-core_v0.16.1-pretrain_gpt.patch").read_text().splitlines()
    added = [line[1:] for line in patch if line.startswith("+") and not line.startswith("+++")]
    assert [l for l in added if l.strip()] == ["import megatron_vshape  # --pipeline-schedule: V-shape pipeline schedules",
                                              "megatron_vshape.install()"]
    copy = tmp_path / "standin"
    shutil.copytree(STANDIN.parent, copy)
    script = copy / "pretrain_gpt.py"
    text = script.read_text()
    script.write_text(text.replace('"""\n', '"""\n' + "\n".join(added) + "\n", 1))
    run = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                       *MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "v-half"], timeout=220)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "forward-backward function: forward_backward_v-half" in run.stdout
    assert losses(run.stdout) == pytest.approx(reference, rel=1e-6, abs=1e-6)



@pytest.mark.timeout(240)
def test_a_v_half_file_runs_as_read(reference, tmp_path):
    """--pipeline-schedule-file through install(): the file's ops run as read, and each microbatch
    trains on its own data whatever their order.  The file holds V-Half's ops with microbatches 0 and
    1 swapped on the first stage, under another registered name (1f1b): the name is shown, the ops run
    (a schedule rebuilt by its name would not even fit the model built for the file's V placement)."""
    import json

    from megatron_vshape.schedule import registry
    from megatron_vshape.schedule.export import to_dict

    data = to_dict(registry.build("v-half", 2, M))
    ops = data["ranks"][0]
    i, j = [k for k, op in enumerate(ops) if op["op"] == "F" and op["stage"] == 0][:2]
    ops[i], ops[j] = ops[j], ops[i]
    data["schedule"] = "1f1b"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    run = run_launcher(STANDIN, MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule-file", str(path)],
                       nproc=2, timeout=200)
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"megatron_vshape: pipeline schedule 1f1b (from {path})" in run.stdout
    assert losses(run.stdout) == pytest.approx(reference, rel=1e-6, abs=1e-6)


def _install_in(path, code="import megatron_vshape; megatron_vshape.install()"):
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": f"{path}:{REPO}"})


def test_install_names_a_missing_dependency_with_the_install_command(tmp_path):
    # A test double of a Megatron-LM whose megatron.training imports a package that is not installed
    # (as core_v0.16.1's imports six without the [megatron-lm] extra).
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "__init__.py").write_text("import package_megatron_lm_needs_xyz\n")
    run = _install_in(tmp_path)
    assert run.returncode == 1
    assert ("ConfigError: Megatron-LM's megatron.training needs the Python package package_megatron_lm_needs_xyz, "
            "which is not installed: pip install .[megatron-lm]") in run.stderr, run.stderr[-2000:]


def test_install_refuses_a_megatron_lm_release_it_does_not_support():
    code = ("import megatron_vshape.runtime.compat as compat; compat.release = lambda: '0.21.0'\n"
            "import megatron_vshape; megatron_vshape.install()")
    run = _install_in(STANDIN.parent, code)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert "Megatron-LM with megatron-core 0.21.0" in last and "core_v0.16.0" in last and "main (d98e8a6" in last, last
