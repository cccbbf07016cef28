"""The pretraining driver as users run it: `torchrun scripts/pretrain_gpt.py` on megatron's
indexed .bin/.idx data with a --config file and a flag overriding it, the VSHAPE_METRICS /
VSHAPE_SUMMARY lines the SLURM report parses, configuration errors that exit 2 before any process
group exists, and `make demo`'s quickstart on 2 processes."""

import pytest

from bounded_runs import pretrain, tagged

# Per pipeline rank: the reserved peak (GPU; null on CPU), and activations and pipeline buffers at their peak.
MEMORY_KEYS = {"peak_reserved_bytes", "activations_at_peak_bytes", "pipeline_buffer_bytes_at_peak"}
METRICS_KEYS = {"iteration", "train_iters", "loss", "lr", "grad_norm", "iter_time_s", "tokens_per_s", "tflops_per_gpu",
                "mfu", "bubble_rate", "peak_activation_bytes", "peak_allocated_bytes", "skipped_iterations",
                "nan_iterations"} | MEMORY_KEYS
SUMMARY_KEYS = {"status", "schedule", "schedule_options", "pp", "tp", "dp", "world_size", "num_layers", "hidden_size", "seq_length",
                "micro_batch_size", "global_batch_size", "num_microbatches", "train_iters", "first_loss", "final_loss",
                "median_iter_time_s", "tokens_per_s", "tflops_per_gpu", "peak_activation_bytes", "peak_allocated_bytes",
                "measured_costs", "measured_bubble_rate", "config_name", "skipped_iterations", "nan_iterations"} | MEMORY_KEYS


def _write_indexed(prefix, vocab, documents=40, seed=0):
    """A tiny megatron indexed dataset: documents of counting token ids, written by megatron-core."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.int32)
    for _ in range(documents):
        start, length = int(rng.integers(0, vocab)), int(rng.integers(20, 80))
        builder.add_item(torch.tensor([(start + i) % (vocab - 1) for i in range(length)] + [vocab - 1]))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))


@pytest.mark.timeout(300)
def test_torchrun_on_indexed_data_with_a_config_file_and_an_overriding_flag(tmp_path):
    prefix = str(tmp_path / "tokens")
    _write_indexed(prefix, vocab=64)
    config = tmp_path / "tiny.yaml"
    config.write_text("\n".join([
        "num-layers: 4", "hidden_size: 32", "num-attention-heads: 4", "seq-length: 16", "micro-batch-size: 1",
        "global-batch-size: 4", "pipeline-model-parallel-size: 2", "pipeline-schedule: v-half", "train-iters: 4",
        "log-interval: 2", f"data-path: [{prefix}]", "split: 90,10,0", "vocab-size: 63", "tokenizer-type: NullTokenizer",
        "make-vocab-size-divisible-by: 1", "hidden-dropout: 0.0", "attention-dropout: 0.0", "lr: 0.003",
        "eval-interval: 2", "eval-iters: 1", f"data-cache-path: {tmp_path / 'cache'}"]) + "\n")
    run = pretrain(["--config", str(config), "--pipeline-schedule", "v-zb"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics, (summary,) = tagged(run.stdout, "VSHAPE_METRICS"), tagged(run.stdout, "VSHAPE_SUMMARY")
    assert [m["iteration"] for m in metrics] == [2, 4] and all(set(m) == METRICS_KEYS for m in metrics)
    assert set(summary) == SUMMARY_KEYS
    # The flag overrides the file; the rest comes from the file.
    assert (summary["schedule"], summary["pp"], summary["train_iters"], summary["num_microbatches"]) == ("v-zb", 2, 4, 4)
    assert summary["status"] == "ok" and summary["config_name"] == "tiny"
    assert len(summary["peak_activation_bytes"]) == 2 and all(summary["peak_activation_bytes"])
    assert all(summary["pipeline_buffer_bytes_at_peak"]) and all(summary["activations_at_peak_bytes"])
    assert set(summary["measured_costs"]) == {"F", "B", "W", "C"} and summary["measured_costs"]["W"] > 0
    assert run.stdout.count("validation loss at iteration") == 2
    assert " iteration        2/       4 |" in run.stdout and "lm loss:" in run.stdout


@pytest.mark.parametrize("argv, message", [
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "v-half", "--num-layers", "6",
      "--pipeline-layout", "1,1,1,1,1,1,1,1"], "--pipeline-layout 1,1,1,1,1,1,1,1 sums to 8 layers but --num-layers=6"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "1f1b-interleaved", "--num-layers", "8",
      "--global-batch-size", "2"], "raise --global-batch-size"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "v-min", "--num-layers", "8",
      "--decoder-first-pipeline-num-layers", "9"], "leave -1 layers for 7 other stage(s)"),
    (["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--fp16"], "--fp16 on CPU"),
    (["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--data-path", "x", "--mock-data"],
     "exactly one of --mock-data and --data-path"),
    (["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--config", "/nonexistent.yaml"], "/nonexistent.yaml"),
])
def test_bad_input_exits_2_before_any_process_group(capsys, monkeypatch, argv, message):
    import torch.distributed as dist

    from megatron_vshape.integration import train

    monkeypatch.setenv("WORLD_SIZE", "4")
    base = ["--vocab-size", "63"] + ([] if "--global-batch-size" in argv else ["--global-batch-size", "8"])
    assert train.main(argv + base + ([] if "--data-path" in argv else ["--mock-data"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-vshape pretrain: error: ") and message in err, err
    assert not dist.is_initialized()


def test_config_keys_are_flag_names_and_unknown_keys_are_refused(tmp_path):
    from megatron_vshape.integration import train
    from megatron_vshape.schedule.errors import ConfigError

    config = tmp_path / "c.yaml"
    config.write_text("num_layers: 12\nhidden-size: 48\nuntie-embeddings-and-output-weights: true\n"
                      "data-path: [1, a, 2, b]\n")
    args = train.parse_args(["--config", str(config), "--hidden-size", "96"])
    assert (args.num_layers, args.hidden_size, args.untie_embeddings_and_output_weights) == (12, 96, True)
    assert args.data_path == ["1", "a", "2", "b"] and args.config_name == "c"
    config.write_text("num-layer: 12\n")
    with pytest.raises(ConfigError, match="unknown key 'num-layer'"):
        train.parse_args(["--config", str(config)])


def test_the_script_itself_exits_2_on_a_configuration_error():
    run = pretrain(["--mock-data", "--vocab-size", "63", "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                    "nope"], nproc=1, timeout=120)
    assert run.returncode == 2 and "nope" in run.stderr and "v-half" in run.stderr


@pytest.mark.timeout(400)
def test_quickstart_on_two_processes(quickstart_pp2):
    """`make demo`'s script on the pp=2 tiny config with few iterations: picture, both runs, table
    (the session's one quickstart run, conftest.py)."""
    run, out = quickstart_pp2
    assert (out / "quickstart-v-half-pp2-m8.svg").exists()
    assert "iteration        3/       3" in run.stdout and "loss (v-half):" in run.stdout
    table = run.stdout[run.stdout.index("vs 1f1b peak"):].splitlines()[1:3]
    assert [line.split()[0] for line in table] == ["0", "1"]
    speed = run.stdout[run.stdout.index("3) speed"):].splitlines()
    assert "1 launches of 2 processes x 1 steps each" in speed[0] and "simulated vs 1f1b" in speed[1]
    rows = [line.split() for line in speed[2:5]]
    assert [r[0] for r in rows] == ["1f1b", "v-half", "v-zb"] and all(float(x) > 0 for r in rows for x in r[1:4])
