"""Our torch-csv export runs in torch.distributed.pipelining's `_PipelineScheduleRuntime`.

Two gloo ranks on 127.0.0.1 (one launch for every schedule) load the exported CSV with
`_load_csv`, run one step of a toy model (one Linear+Tanh per stage) and must reproduce the per-microbatch losses and every
gradient of a single-process reference.
"""
import pytest

from megatron_vshape.integration.launch import launch
from megatron_vshape.schedule import export, registry

PP, MICROBATCHES, WIDTH, MB_SIZE, SEED = 2, 4, 8, 3, 1234


def _toy(num_stages):
    import torch

    torch.manual_seed(SEED)
    layers = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(num_stages)]
    x = torch.randn(MICROBATCHES * MB_SIZE, WIDTH)
    y = torch.randn(MICROBATCHES * MB_SIZE, WIDTH)
    return layers, x, y


def _reference(num_stages):
    """Losses per microbatch and grads of the mean loss, on one process."""
    import torch

    layers, x, y = _toy(num_stages)
    losses = []
    for xb, yb in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
        h = xb
        for layer in layers:
            h = layer(h)
        losses.append(torch.nn.functional.mse_loss(h, yb))
    torch.stack(losses).mean().backward()
    grads = {s: [p.grad.clone() for p in layer.parameters()] for s, layer in enumerate(layers)}
    return [l.item() for l in losses], grads


def _pipeline_rank(rank, world_size, runs):
    """Each (name, csv_path, stage_ranks) in turn on the same two ranks: one spawn for every schedule."""
    import torch
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    out = {}
    for name, csv_path, stage_ranks in runs:
        num_stages = len(stage_ranks)
        layers, x, y = _toy(num_stages)
        mine = [s for s in range(num_stages) if stage_ranks[s] == rank]
        stages = [PipelineStage(layers[s], s, num_stages, torch.device("cpu")) for s in mine]
        schedule = _PipelineScheduleRuntime(stages, MICROBATCHES, loss_fn=torch.nn.functional.mse_loss)
        losses = []
        args = (x,) if 0 in mine else ()
        target = y if num_stages - 1 in mine else None
        try:
            schedule._load_csv(csv_path)
            schedule.step(*args, target=target, losses=losses)
        except Exception as e:  # the launch's error then names the schedule that failed
            raise RuntimeError(f"{name}'s CSV on rank {rank}: {e}") from e
        # Plain lists: tensors sent through the result queue would need the dead child's shared memory.
        grads = {s: [p.grad.tolist() for p in layers[s].parameters()] for s in mine}
        out[name] = {"losses": [float(l) for l in losses], "grads": grads}
    return out


NAMES = ["v-half", "v-min", "zb-h1", "1f1b"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (its schedule, each rank's losses and gradients)}, from one launch."""
    tmp, schedules, runs = tmp_path_factory.mktemp("torch_csv"), {}, []
    for name in NAMES:
        schedules[name] = schedule = registry.build(name, PP, MICROBATCHES)
        path = tmp / f"{name}.csv"
        export.write(schedule, str(path), "torch-csv")
        runs.append((name, str(path), [schedule.placement.rank_of(s) for s in range(schedule.num_stages)]))
    results = launch(_pipeline_rank, PP, (runs,), timeout=240, backend="gloo")
    return {name: (schedules[name], [r[name] for r in results]) for name in NAMES}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_exported_csv_runs_in_torch_pipelining(runs, name):
    import torch

    schedule, results = runs[name]
    stage_ranks = [schedule.placement.rank_of(s) for s in range(schedule.num_stages)]
    ref_losses, ref_grads = _reference(schedule.num_stages)
    last = stage_ranks[-1]
    assert results[last]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    seen = set()
    for out in results:
        for s, grads in out["grads"].items():
            seen.add(s)
            for got, want in zip(grads, ref_grads[s]):
                torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
    assert seen == set(range(schedule.num_stages))
