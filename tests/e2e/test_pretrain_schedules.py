"""The pretraining driver on every way it builds and trains a pipeline, tied embeddings (Megatron's
default), on 4 gloo ranks, against the same run without pipelining (pp=1, one rank): same flags,
seed and mock data, so the per-iteration losses must agree.

The driver's paths differ by placement (single, loop, V), by the backward (BW, or B/W split) and by
planning on every rank (v-auto): one schedule per path at pp=4, two data-parallel pipelines, and
uneven stages.  That every registered schedule computes the unpipelined model's gradients is
test_executor_gpt's and test_executor_linear's job; the driver hands the name to the executor.

Three AdamW iterations with gradient clipping (the first at learning rate 0: Megatron's warm-up
starts there); the global gradient norm of every iteration is compared too.  Losses are not bitwise equal: a tied embedding's
gradient adds its two uses in a different order when they live on different ranks or ops, and
data-parallel replicas sum in another order; 1e-5 relative is far below one optimizer step's
change (the loss moves by ~1e-2 per iteration here), so a wrong gradient anywhere fails it.
One launch runs every schedule (spawning dominates the cost on small machines).
"""
import pytest

from megatron_vshape.integration.launch import launch
from megatron_vshape.schedule import registry

FLAGS = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-2",
         "--lr-warmup-iters", "1", "--mock-data", "--vocab-size", "63", "--make-vocab-size-divisible-by", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "3"]
RTOL = 1e-5
# One schedule per path through the driver: single placement with BW and with B/W split, loop, the V
# (split), and the V planned on every rank under a memory budget.
PATHS = ["1f1b", "zb-h1", "1f1b-interleaved", "v-half", "v-auto"]


def _plan(argv, world_size):
    from megatron_vshape.integration import train

    args = train.parse_args(argv)
    return args, train.validate(args, world_size=world_size)


def _runs(rank, world_size, cases):
    from megatron_vshape.argtypes import quiet_megatron_notices
    from megatron_vshape.integration import train

    quiet_megatron_notices()
    out = {}
    for label, argv in cases:
        args, plan = _plan(argv, world_size)
        summary = train.run(args, plan)
        out[label] = summary
    return out


def _cases(world_size):
    # v-auto under half of 1F1B's activation memory (V-Min's floor at pp=4), not its default budget 1.0.
    budget = {"v-auto": ["--pipeline-memory-budget", "0.5"]}
    cases = [(name, FLAGS + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", name] + budget.get(name, []))
             for name in PATHS]
    # Data parallelism: two pipelines of two ranks, gradients averaged over the replicas.
    cases.append(("v-half pp=2 dp=2", FLAGS + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "v-half"]))
    cases.append(("1f1b pp=2 dp=2", FLAGS + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]))
    # Uneven stages: a layout flag, and Megatron's first/last flags on the V (stage 0 and stage 2p-1, on rank 0).
    cases.append(("v-zb pp=2 dp=2 --pipeline-layout 3,1,2,2",
                  FLAGS + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "v-zb",
                           "--pipeline-layout", "3,1,2,2"]))
    cases.append(("v-half pp=4 first/last 0", FLAGS + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                                                       "v-half", "--decoder-first-pipeline-num-layers", "0",
                                                       "--decoder-last-pipeline-num-layers", "0"]))
    cases.append(("1f1b pp=4 --pipeline-layout 1,3,3,1", FLAGS + ["--pipeline-model-parallel-size", "4",
                                                                  "--pipeline-schedule", "1f1b",
                                                                  "--pipeline-layout", "1,3,3,1"]))
    return cases


def test_the_paths_cover_every_placement_and_backward():
    """PATHS stays one per path as schedules are added: every (placement, split backward) that a
    registered schedule has at pp=4 is among them."""
    def path(name):
        s = registry.build(name, 4, 8)
        return s.placement.kind, s.split_backward

    assert {path(n) for n in registry.names()} == {path(n) for n in PATHS}


@pytest.mark.timeout(600)
def test_every_driver_path_trains_tied_like_the_model_without_pipelining():
    cases = _cases(4)
    for _, argv in cases:  # validated in the parent, before any process group, as the driver does
        _, plan = _plan(argv, 4)
        if plan.name == "v-auto":
            assert plan.options == {"memory_budget": 0.5} and plan.schedule.memory_budget == 0.5
    (reference,) = launch(_runs, 1, ([("reference", FLAGS)],), timeout=300)
    results = launch(_runs, 4, (cases,), timeout=500)
    want = reference["reference"]
    assert len(want["losses"]) == 3
    wrong = []
    for label, _ in cases:
        got = results[0][label]
        assert got["status"] == "ok" and got["schedule"] == label.split()[0]
        worst = {}
        for key in ("losses", "grad_norms"):
            for it, (a, b) in enumerate(zip(got[key], want[key], strict=True)):
                worst[key] = max(worst.get(key, 0.0), abs(a - b) / abs(b))
                if abs(a - b) > RTOL * abs(b):
                    wrong.append(f"{label}: iteration {it + 1} {key[:-1]} {a!r}, without pipelining {b!r}")
        print(f"{label:>18}: max relative difference: loss {worst['losses']:.1e}, grad norm {worst['grad_norms']:.1e}")
        # Every pipeline rank measured its activations.
        assert len(got["peak_activation_bytes"]) == got["pp"] and all(got["peak_activation_bytes"])
    assert not wrong, "\n".join(wrong)
