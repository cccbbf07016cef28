"""`megatron-vshape verify`: run a schedule on a tiny GPT and prove it exact, and measure memory.

Spawns pp*tp ranks (gloo on CPU, NCCL when there are enough GPUs), runs --steps steps of the
tiny GPT under --schedule and, on one rank, without pipelining from the same weights and data,
and prints the largest loss and gradient differences and each pipeline rank's measured peak
activation memory (bytes of tensors saved for backward) next to 1F1B's on the same model and
the simulator's prediction.  Exit status: 0 when exact within --tolerance, 1 when not or when a
rank fails (never a hang: every launch has a time bound), 2 for a configuration it cannot run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..argtypes import Parser, nonnegative_float, nonnegative_int, positive_float, positive_int, \
    quiet_megatron_notices

BASELINE = "1f1b"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `verify` (torch-free, so `--help` is fast); a bad value is refused while parsing."""
    parser.add_argument("--schedule", default="v-half", help="schedule name (see `megatron-vshape plan --help`)")
    parser.add_argument("--pp", type=positive_int, default=2, help="pipeline-parallel size")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    parser.add_argument("--microbatches", type=positive_int, default=None, help="microbatches per step (default 2*pp)")
    parser.add_argument("--num-layers", type=positive_int, default=None,
                        help="transformer layers (default: two per stage of the schedule's placement)")
    parser.add_argument("--pipeline-layout", default=None, metavar="N0,N1,...",
                        help="layers of each stage in model order (default: an even split, remainder in the middle)")
    parser.add_argument("--hidden-size", type=positive_int, default=32)
    parser.add_argument("--num-attention-heads", type=positive_int, default=4)
    parser.add_argument("--vocab-size", type=positive_int, default=64)
    parser.add_argument("--seq-length", type=positive_int, default=16)
    parser.add_argument("--micro-batch-size", type=positive_int, default=2)
    parser.add_argument("--tied-embeddings", action="store_true", help="share input embedding and output weights")
    parser.add_argument("--steps", type=positive_int, default=1, help="training steps (SGD between steps)")
    parser.add_argument("--lr", type=nonnegative_float, default=0.05, help="SGD learning rate between steps")
    parser.add_argument("--seed", type=nonnegative_int, default=1234)
    parser.add_argument("--tolerance", type=nonnegative_float, default=1e-6,
                        help="largest accepted loss difference and gradient difference relative to the largest "
                             "reference gradient")
    parser.add_argument("--timeout", type=positive_float, default=600.0,
                        help="seconds for each launch of ranks, from the moment their process groups are ready")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


# ---- validation (parent process, before any rank starts) ----------------------------------------

def _plan(args):
    """(schedule, tiny model, backend) for the arguments, or ConfigError naming the fix."""
    from ..schedule import layout, registry
    from ..schedule.errors import ConfigError
    from ..testing.tiny_gpt import TinyGPT
    from .launch import default_backend

    # Callers other than the parser (tests, scripts) get the same refusal as the command line.
    for name in ("pp", "tp", "steps", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                 "micro_batch_size", "microbatches", "num_layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value} must be >= 1")
    for name, low in (("tolerance", 0.0), ("lr", 0.0)):
        if not getattr(args, name) >= low:
            raise ConfigError(f"--{name}={getattr(args, name)} must be a number >= {low:g}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout={args.timeout} must be > 0 seconds")
    m = 2 * args.pp if args.microbatches is None else args.microbatches
    schedule = registry.build(args.schedule, args.pp, m)
    stages = schedule.placement.num_stages
    text = getattr(args, "pipeline_layout", None)
    stage_layers = layout.parse(text) if text else None
    layers = args.num_layers or (sum(stage_layers) if stage_layers else 2 * stages)
    if stage_layers:
        layout.check(stage_layers, layers, schedule.placement, args.schedule, "--pipeline-layout", text)
    else:
        layout.even_split(layers, schedule.placement, args.schedule)
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size={args.hidden_size} is not divisible by --num-attention-heads="
                          f"{args.num_attention_heads}")
    for name in ("num_attention_heads", "vocab_size"):
        if getattr(args, name) % args.tp:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} is not divisible by --tp={args.tp}")
    world = args.pp * args.tp
    backend = default_backend(world) if args.backend == "auto" else args.backend
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < world:
            raise ConfigError(f"--backend nccl needs {world} GPUs (pp*tp), found {torch.cuda.device_count()}")
    tiny = TinyGPT(num_layers=layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                   vocab_size=args.vocab_size, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                   tied_embeddings=args.tied_embeddings, seed=args.seed, pipeline_layout=stage_layers)
    return schedule, tiny, backend


# ---- ranks -------------------------------------------------------------------------------------

def _reference_rank(rank, world_size, tiny, m, steps, lr):
    from ..testing.tiny_gpt import reference_run

    return reference_run(tiny, m, steps=steps, lr=lr)


def run_schedule(tiny, name, pp, tp, m, steps, lr, timeout, collect):
    """Inside a launched rank: build the tiny GPT's chunks for schedule `name`, run `steps` steps
    (SGD with `lr` between them) and return this rank's losses, gradients (when `collect`), measured
    peak activation bytes and per-stage activation bytes."""
    import torch
    from megatron.core import parallel_state

    from ..runtime.chunks import allreduce_tied_embedding
    from ..runtime.executor import get_forward_backward_func
    from ..runtime.stats import Recorder
    from ..schedule import registry
    from ..testing.tiny_gpt import build_chunks, data_iterators, forward_step, init_parallel, microbatch_loss, \
        named_grads, sgd_step

    placement = registry.build(name, pp, m).placement
    init_parallel(tp, pp, placement, seed=tiny.seed)
    chunks = build_chunks(tiny, placement, tp=tp)
    recorder = Recorder()
    step_fn = get_forward_backward_func(name, stats=recorder, p2p_timeout=timeout)
    losses, grads = [], []
    for step in range(steps):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        out = step_fn(forward_step_func=forward_step, data_iterator=data_iterators(tiny, step, m, len(chunks)),
                      model=chunks, num_microbatches=m, seq_length=tiny.seq_length,
                      micro_batch_size=tiny.micro_batch_size, forward_only=False)
        # Tied embeddings on single/loop placements: first and last rank sum their gradients, as
        # megatron-core's finalize_model_grads does (here over gloo too).
        allreduce_tied_embedding(chunks)
        losses.append([microbatch_loss(d) for d in out])
        if collect:
            grads.append(named_grads(chunks))
        sgd_step(chunks, lr)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    result = {
        "pp_rank": pp_rank, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "losses": losses if pp_rank == pp - 1 and parallel_state.get_tensor_model_parallel_rank() == 0 else None,
        "grads": grads, "peak_bytes": recorder.peak_bytes,
        "stage_bytes": _stage_activation_bytes(tiny, chunks, placement, pp_rank),
    }
    del chunks, step_fn, recorder
    torch.distributed.barrier()
    return result


def _stage_activation_bytes(tiny, chunks, placement, pp_rank):
    """{stage: bytes autograd saves in one forward of one microbatch of that stage}, measured alone."""
    import torch

    from ..runtime.stats import Recorder
    from ..testing.tiny_gpt import batch, forward_step

    out = {}
    for chunk, stage in zip(chunks, placement.stages_of(pp_rank)):
        recorder = Recorder()
        recorder.exclude_parameters(p for c in chunks for p in c.parameters())
        x = None
        if stage:
            shape = (tiny.seq_length, tiny.micro_batch_size, tiny.hidden_size)
            x = torch.zeros(shape, device=next(chunk.parameters()).device, requires_grad=True)
        chunk.set_input_tensor(x)
        with recorder.saved_tensors():
            output, loss_func = forward_step(iter([batch(tiny, 0, 0)]), chunk)
            if stage == placement.num_stages - 1:
                output = loss_func(output)[0]
        out[stage] = recorder.current_bytes
        del output, loss_func, x
    return out


def _pipeline_rank(rank, world_size, tiny, name, pp, tp, m, steps, lr, timeout):
    from ..testing.tiny_gpt import portable

    result = run_schedule(tiny, name, pp, tp, m, steps, lr, timeout, collect=True)
    # 1F1B on the same model (its own even split: a layout names the schedule's stages), one step: the memory baseline.
    baseline = run_schedule(dataclasses.replace(tiny, pipeline_layout=None), BASELINE, pp, tp, m, 1, 0.0, timeout,
                            collect=False)
    result["peak_bytes_1f1b"] = baseline["peak_bytes"]
    result["stage_bytes_1f1b"] = baseline["stage_bytes"]
    return portable(result)


# ---- report ------------------------------------------------------------------------------------

def summarize(schedule, reference, results, tolerance) -> dict:
    from ..schedule.simulate import peak_activations, peak_vs_1f1b
    from ..testing.tiny_gpt import compare

    diffs = compare(reference, results)
    pp = schedule.pp
    by_pp = {}
    for r in results:
        if r["tp_rank"] == 0:
            by_pp[r["pp_rank"]] = r
    peak = [by_pp[r]["peak_bytes"] for r in range(pp)]
    peak_1f1b = [by_pp[r]["peak_bytes_1f1b"] for r in range(pp)]
    stage_bytes = {int(s): b for r in by_pp.values() for s, b in r["stage_bytes"].items()}
    # One stage-activation: a stage with transformer layers only (no embedding, no head).
    middle = [b for s, b in stage_bytes.items() if 0 < s < schedule.num_stages - 1]
    unit = middle[0] if middle else max(stage_bytes.values())
    units = peak_activations(schedule)
    out = dict(diffs)
    out.update({
        "peak_activation_bytes": peak,
        "peak_activation_bytes_1f1b": peak_1f1b,
        "peak_vs_1f1b": [p / peak_1f1b[0] if peak_1f1b[0] else None for p in peak],
        "stage_activation_bytes": unit,
        "predicted_peak_activations": units,
        "predicted_peak_bytes": [u * unit for u in units],
        "predicted_peak_bytes_by_stage": peak_activations(schedule, stage_bytes),
        "predicted_peak_vs_1f1b": peak_vs_1f1b(schedule, units),
    })
    out["ok"] = bool(diffs["max_abs_loss_diff"] <= tolerance and diffs["max_rel_grad_diff"] <= tolerance)
    return out


def _layout_text(tiny, placement) -> str:
    from ..schedule.layout import describe

    return f" (per stage {describe(tiny.pipeline_layout, placement)})" if tiny.pipeline_layout else ""


def _print_table(args, schedule, tiny, backend, s) -> None:
    p = schedule.placement
    print(f"megatron-vshape verify: {schedule.name} pp={p.pp} tp={args.tp} microbatches={schedule.microbatches} "
          f"layers={tiny.num_layers}{_layout_text(tiny, p)} hidden={tiny.hidden_size} "
          f"tied={'yes' if tiny.tied_embeddings else 'no'} "
          f"steps={args.steps} backend={backend}")
    print(f"  max |loss diff|      {s['max_abs_loss_diff']:.3e}   (per-microbatch losses vs. no pipelining)")
    print(f"  max |grad diff|      {s['max_abs_grad_diff']:.3e}")
    print(f"  max rel grad diff    {s['max_rel_grad_diff']:.3e}   (relative to the largest reference gradient)")
    print(f"  peak activation memory per pipeline rank (bytes saved for backward; one stage-activation = "
          f"{s['stage_activation_bytes']} B):")
    print(f"    {'rank':>4} {schedule.name:>12} {BASELINE:>12} {'vs 1f1b r0':>10} {'sim units':>9} "
          f"{'sim bytes':>12} {'measured/sim':>12}")
    for r in range(p.pp):
        pred = s["predicted_peak_bytes"][r]
        print(f"    {r:>4} {s['peak_activation_bytes'][r]:>12} {s['peak_activation_bytes_1f1b'][r]:>12} "
              f"{s['peak_vs_1f1b'][r]:>10.3f} {s['predicted_peak_activations'][r]:>9} {pred:>12} "
              f"{s['peak_activation_bytes'][r] / pred if pred else float('nan'):>12.3f}")
    print(f"  {'OK' if s['ok'] else 'FAIL'}: tolerance {args.tolerance:g}")


def run(args) -> int:
    """Run `verify`; returns the exit status."""
    from ..schedule.errors import ConfigError
    from .launch import LaunchError, launch

    quiet_megatron_notices()  # also reaches the ranks, which import megatron-core while starting
    try:
        schedule, tiny, backend = _plan(args)
    except ConfigError as e:
        print(f"megatron-vshape verify: error: {e}", file=sys.stderr)
        return 2
    m = schedule.microbatches
    try:
        (reference,) = launch(_reference_rank, 1, (tiny, m, args.steps, args.lr), timeout=args.timeout,
                              backend=backend)
        results = launch(_pipeline_rank, args.pp * args.tp,
                         (tiny, args.schedule, args.pp, args.tp, m, args.steps, args.lr, args.timeout),
                         timeout=args.timeout, backend=backend)
    except LaunchError as e:
        print(f"megatron-vshape verify: {e}", file=sys.stderr)
        return 1
    summary = summarize(schedule, reference, results, args.tolerance)
    if args.json:
        head = {"schedule": schedule.name, "pp": args.pp, "tp": args.tp, "microbatches": m,
                "num_layers": tiny.num_layers, "pipeline_layout": tiny.pipeline_layout, "hidden_size": tiny.hidden_size,
                "tied_embeddings": tiny.tied_embeddings, "steps": args.steps, "backend": backend}
        print(json.dumps({**head, **summary}))
    else:
        _print_table(args, schedule, tiny, backend, summary)
    return 0 if summary["ok"] else 1


def main(argv=None) -> int:
    parser = add_arguments(Parser(prog="megatron-vshape verify", description=__doc__.split("\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
