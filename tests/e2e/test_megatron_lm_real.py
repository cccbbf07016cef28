"""Against a real Megatron-LM checkout (MEGATRON_LM_PATH: core_v0.16.x, core_v0.17.x, core_v0.18.x, core_v0.19.x
or main), on CPU with gloo.

Megatron-LM's pretrain() cannot run on a CPU-only machine: initialize_megatron asserts
torch.cuda.is_available(), _initialize_distributed creates the model-parallel groups only when
torch.cuda.device_count() > 0, pretrain/get_model/DDP/the data loaders put tensors on 'cuda'.  So these
tests run Megatron-LM's own pieces that decide the pipeline, with install() applied, and step around
exactly these CUDA calls in the TEST (never in the hook): device_count reads 1 while the groups are
made, current_device names the CPU while the model is placed and batches are broadcast, the CUDA RNG seeding and the C++/fused-kernel compilation are skipped, Module.cuda/Tensor.cuda
keep tensors on CPU.  What runs is Megatron-LM's code: its parser and validate_args (through
parse_and_validate_args from core_v0.18), initialize_megatron with pretrain_gpt.get_embedding_ranks,
get_model with pretrain_gpt's model_provider and gpt_builder (layer spec from --spec) or, from core_v0.19,
the config-container path's GPTModelBuilder, get_forward_backward_func with the keywords that release
passes, pretrain_gpt.forward_step / get_batch / loss_func, and the schedule.

Python: Megatron-LM core_v0.18, core_v0.19 and main import typing.override (Python >= 3.12) in
megatron.training.models (hybrid.py from core_v0.18, gpt.py too from core_v0.19), which importing
megatron.training loads; this environment is Python 3.11.  SHIM below, in this test harness only,
gives typing a no-op `override` (a marker for type checkers; it changes no behaviour) before Megatron-LM
is imported.  The product never patches the standard library: on 3.11 install() refuses those releases
with a line that asks for Python 3.12.  What passes here for core_v0.18, core_v0.19 and main is proven under that shim.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bounded_runs import REPO
from megatron_lm_runs import reference_losses, run_launcher

MLM = os.environ.get("MEGATRON_LM_PATH")
pytestmark = pytest.mark.skipif(
    not MLM or not (Path(MLM) / "pretrain_gpt.py").is_file(),
    reason="MEGATRON_LM_PATH is not set to a Megatron-LM checkout (core_v0.16.x to main) holding pretrain_gpt.py")
# TEST HARNESS ONLY (see the module docstring): typing.override for Megatron-LM core_v0.18+ on Python 3.11.
SHIM = "import typing; typing.override = getattr(typing, 'override', lambda method: method)"


@pytest.fixture(autouse=True)
def checkout_first_on_path(monkeypatch):
    """The checkout's megatron.core, not the environment's: spawned ranks start from this sys.path."""
    monkeypatch.syspath_prepend(MLM)


def _checkout_release():
    """(major, minor) of the megatron-core release the checkout carries."""
    import re

    text = (Path(MLM) / "megatron" / "core" / "package_info.py").read_text()
    return tuple(int(re.search(rf"^{k} = (\d+)", text, re.M).group(1)) for k in ("MAJOR", "MINOR"))


# patches/ by the checkout's release (README's support table).
PATCHES = {(0, 16): "core_v0.16.1", (0, 17): "core_v0.16.1", (0, 18): "core_v0.18.2", (0, 19): "core_v0.18.2",
           (0, 20): "core_v0.18.2"}

LAYERS, HIDDEN, HEADS, SEQ, MBS, M, STEPS, LR = 4, 32, 4, 16, 2, 4, 2, 0.1
ARGS = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MBS),
        "--global-batch-size", str(MBS * M), "--train-iters", "2", "--lr", str(LR), "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--make-vocab-size-divisible-by", "1",
        "--transformer-impl", "local", "--spec", "megatron_lm_cpu_spec", "LAYER", "--distributed-backend", "gloo",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
        "--use-cpu-initialization", "--rerun-mode", "disabled", "--pipeline-model-parallel-size", "2"]


def _rank(rank, world, argv, mlm, steps, lr, builder=False):
    import inspect
    from functools import partial
    from unittest import mock

    import torch

    exec(SHIM)
    sys.path[:0] = [mlm, str(Path(__file__).parent)]
    import megatron_vshape

    megatron_vshape.install()
    import pretrain_gpt  # Megatron-LM's, imported after install() as the patch does
    from gpt_builders import gpt_builder
    from model_provider import model_provider
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine
    from megatron.training import arguments, get_args
    from megatron.training import training
    from megatron_vshape.integration.megatron_lm import current_plan
    from megatron_vshape.runtime.chunks import global_named_parameters
    from megatron_vshape.testing.tiny_gpt import TinyGPT, batch, load_weights, microbatch_loss, sgd_step

    sys.argv = ["pretrain_gpt.py", *argv]
    defaults = {"tokenizer_type": "GPT2BPETokenizer"}
    with mock.patch("torch.cuda.device_count", return_value=1), \
            mock.patch.object(tensor_parallel, "model_parallel_cuda_manual_seed"), \
            mock.patch("megatron.training.initialize._compile_dependencies"):
        if hasattr(arguments, "parse_and_validate_args"):  # core_v0.18 on: the script parses first
            arguments.parse_and_validate_args(args_defaults=defaults)
            training.initialize_megatron(allow_no_cuda=True, get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
        else:
            training.initialize_megatron(allow_no_cuda=True, args_defaults=defaults,
                                         get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
    args = get_args()
    cpu = mock.patch.object(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    with cpu, mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self), \
            mock.patch("torch.cuda.current_device", return_value="cpu"):
        groups = ProcessGroupCollection.use_mpu_process_groups()
        if builder:  # core_v0.19 on: pretrain's config-container path, which never calls get_model
            from megatron.training.argument_utils import gpt_config_from_args

            config = gpt_config_from_args(args)
            model = config.get_builder_cls()(config).build_distributed_models(groups, wrap_with_ddp=False)
        else:
            model = training.get_model(partial(model_provider, gpt_builder), ModelType.encoder_or_decoder,
                                       wrap_with_ddp=False)
        inner = [getattr(c, "module", c) for c in model]  # under --bf16/--fp16 each chunk is wrapped
        load_weights(inner, 1234)
        tiny = TinyGPT(num_layers=args.num_layers, hidden_size=args.hidden_size, vocab_size=args.padded_vocab_size,
                       seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
        # As this release's train() asks for it: with schedule_pg_collection from core_v0.19 on.
        takes_groups = "schedule_pg_collection" in inspect.signature(training.get_forward_backward_func).parameters
        forward_backward = training.get_forward_backward_func(**({"schedule_pg_collection": groups} if takes_groups
                                                                   else {}))
        rerun = get_rerun_state_machine()
        losses = []
        for step in range(steps):
            for chunk in model:
                chunk.zero_grad(set_to_none=True)
            iters = [RerunDataIterator(iter([batch(tiny, step, i) for i in range(M)])) for _ in model]
            while rerun.should_run_forward_backward(iters):  # as Megatron-LM's train_step calls it
                out = forward_backward(forward_step_func=pretrain_gpt.forward_step, data_iterator=iters, model=model,
                                       num_microbatches=M, seq_length=args.seq_length,
                                       micro_batch_size=args.micro_batch_size, decoder_seq_length=None,
                                       forward_only=False, adjust_tensor_shapes_fn=None, force_all_reduce=False,
                                       **({"pg_collection": groups} if takes_groups else {}))
            losses.append([microbatch_loss(d) for d in out] if out else None)
            sgd_step(model, lr)
    embd = parallel_state.get_embedding_group(check_initialized=False)
    import megatron.core

    return {
        "core": (megatron.core.__file__, megatron.core.package_info.__version__),
        "plan": current_plan().name, "vp": args.virtual_pipeline_model_parallel_size,
        "padded_vocab": args.padded_vocab_size, "fb": getattr(forward_backward, "__name__", ""),
        "chunks": [{"pre": c.pre_process, "post": c.post_process,
                    "layers": [l.layer_number for l in c.decoder.layers],
                    "output_weight_owned": c.post_process and c.output_layer.weight is not None} for c in inner],
        "wrappers": [type(c).__name__ for c in model],
        "tied_is_embedding": (inner[1].shared_embedding_or_output_weight() is inner[0].embedding.word_embeddings.weight
                              if rank == 0 else None),
        "embedding_group": torch.distributed.get_process_group_ranks(embd) if embd is not None else None,
        "losses": losses if rank == world - 1 else None,
        "params": sorted(n for c in inner for n, _ in global_named_parameters(c)),
    }


def _v_half_matches_unpipelined_model(builder=False):
    from megatron_vshape.integration.launch import launch
    from megatron_vshape.testing.tiny_gpt import TinyGPT

    r0, r1 = launch(_rank, 2, args=(ARGS + ["--pipeline-schedule", "v-half"], MLM, STEPS, LR, builder), timeout=280)
    assert (r0["plan"], r0["vp"], r0["fb"]) == ("v-half", 2, "forward_backward_v-half")
    assert r0["core"][0].startswith(str(Path(MLM).resolve())), r0["core"]  # the checkout's megatron-core ran
    print(f"megatron-core {r0['core'][1]} from {r0['core'][0]}")
    # Megatron-LM's get_model under the hook: rank 0 holds stages 0 and 3 (embedding and loss), rank 1 stages 1, 2.
    assert [(c["pre"], c["post"], c["layers"]) for c in r0["chunks"]] == [(True, False, [1]), (False, True, [4])]
    assert [(c["pre"], c["post"], c["layers"]) for c in r1["chunks"]] == [(False, False, [2]), (False, False, [3])]
    assert r0["tied_is_embedding"] is True and r0["chunks"][1]["output_weight_owned"] is False
    assert r0["embedding_group"] == [0]
    assert sorted(r0["params"] + r1["params"]) == sorted(set(r0["params"] + r1["params"]))  # each once
    tiny = TinyGPT(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=r0["padded_vocab"],
                   seq_length=SEQ, micro_batch_size=MBS, tied_embeddings=True)
    ref = reference_losses(tiny, M, STEPS, LR)  # token-weighted per step
    from megatron_vshape.testing.tiny_gpt import batch

    got = []
    for step, per_mb in enumerate(r1["losses"]):
        tokens = [float(batch(tiny, step, i)["loss_mask"].sum()) for i in range(M)]
        got.append(sum(l * t for l, t in zip(per_mb, tokens)) / sum(tokens))
    print(f"Megatron-LM pieces ({'builder' if builder else 'get_model'}), v-half pp=2: losses {got}; "
          f"without pipelining {ref}")
    assert got == pytest.approx(ref, rel=1e-6, abs=1e-6)


@pytest.mark.timeout(300)
def test_v_half_in_megatron_lm_pieces_matches_unpipelined_model():
    _v_half_matches_unpipelined_model()


@pytest.mark.timeout(300)
def test_v_half_through_the_model_builder_matches_unpipelined_model():
    """core_v0.19 and main: pretrain builds the model with GPTModelBuilder (config container), not get_model."""
    if _checkout_release() < (0, 19):
        pytest.skip("this Megatron-LM builds its models with get_model only (the model builder came in core_v0.19)")
    _v_half_matches_unpipelined_model(builder=True)


@pytest.mark.timeout(600)
def test_bf16_through_the_model_builder_trains_as_through_get_model():
    """core_v0.19 and main, --bf16: the builder path's fp16/bf16 wrapper is an argument, not training's global that
    get_model's hook swaps; on the V it must upcast only stage 2p-1's output (rank 0's chunk 1), or rank p-1 sends
    fp32 into a bf16 pipeline.  Both paths wrap alike and give the same bf16 losses."""
    from megatron_vshape.integration.launch import launch

    if _checkout_release() < (0, 19):
        pytest.skip("this Megatron-LM builds its models with get_model only (the model builder came in core_v0.19)")
    losses = {}
    for builder in (False, True):
        ranks = launch(_rank, 2, args=(ARGS + ["--pipeline-schedule", "v-half", "--bf16"], MLM, STEPS, LR, builder),
                       timeout=280)
        assert [r["wrappers"] for r in ranks] == [["VFloat16Module"] * 2] * 2, (builder, ranks)
        losses[builder] = ranks[1]["losses"]
    print(f"v-half pp=2 in bf16: losses through get_model {losses[False]}, through the builder {losses[True]}")
    assert all(math.isfinite(l) for step in losses[False] for l in step)
    assert losses[True] == losses[False]


VALIDATE = SHIM + """
import json, sys
sys.path.insert(0, sys.argv[1])
import megatron_vshape
megatron_vshape.install()
from megatron.training import arguments as initialize  # where every release's parser looks them up
from megatron_vshape import ConfigError
cases, base = json.loads(sys.argv[2]), json.loads(sys.argv[3])
for extra in cases:
    sys.argv = ["pretrain_gpt.py", *base, *extra]
    try:
        args = initialize.parse_args(None, False)
        initialize.validate_args(args, {})
        print("RESULT VP", args.virtual_pipeline_model_parallel_size, args.pipeline_schedule, flush=True)
    except ConfigError as e:
        print("RESULT CONFIGERROR", e, flush=True)
"""
CASES = [
    (["--pipeline-schedule", "v-zb"], "VP 2 v-zb"),
    (["--pipeline-schedule", "1f1b-interleaved", "--num-virtual-stages-per-pipeline-rank", "2"], "VP 2 1f1b-interleaved"),
    (["--pipeline-schedule", "zb-h1"], "VP None zb-h1"),
    ([], "VP None None"),
    (["--pipeline-schedule", "v-half", "--pipeline-layout", "1,2,1"],
     "CONFIGERROR --pipeline-layout 1,2,1 gives 3 stages; --pipeline-schedule v-half at pp=2 has 4"),
    (["--pipeline-schedule", "v-half", "--decoder-first-pipeline-num-layers", "2"], "VP 2 v-half"),
    (["--pipeline-schedule", "v-half", "--num-layers", "7", "--pipeline-layout", "3,1,2,1"], "VP 2 v-half"),
    (["--pipeline-schedule", "1f1b", "--num-layers", "7"], "VP None 1f1b"),
    (["--pipeline-schedule", "v-min", "--num-virtual-stages-per-pipeline-rank", "3"],
     "CONFIGERROR --pipeline-schedule v-min holds 2 stage(s) per rank but the virtual pipeline size is 3"),
]


@pytest.fixture(scope="module")
def validated():
    """Megatron-LM's own parse_args and validate_args (no CUDA needed there) through install()'s wrappers,
    once per case in one process (importing Megatron-LM is the slow part)."""
    import json

    run = subprocess.run([sys.executable, "-c", VALIDATE, MLM, json.dumps([c for c, _ in CASES]), json.dumps(ARGS)],
                         cwd=REPO, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, RANK="0", WORLD_SIZE="2",
                                  PYTHONPATH=os.pathsep.join([str(REPO), str(Path(__file__).parent)])))
    results = [l[len("RESULT "):] for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(results) == len(CASES), (run.stdout[-2000:], run.stderr[-3000:])
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(c) or "no-schedule" for c, _ in CASES])
def test_megatron_lm_parse_and_validate_args_with_the_hook(validated, case):
    assert validated[case].startswith(CASES[case][1])


HARNESS_SHIM = Path(__file__).parent / "python312_shim"  # sitecustomize.py: SHIM for a subprocess


@pytest.mark.timeout(300)
def test_real_pretrain_gpt_refuses_a_bad_layout_at_argument_time():
    """The launcher with Megatron-LM's real pretrain_gpt.py: ConfigError from Megatron-LM's own parse step."""
    import torch

    args = ARGS + ["--pipeline-layout", "1,2,1"]
    release, old_python = _checkout_release(), sys.version_info < (3, 12)

    def launch(*shim):
        return run_launcher(Path(MLM) / "pretrain_gpt.py", args + ["--pipeline-schedule", "v-min"], nproc=0,
                            timeout=180, env={"RANK": "0", "WORLD_SIZE": "2"},
                            extra_path=os.pathsep.join([str(Path(__file__).parent), *shim]))

    if release >= (0, 18) and old_python:
        # Without the harness shim, as a user on 3.11 runs it: install() refuses this Megatron-LM in one line.
        run = launch()
        assert run.returncode == 2 and "needs Python >= 3.12 (typing.override" in run.stderr, run.stderr[-2000:]
    run = launch(str(HARNESS_SHIM)) if old_python else launch()
    # Up to core_v0.17 initialize_megatron parses the arguments, after asserting CUDA; from core_v0.18 the
    # script's parse_and_validate_args parses them first.
    if release < (0, 18) and not torch.cuda.is_available():
        assert run.returncode != 0 and "Megatron requires CUDA" in run.stderr, run.stderr[-2000:]
        pytest.skip("Megatron-LM's initialize_megatron asserts torch.cuda.is_available() before parsing arguments")
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--pipeline-layout 1,2,1 gives 3 stages" in run.stderr


def test_patch_applies_to_pretrain_gpt():
    patch = REPO / "patches" / f"megatron-lm-{PATCHES[_checkout_release()]}-pretrain_gpt.patch"
    run = subprocess.run(["git", "apply", "--check", "-p1", str(patch)], cwd=MLM, capture_output=True, text=True)
    if run.returncode and "already" not in run.stderr:
        applied = "megatron_vshape.install()" in (Path(MLM) / "pretrain_gpt.py").read_text()
        assert applied, run.stderr
