"""A configuration mistake under torchrun, as a user sees it: one error line (not one per rank),
before torchrun's closing block, and that block names the same line as the root cause instead of
"<N/A>".  torchrun exits 1 whatever the rank's code (the README says so); the rank's own 2 shows in
the block."""
import pytest

from bounded_runs import pretrain

PREFIX = "megatron-vshape pretrain: error: "


@pytest.mark.timeout(200)
@pytest.mark.parametrize("argv, message", [
    (["--pipeline-schedule", "v-half", "--num-layers", "4", "--pipeline-layout", "1,1,1,1"],
     "--pipeline-layout 1,1,1,1 gives 4 stages; --pipeline-schedule v-half at pp=3 has 6"),  # found by validation
    (["--pipeline-schedule", "v-halff"], "--pipeline-schedule='v-halff' is not one of the choices"),  # by argparse
])
def test_a_configuration_error_under_torchrun_is_one_line_and_the_root_cause(argv, message):
    run = pretrain(["--mock-data", "--vocab-size", "63", "--pipeline-model-parallel-size", "3", "--global-batch-size",
                    "6", *argv], nproc=3, timeout=180)
    out = run.stdout + run.stderr
    ours = [line for line in out.splitlines() if line.startswith(PREFIX)]
    assert len(ours) == 1, out[-4000:]
    assert message in ours[0]
    assert run.returncode == 1  # torchrun's own code for any failed rank
    # torchrun's block follows the line and names it as the root cause, with the rank's exit code 2.
    root = out[out.index("Root Cause"):]
    assert out.index(ours[0]) < out.index("Root Cause")
    assert ours[0] in root and "exitcode  : 2" in root, root
