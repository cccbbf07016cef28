"""A diverging run as users launch it: `--lr 1e4` on the tiny GPT.  By default the driver stops at
the first non-finite loss or gradient norm with one line naming the iteration and the fix, exits 1
and says "diverged" in its summary; with --no-check-for-nan-in-loss-and-grad it skips those steps,
counts them on every log line and in the summary, whose status says so.  Every metrics line stays
valid JSON (null, never NaN)."""
import json

import pytest

from bounded_runs import pretrain

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e4",
         "--lr-decay-style", "constant", "--mock-data", "--vocab-size", "63",
         "--make-vocab-size-divisible-by", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--log-interval", "1"]


def _run(nproc, *argv):
    run = pretrain([*FLAGS, *argv], nproc=nproc)
    lines = [line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith("VSHAPE_")]
    # json.loads accepts NaN; the contract is strict JSON, so refuse it here.
    strict = [(tag, json.loads(text, parse_constant=lambda c: pytest.fail(f"{tag} holds {c}: {text}")))
              for tag, text in lines]
    return run, [r for t, r in strict if t == "VSHAPE_METRICS"], [r for t, r in strict if t == "VSHAPE_SUMMARY"]


@pytest.mark.timeout(300)
def test_a_diverging_run_stops_with_one_line_on_two_pipeline_ranks():
    run, metrics, (summary,) = _run(2, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "v-half")
    # Lines of our own (torchrun's closing block quotes the same line as its root cause).
    errors = [line for line in run.stderr.splitlines() if line.startswith("megatron-vshape pretrain: error:")]
    assert run.returncode != 0, run.stdout[-2000:]
    assert len(errors) == 1, run.stderr[-3000:]
    assert "training diverged" in errors[0] and "lower --lr" in errors[0] and "--load" in errors[0]
    stopped_at = int(errors[0].split("iteration ")[1].split(":")[0])
    assert summary["status"] == "diverged"
    # Nothing is logged for the iteration it stopped at, nor after it.
    assert [m["iteration"] for m in metrics] == list(range(1, stopped_at))
    assert stopped_at < 6


@pytest.mark.timeout(300)
def test_skipping_non_finite_steps_counts_them_and_says_so():
    run, metrics, (summary,) = _run(1, "--no-check-for-nan-in-loss-and-grad")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    nan = [m["iteration"] for m in metrics if m["nan_iterations"]]
    assert nan and all(m["skipped_iterations"] == 1 and m["grad_norm"] is None for m in metrics if m["nan_iterations"])
    assert summary["nan_iterations"] == len(nan) and summary["skipped_iterations"] == len(nan)
    assert summary["status"] == f"ok with {len(nan)} skipped and {len(nan)} nan iteration(s)"
    log = [line for line in run.stdout.splitlines() if line.startswith(" iteration ")]
    assert all("number of skipped iterations:" in line and "number of nan iterations:" in line for line in log)
