"""`torchrun scripts/pretrain_gpt.py` as users run it: a v-half run saves (--save, --save-interval),
a 1f1b run resumes from its middle checkpoint (--load) and prints the same losses for the
iterations after it, bit for bit (untied embeddings: every schedule adds each gradient in the same
order, and the clipping norm adds its squares exactly, whichever rank holds which layer; mock
data is a function of the sample index, and the driver resumes it from the iteration).  Linear
decay (the default) to 0 at the last iteration: before the exact norm, the 1f1b run's last loss
differed from the v-half run's by 3e-8 (its clipping coefficient rounded by layout).
megatron-core's torch_dist files and Megatron-LM's tracker are on disk."""
import os

import pytest

from bounded_runs import losses_by_iteration, pretrain

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr", "3e-3",
         "--mock-data", "--vocab-size", "63", "--make-vocab-size-divisible-by", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--log-interval", "1", "--untie-embeddings-and-output-weights",
         "--pipeline-model-parallel-size", "2"]


def _torchrun(*argv):
    """scripts/pretrain_gpt.py with FLAGS and argv on 2 processes, as it ended."""
    return pretrain([*FLAGS, *argv])


def _pretrain(*argv):
    run = _torchrun(*argv)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return losses_by_iteration(run.stdout), run.stdout


def _validation(out):
    """{iteration: the printed validation loss}."""
    return {int(line.split()[4]): line.split("lm loss value: ")[1].split()[0] for line in out.splitlines()
            if line.startswith(" validation loss at iteration")}


# Validation every 2 iterations: the resumed run goes on with the validation batches the saved one
# would read next (it read round 0's again, so the same iteration gave another validation loss).
EVALS = ("--eval-interval", "2", "--eval-iters", "1")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted v-half run, saving every 2 iterations: (its losses, its output, the checkpoint
    directory).  Both tests resume from its middle checkpoint (one launch fewer)."""
    save = str(tmp_path_factory.mktemp("resume") / "ckpt")
    whole, whole_out = _pretrain("--pipeline-schedule", "v-half", "--save", save, "--save-interval", "2", *EVALS)
    return whole, whole_out, save


@pytest.mark.timeout(600)
def test_v_half_run_resumes_under_1f1b_with_the_same_losses(saved):
    whole, whole_out, save = saved
    assert sorted(whole) == [1, 2, 3, 4]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "4"
    middle = os.path.join(save, "iter_0000002")
    # torch_dist: metadata.json and the files' .metadata; the common state is in common.pt before
    # megatron-core 0.19.0, inside the torch_dist files from 0.19.0 on.
    assert os.path.isfile(os.path.join(middle, "metadata.json")) and os.path.isfile(os.path.join(middle, ".metadata"))
    resumed, out = _pretrain("--pipeline-schedule", "1f1b", "--load", middle, *EVALS)
    assert "loaded checkpoint" in out
    print(f"v-half, uninterrupted: {[whole[i] for i in (1, 2, 3, 4)]}\n"
          f"1f1b resumed at 2:     {[resumed[i] for i in (3, 4)]}")
    assert sorted(resumed) == [3, 4]
    assert [resumed[3], resumed[4]] == [whole[3], whole[4]]
    assert sorted(_validation(whole_out)) == [2, 4] and list(_validation(out)) == [4]
    assert _validation(out)[4] == _validation(whole_out)[4]


def _line(out, iteration):
    """The log line of `iteration` as {field: value}."""
    line = next(l for l in out.splitlines() if l.startswith(f" iteration {iteration:8d}/"))
    return dict(part.strip().rsplit(": ", 1) for part in line.split(" | ")[1:] if ": " in part)


@pytest.mark.timeout(600)
def test_a_resume_with_another_batch_size_reads_on_and_says_which_schedule_wins(saved):
    """As Megatron-LM: the samples consumed come back from the checkpoint (with another --global-batch-size the
    resumed run read from iteration x new size, skipping samples), and a learning-rate flag that differs from the
    checkpoint's (here the decay length in samples, which the batch size changes) is an error naming the two flags
    that say which wins (the checkpoint's used to win without a word)."""
    middle = os.path.join(saved[2], "iter_0000002")
    refused = _torchrun("--pipeline-schedule", "v-half", "--load", middle, "--global-batch-size", "8")
    assert refused.returncode != 0
    assert "pass --override-opt-param-scheduler" in refused.stderr + refused.stdout, refused.stderr[-3000:]
    _, out = _pretrain("--pipeline-schedule", "v-half", "--load", middle, "--global-batch-size", "8", "--lr", "1e-2",
                       "--override-opt-param-scheduler")
    assert "(8 samples consumed)" in out
    assert [int(_line(out, i)["consumed samples"]) for i in (3, 4)] == [16, 24]  # 2 x 4, then 8 a step
    assert float(_line(out, 3)["learning rate"]) > 3e-3  # this run's --lr, above the saved run's maximum
