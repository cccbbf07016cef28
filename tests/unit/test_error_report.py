"""How the driver reports a failure under torchrun, without starting one: torchrun's environment
(RANK, WORLD_SIZE, TORCHELASTIC_ERROR_FILE) is set and the run raises.  A p2p timeout is one line
naming the rank, op and peer (no traceback); a crash is its traceback then one line naming the
rank; an error every rank shares is printed by rank 0 only; and the error file is one that
torchrun's own ProcessFailure reads back as the message it prints as the root cause."""
import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megatron_vshape.integration import errors, train
from megatron_vshape.runtime.p2p import P2PTimeout

ARGV = ["--mock-data", "--vocab-size", "63", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "v-half", "--global-batch-size", "4"]


@pytest.fixture
def torchrun_rank(monkeypatch, tmp_path):
    def set_rank(rank):
        path = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        monkeypatch.setattr(errors, "SHARED_ERROR_WAIT_S", 0.0)
        monkeypatch.setattr(train, "init_distributed", lambda: None)
        return path
    return set_rank


def _root_cause(path):
    return ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path)).message


def test_a_p2p_timeout_is_one_line_with_rank_op_peer_and_the_flag(torchrun_rank, monkeypatch, capsys):
    path = torchrun_rank(1)
    message = ("rank 1: F0@2 waiting to receive act0:1->2 from rank 0: nothing arrived within 3s "
               "(raise --pipeline-p2p-timeout, or get_forward_backward_func's p2p_timeout, to wait longer)")

    def stalled(args, plan):
        raise P2PTimeout(message)

    monkeypatch.setattr(train, "run", stalled)
    assert train.main(ARGV) == 1
    err = capsys.readouterr().err
    assert err == f"megatron-vshape pretrain: error: {message}\n"
    assert _root_cause(path)["message"] == err.strip()


def test_a_crash_keeps_its_traceback_and_ends_with_one_line_naming_the_rank(torchrun_rank, monkeypatch, capsys):
    path = torchrun_rank(1)

    def crash(args, plan):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(train, "run", crash)
    assert train.main(ARGV) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("Traceback") and err[-1] == \
        "megatron-vshape pretrain: error: rank 1: RuntimeError: Connection closed by peer"
    assert _root_cause(path)["message"] == err[-1]


@pytest.mark.parametrize("rank", [0, 1])
def test_an_error_every_rank_finds_is_printed_by_rank_0_only(torchrun_rank, capsys, rank):
    path = torchrun_rank(rank)
    assert train.main(ARGV + ["--pipeline-layout", "1,2,1"]) == 2
    err = capsys.readouterr().err
    assert (err.count("megatron-vshape pretrain: error: ") == 1) == (rank == 0), err
    # Only rank 0 writes torchrun's error file: another rank's copy could carry an earlier second
    # and be named root cause, with its SIGTERM exit code.
    if rank == 0:
        assert "--pipeline-layout 1,2,1 gives 3 stages" in _root_cause(path)["message"]
    else:
        assert not path.exists()
