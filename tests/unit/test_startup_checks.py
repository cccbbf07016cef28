"""The pretraining driver's start-up checks, before any process group or model: an unwritable
--save, a --data-path without its .bin/.idx, numeric flags out of range named with their value,
cross-flag messages that blame the flag that is wrong, a binary --config, and the hints that name
the driver's own flags."""
import pytest

from megatron_vshape.integration import train
from megatron_vshape.schedule.errors import ConfigError

BASE = ["--mock-data", "--vocab-size", "63", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
        "--global-batch-size", "4"]


def _validate(*argv, world_size=2):
    return train.validate(train.parse_args(BASE + list(argv)), world_size=world_size)


def test_an_unwritable_save_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(train, "build_model", lambda *a, **k: built.append(1))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=f"--save {blocker}/ckpt: cannot write there: {blocker} is a file"):
        _validate("--save", str(blocker / "ckpt"))
    assert train.main(BASE + ["--save", str(blocker / "ckpt")]) == 2 and not built
    _validate("--save", str(tmp_path / "new" / "ckpt"))  # a directory that can be made is fine
    with pytest.raises(ConfigError, match="--data-cache-path"):
        _validate("--data-cache-path", str(blocker / "cache"))


def test_data_path_prefixes_need_their_bin_and_idx(tmp_path):
    prefix = str(tmp_path / "tokens")
    open(prefix + ".bin", "wb").close()
    argv = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(ConfigError, match=rf"--data-path {prefix}: {prefix}\.idx does not exist"):
        train.validate(train.parse_args(argv + ["--data-path", prefix]), world_size=2)
    open(prefix + ".idx", "wb").close()
    with pytest.raises(ConfigError, match=r"/nonexistent\.bin and /nonexistent\.idx do not exist"):
        train.validate(train.parse_args(argv + ["--data-path", "0.5", prefix, "0.5", "/nonexistent"]), world_size=2)


@pytest.mark.parametrize("argv, message", [
    (["--vocab-size", "0"], "--vocab-size=0 must be a whole number >= 1"),
    (["--lr", "-1"], "--lr=-1.0 must be a finite number >= 0"),
    (["--lr", "nan"], "--lr=nan must be a finite number >= 0"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout=1.5 must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps=0.0 must be a finite number > 0"),
    (["--lr-warmup-iters", "-2"], "--lr-warmup-iters=-2 must be a whole number >= 0"),
    (["--save-interval", "0", "--save", "x"], "--save-interval=0 must be a whole number >= 1"),
    # cross-flag: the flag that is out of line, and how to fix it
    (["--lr", "1e-4", "--min-lr", "3e-4"], "--min-lr=0.0003 is above --lr=0.0001"),
    (["--train-iters", "2", "--lr-warmup-iters", "2"],
     "--lr-warmup-iters=2 must be below the decay iterations (--train-iters=2); lower --lr-warmup-iters to at most 1"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], "--max-position-embeddings=32 is below --seq-length=64"),
    (["--load-fallback"], "--load-fallback needs --load DIR"),
    (["--save-retain", "2"], "--save-retain=2 needs --save DIR"),
    (["--load", "/nonexistent/ckpt"], "no checkpoint to load at /nonexistent/ckpt"),
    (["--pipeline-schedule", "auto", "--pipeline-memory-budget", "0.3", "--pipeline-model-parallel-size", "4",
      "--num-layers", "8", "--global-batch-size", "8"],
     "no schedule fits --pipeline-memory-budget 0.3 at pp=4, microbatches=8"),
])
def test_each_flag_is_named_with_its_value(argv, message):
    with pytest.raises(ConfigError) as e:
        _validate(*argv, world_size=4 if "4" in argv[-5:] and "auto" in argv else 2)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_budget_below_v_mins_floor_asks_for_a_budget_not_microbatches():
    with pytest.raises(ConfigError) as e:
        _validate("--pipeline-schedule", "auto", "--pipeline-memory-budget", "0.3", "--pipeline-model-parallel-size",
                  "4", "--num-layers", "8", "--global-batch-size", "8", world_size=4)
    assert "raise --pipeline-memory-budget to at least 0.5" in str(e.value) and "add microbatches" not in str(e.value)


def test_a_binary_config_file_is_one_line(tmp_path):
    config = tmp_path / "model.yaml"
    config.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError) as e:
        train.parse_args(["--config", str(config)])
    assert str(e.value).startswith(f"--config {config}: ") and "\n" not in str(e.value)

