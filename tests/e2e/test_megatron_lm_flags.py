"""Megatron-LM flags that pass Megatron-LM's validation and then go wrong under a megatron_vshape schedule
(#35 item 4): each works, or is refused at argument validation with the reason and the fix.  Against the
stand-in always, and against a real Megatron-LM checkout (core_v0.16.1 to core_v0.19.0) when MEGATRON_LM_PATH is set.
Also bf16 through Megatron-LM's Float16Module on the V (#35 item 3), on the stand-in."""
import json
import os
import sys
from pathlib import Path

import pytest

from bounded_runs import run_bounded
from megatron_lm_runs import STANDIN, losses, reference_losses, run_launcher
from megatron_vshape.testing.tiny_gpt import TinyGPT

MLM = os.environ.get("MEGATRON_LM_PATH")
HERE = Path(__file__).resolve().parent
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--pipeline-model-parallel-size", "2"]
# What the real checkout needs besides (as tests/e2e/test_megatron_lm_real.py runs it on CPU).
REAL = ["--lr", "0.1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "63",
        "--make-vocab-size-divisible-by", "1", "--transformer-impl", "local", "--distributed-backend", "gloo",
        "--no-gradient-accumulation-fusion", "--use-cpu-initialization"]
V = ["--pipeline-schedule", "v-half"]

# (flags, what validation must say: None = accepted, else a fragment of the ConfigError)
CASES = {
    "replan-after": (V + ["--pipeline-replan-after", "2"], "not implemented under Megatron-LM's training loop"),
    "rampup too small": (["--pipeline-schedule", "1f1b-interleaved", "--rampup-batch-size", "2", "2", "100"],
                         "starts at 2 samples = 1 microbatches, which --pipeline-schedule 1f1b-interleaved cannot run"),
    "rampup fine": (V + ["--rampup-batch-size", "2", "2", "100"], None),
    "no-overlap-p2p at pp=2": (V + ["--no-overlap-p2p-communication"], None),
    "full-iteration graph": (V + ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
                             "would capture megatron_vshape's executor"),
    "per-layer graphs": (V + ["--cuda-graph-impl", "local"], "CUDA graphs (--cuda-graph-impl local) are not supported"),
    "per-layer graphs, deprecated flag": (V + ["--enable-cuda-graph"], "(--cuda-graph-impl local) are not supported"),
    "te graphs": (["--pipeline-schedule", "1f1b", "--cuda-graph-impl", "transformer_engine"],
                  "(--cuda-graph-impl transformer_engine) are not supported with --pipeline-schedule 1f1b"),
    "activation offloading": (V + ["--fine-grained-activation-offloading"], "reset by megatron-core's own schedules"),
    "yaml config": (V + ["--yaml-cfg", "model.yaml"], "--yaml-cfg is not supported with --pipeline-schedule v-half"),
    "megatron fsdp": (V + ["--use-megatron-fsdp"], "--use-megatron-fsdp is not supported with --pipeline-schedule"),
    "moe ep overlap": (V + ["--overlap-moe-expert-parallel-comm"], "silently lost"),
    "torch checkpoints on the V": (V + ["--ckpt-format", "torch"], "use --ckpt-format torch_dist"),
    "te userbuffers with W": (V + ["--tp-comm-overlap"], "unset --tp-comm-overlap"),
    "user delay_wgrad_compute": (V + ["--delay-wgrad-compute"], "set by megatron_vshape itself"),
}


def _validate(root, extra):
    # Megatron-LM ramps the batch size only in sample-based training.
    length = lambda flags: ["--train-samples", "64"] if "--rampup-batch-size" in flags else ["--train-iters", "2"]  # noqa: E731
    cases = [MODEL + extra + length(flags) + flags for flags, _ in CASES.values()]
    run = run_bounded([sys.executable, str(HERE / "megatron_lm_validate.py"), str(root), json.dumps(cases)], 240,
                      env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
    got = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('"')]
    assert len(got) == len(CASES), run.stdout[-3000:]
    return dict(zip(CASES, got))


def _check(results):
    wrong = {}
    for name, (_, want) in CASES.items():
        got = results[name]
        if (want is None and got != "ok") or (want is not None and want not in got):
            wrong[name] = got
    assert not wrong, json.dumps(wrong, indent=1)


@pytest.mark.timeout(300)
def test_each_flag_works_or_is_refused_at_validation_standin():
    _check(_validate(STANDIN.parent, []))


@pytest.mark.timeout(300)
@pytest.mark.skipif(not MLM or not (Path(MLM or ".") / "pretrain_gpt.py").is_file(),
                    reason="MEGATRON_LM_PATH is not set to a Megatron-LM checkout (core_v0.16.1 to core_v0.19.0)")
def test_each_flag_works_or_is_refused_at_validation_real_checkout():
    _check(_validate(MLM, REAL))


@pytest.mark.timeout(300)
def test_bf16_v_half_through_float16module():
    """Megatron-LM wraps each chunk in Float16Module, which upcasts the output of the last virtual stage of
    the last pipeline rank: on the V that is stage p, a middle stage, whose fp32 output the next stage's
    bf16 receive buffer would refuse.  Only stage 2p-1 may return fp32."""
    tiny = TinyGPT(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                   micro_batch_size=2, tied_embeddings=True)
    run = run_launcher(STANDIN, MODEL + ["--vocab-size", "64", "--train-iters", "2", "--lr", "0.1", "--bf16"] + V,
                       nproc=2, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    got = losses(run.stdout)
    assert len(got) == 2, run.stdout[-3000:]
    # bf16 weights and activations against the fp32 reference: close, not equal.
    assert got == pytest.approx(reference_losses(tiny, 4, 2, 0.1), rel=2e-2)
