"""`--pipeline-schedule` and its options, and their validation before any process group exists.

Shared by the training driver (`integration/train.py`) and the Megatron-LM hook, which both call
them on a parser that already holds Megatron-LM's flags:

    add_pipeline_arguments(parser)        # adds only --pipeline-* options
    plan = validate_pipeline_args(args)   # a Namespace with Megatron-LM attribute names

`validate_pipeline_args` reads Megatron-LM's attribute names (num_layers,
pipeline_model_parallel_size, tensor_model_parallel_size, context_parallel_size,
micro_batch_size, global_batch_size, data_parallel_size or world_size,
virtual_pipeline_model_parallel_size, num_layers_per_virtual_pipeline_stage,
microbatch_group_size_per_vp_stage, decoder_first/last_pipeline_num_layers,
account_for_embedding/loss_in_pipeline_split, pipeline_model_parallel_layout, transformer_impl,
mtp_num_layers, ...; a missing one counts as unset), builds the schedule exactly as every rank
will, and raises ConfigError naming the value and the fix.  It imports no torch and changes
nothing in `args`; the caller applies `PipelinePlan.virtual_pipeline_model_parallel_size`.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

from ..schedule import registry
from ..planner.choose import fastest_within
from ..planner.search import MAX_BUDGET, min_budget
from ..schedule.errors import ConfigError
from ..schedule.ops import Costs, Schedule
from ..schedule.simulate import peak_activations, peak_vs_1f1b

AUTO = "auto"
# Transformer Engine release from which the B/W split works with its layers (README, "Transformer Engine").
TE_MIN_FOR_SPLIT = (2, 8)
# Why older ones cannot, by the release that fixed it (read in TE's source history).
TE_SPLIT_HISTORY = (
    ((2, 3), "layers cannot defer their weight gradient (delay_wgrad_compute and backward_dw() came in 2.3)"),
    ((2, 7), "backward_dw() fires no gradient hook, so megatron-core's DDP never sees the deferred gradients "
             "(register_wgrad_accumulation_and_reduce_hooks came in 2.7)"),
    ((2, 8), "backward_dw() keeps a stale .grad and LayerNormMLP/GroupedLinear give DDP's hook no gradient "
             "on the fused path (fixed in 2.8; Megatron-LM requires 2.8 for delay_wgrad_compute with "
             "--overlap-grad-reduce)"),
)


def schedule_choices():
    """Every registered schedule, and `auto` (the planner picks the fastest that fits the budget)."""
    return registry.names() + [AUTO]


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the --pipeline-* options (only these: Megatron-LM's own flags stay Megatron's)."""
    g = parser.add_argument_group("megatron_vshape pipeline schedule")
    choices = schedule_choices()
    g.add_argument("--pipeline-schedule", default=None, choices=choices, metavar="NAME",
                   help=f"pipeline schedule to run: {', '.join(choices)} (default: Megatron's own)")
    g.add_argument("--pipeline-schedule-file", default=None, metavar="FILE.json",
                   help="run the schedule exported to FILE.json (`megatron-vshape plan/export`, perhaps edited; "
                        "`megatron-vshape check FILE.json` verifies it as training will) instead of --pipeline-schedule")
    g.add_argument("--pipeline-costs", default=None, metavar="F,B,W[,C]",
                   help="measured times of one forward, input-gradient backward and weight-gradient backward of "
                        "one microbatch over one rank's share of the model, and of one p2p hop (C); schedules that "
                        "plan with costs (zb-h2, the V family, auto) use them (default 1,1,1,0)")
    g.add_argument("--pipeline-memory-budget", type=float, default=None, metavar="X",
                   help="activation memory cap per rank relative to 1F1B's rank 0 (1.0 = 1F1B): with "
                        "--pipeline-schedule auto the fastest schedule whose peak fits is chosen, v-auto plans "
                        "under it, and any other schedule that holds more on some rank is refused at start-up")
    g.add_argument("--pipeline-replan-after", type=int, default=None, metavar="N",
                   help="after iteration N, re-plan the schedule's order from the op times measured in it (the "
                        "numbers stay bit for bit the same); with --pipeline-balance auto, re-balance the layout from "
                        "them too: moving layers between ranks moves their weights and optimizer state, so iteration N "
                        "is saved to --save, the chunks rebuilt for the new layout and the checkpoint loaded")
    g.add_argument("--pipeline-layout", default=None, metavar="N0,N1,...",
                   help="transformer layers of each stage in model order (the V's 2p stages: rank r holds stages r "
                        "and 2p-1-r), e.g. 3,4,4,4,4,4,4,3; Megatron's E|t*4|...|t*3L syntax is read too "
                        "(default: an even split, any remainder on the middle stages)")
    g.add_argument("--pipeline-balance", choices=("even", "auto"), default="even",
                   help="auto: size the stages from the model's shape (layers, hidden, FFN, sequence, vocabulary, "
                        "tp; embedding, output layer and loss included; each op priced by its GEMM FLOPs, the bytes "
                        "it moves and its operators, for H100-class GPUs, or a CPU core per rank without CUDA) to "
                        "minimise the simulated iteration time within --pipeline-memory-budget; prints the layout, "
                        "bubble and peak next to the even split")
    g.add_argument("--pipeline-p2p-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="seconds a pipeline receive may wait before an error naming the rank, op and peer")
    return parser


@dataclass(frozen=True)
class PipelinePlan:
    """What validation decided: the schedule every rank will build, and the sizes it was built for."""

    name: str
    schedule: Schedule = field(repr=False)
    pp: int
    data_parallel_size: int
    num_microbatches: int
    costs: Costs
    options: dict = field(default_factory=dict)  # generator options (chunks, group)
    reason: Optional[str] = None  # why `auto` chose this schedule
    source: Optional[str] = None  # the --pipeline-schedule-file it was read from
    stage_layers: Optional[Tuple[int, ...]] = None  # transformer layers per stage, model order
    balance: Optional[str] = None  # --pipeline-balance auto's report (its schedule was planned for the layout)

    @property
    def as_built(self) -> bool:
        """Whether the executor must run `schedule` itself (auto's choice, a file), not rebuild it by name."""
        return self.reason is not None or self.source is not None or self.balance is not None

    @property
    def virtual_pipeline_model_parallel_size(self) -> Optional[int]:
        chunks = self.schedule.placement.chunks
        return chunks if chunks > 1 else None


def _get(args, name, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def data_parallel_size(args) -> int:
    """DP size from args.data_parallel_size, or world size / (tp * pp * cp) as Megatron computes it."""
    tp, pp, cp = (_get(args, n, 1) for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                              "context_parallel_size"))
    dp = getattr(args, "data_parallel_size", None)
    if dp:
        return dp
    world = _get(args, "world_size", None) or int(os.environ.get("WORLD_SIZE", tp * pp * cp))
    if world % (tp * pp * cp):
        raise ConfigError(f"world size {world} is not divisible by tensor x pipeline x context parallel size "
                          f"{tp}x{pp}x{cp}={tp * pp * cp}; launch a multiple of {tp * pp * cp} processes")
    return world // (tp * pp * cp)


def num_microbatches(args, dp: int) -> int:
    mbs = _get(args, "micro_batch_size", 1)
    gbs = _get(args, "global_batch_size", mbs * dp)
    if mbs < 1 or gbs < 1:
        raise ConfigError(f"--micro-batch-size={mbs} and --global-batch-size={gbs} must be >= 1")
    if gbs % (mbs * dp):
        fix = (gbs // (mbs * dp) + 1) * mbs * dp
        raise ConfigError(f"--global-batch-size={gbs} is not divisible by --micro-batch-size={mbs} x data-parallel "
                          f"size {dp}; use --global-batch-size={fix}")
    return gbs // (mbs * dp)


def _vp_size(args, pp: int) -> Optional[int]:
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    vp = vp or getattr(args, "num_virtual_stages_per_pipeline_rank", None)  # Megatron-LM sets vp from it later
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if vp is None and per_stage:
        layers = _get(args, "num_layers", 0)
        if layers % (per_stage * pp):
            raise ConfigError(f"--num-layers={layers} is not divisible by --num-layers-per-virtual-pipeline-stage="
                              f"{per_stage} x pp={pp}")
        vp = layers // (per_stage * pp)
    return vp


def _generator_options(name: str, args, pp: int) -> dict:
    """Generator options from the flags: Megatron's virtual-pipeline flags (1f1b-interleaved's chunks
    and group), and --pipeline-memory-budget for a generator that plans under one (v-auto)."""
    options = {}
    if name == "1f1b-interleaved":
        options["chunks"] = _vp_size(args, pp) or 2
        group = getattr(args, "microbatch_group_size_per_vp_stage", None)
        if group:
            options["group"] = group
    budget = planning_budget(args)
    if budget is not None and registry.plans_under_budget(name):
        if budget < min_budget(pp) - 1e-12:
            raise ConfigError(f"--pipeline-memory-budget {budget:g} is below V-Min's {min_budget(pp):.4g} at pp={pp}, "
                              f"the least --pipeline-schedule {name} plans under; raise it")
        options["memory_budget"] = budget
    return options


def planning_budget(args) -> Optional[float]:
    """--pipeline-memory-budget as plans are made under it: at most the planner's MAX_BUDGET (2.0), where
    every V-shape order fits and beyond which no registered schedule holds more."""
    budget = getattr(args, "pipeline_memory_budget", None)
    return None if budget is None else min(budget, MAX_BUDGET)


def activation_peaks(schedule: Schedule, stage_layers: Optional[Tuple[int, ...]]) -> list:
    """Per rank, peak activation memory relative to 1F1B's rank 0 on the even split: each stage weighs its
    layers (an uneven layout's stages are not the equal ones the schedule was planned for)."""
    weights = None
    if stage_layers and len(set(stage_layers)) > 1:
        per_stage = sum(stage_layers) / len(stage_layers)
        weights = [n / per_stage for n in stage_layers]
    return peak_vs_1f1b(schedule, peak_activations(schedule, weights))


def _check_budget_holds(args, given: str, schedule: Schedule, stage_layers: Optional[Tuple[int, ...]]) -> None:
    """--pipeline-memory-budget is a cap for every schedule, on the layout it runs: the peak of one planned
    for equal stages (a named one, a file's, v-auto's) grows on a rank that holds more layers."""
    budget = getattr(args, "pipeline_memory_budget", None)
    if budget is None:
        return
    peaks = activation_peaks(schedule, stage_layers)
    peak = max(peaks)
    if peak > budget + 1e-9:
        uneven = stage_layers and len(set(stage_layers)) > 1
        where = f" with layers per stage {','.join(map(str, stage_layers))}" if uneven else ""
        ways = [] if given.startswith(f"--pipeline-schedule {AUTO}") else \
            ["--pipeline-schedule auto (the fastest schedule within the budget)"]
        if not registry.plans_under_budget(schedule.name) or uneven:
            ways.append("--pipeline-balance auto (the layout planned within the budget)" if uneven
                        else "v-auto (planned under it)")
        raise ConfigError(f"{given} holds up to {peak:.3g} of 1F1B's activation memory (rank {peaks.index(peak)}"
                          f"{where}), over --pipeline-memory-budget {budget:g}; pass {' or '.join(ways)}, or "
                          "raise the budget")


def _check_virtual_pipeline(args, name: str, schedule: Schedule) -> None:
    """Megatron's virtual-pipeline flags must agree with the schedule's placement."""
    placement = schedule.placement
    vp, want = _vp_size(args, placement.pp), (placement.chunks if placement.chunks > 1 else None)
    if vp not in (None, want) and not (vp == 1 and want is None):
        fix = ("leave it unset or 2 (the V holds two stages per rank)" if placement.kind == "v"
               else "leave it unset, or use --pipeline-schedule 1f1b-interleaved")
        raise ConfigError(f"--pipeline-schedule {name} holds {placement.chunks} stage(s) per rank but the virtual "
                          f"pipeline size is {vp}; {fix}")
    group = getattr(args, "microbatch_group_size_per_vp_stage", None)
    if group and name != "1f1b-interleaved":
        raise ConfigError(f"--microbatch-group-size-per-virtual-pipeline-stage={group} applies to 1f1b-interleaved "
                          f"only; unset it for --pipeline-schedule {name}")


def _costs(args) -> Costs:
    text = getattr(args, "pipeline_costs", None)
    if text is None:
        return Costs()
    return text if isinstance(text, Costs) else Costs.parse(text)


def _check_layers(args, name: str, schedule: Schedule) -> Tuple[int, ...]:
    """Layers per stage in model order (integration/layout.py), checked against --num-layers."""
    from .layout import stage_layers

    layers = _get(args, "num_layers", 0)
    if layers < 1:
        raise ConfigError(f"--num-layers={layers} must be >= 1")
    return stage_layers(args, name, schedule.placement)


def _check_options_the_runtime_refuses(args, name: str, schedule: Schedule) -> None:
    if _get(args, "mtp_num_layers", 0):
        raise ConfigError(f"--mtp-num-layers={args.mtp_num_layers} (multi-token prediction) is not supported with "
                          f"--pipeline-schedule {name}; unset it")
    if getattr(args, "defer_embedding_wgrad_compute", False):
        raise ConfigError(f"--defer-embedding-wgrad-compute is not supported with --pipeline-schedule {name}: "
                          "zero-bubble schedules defer the output layer's weight gradient to W themselves; unset it")
    if getattr(args, "variable_seq_lengths", False):
        raise ConfigError(f"variable sequence lengths are not supported with --pipeline-schedule {name}; "
                          "use a fixed --seq-length")
    _check_gpu_options(args, name, schedule)
    impl = getattr(args, "transformer_impl", None)
    if impl == "transformer_engine" and schedule.split_backward:
        version = _te_version()
        if version is None:
            raise ConfigError(f"--transformer-impl transformer_engine but Transformer Engine is not installed; "
                              f"install transformer-engine>={'.'.join(map(str, TE_MIN_FOR_SPLIT))} or pass "
                              f"--transformer-impl local")
        if version < TE_MIN_FOR_SPLIT:
            why = next(reason for fixed, reason in TE_SPLIT_HISTORY if version < fixed)
            raise ConfigError(f"--pipeline-schedule {name} splits the backward into B and W, which Transformer Engine "
                              f"supports from {'.'.join(map(str, TE_MIN_FOR_SPLIT))}; found "
                              f"{'.'.join(map(str, version))}, whose {why}: upgrade it, pass --transformer-impl "
                              f"local, or use a schedule without W (1f1b, 1f1b-interleaved)")


def _check_gpu_options(args, name: str, schedule: Schedule) -> None:
    """Megatron-LM options the GPU path cannot honour under a pipeline schedule."""
    level = _get(args, "timing_log_level", 0) or 0
    if level >= 2:
        raise ConfigError(f"--timing-log-level={level} times every microbatch with torch.cuda.synchronize inside the "
                          f"step, which waits for the receives --pipeline-schedule {name} has posted and hangs the "
                          "pipeline; use --timing-log-level 1 (per-op times come from the schedule's recorder)")
    checks = [f for f in ("check_for_nan_in_loss_and_grad", "check_for_spiky_loss", "check_for_large_grads")
              if _get(args, f, False)]
    # Only Megatron-LM's arguments carry distributed_backend: the driver checks its loss after the step.
    if checks and getattr(args, "distributed_backend", None) == "nccl":
        # --check-for-nan-in-loss-and-grad is on by default in Megatron-LM: its off switch is --no-...
        fixes = ["pass --no-check-for-nan-in-loss-and-grad" if f == "check_for_nan_in_loss_and_grad"
                 else f"unset {_flag(f)}" for f in checks]
        raise ConfigError(f"{', '.join(_flag(f) for f in checks)} with --pipeline-schedule {name}: Megatron-LM "
                          "validates the loss (in pretrain_gpt's loss_func) and gradients (in DDP's grad hooks) on the "
                          "host inside the step, which waits for the device and so for the receives the schedule has "
                          f"posted, and hangs the pipeline over NCCL; {' and '.join(fixes)} (megatron-core's optimizer "
                          "still skips a step whose gradients are not finite)")
    if _get(args, "tp_comm_overlap", False) and schedule.split_backward:
        raise ConfigError(f"--tp-comm-overlap (Transformer Engine's userbuffer overlap) with --pipeline-schedule {name}: "
                          "the userbuffers overlap each weight-gradient GEMM with its layer's input-gradient "
                          "communication, but this schedule runs weight gradients later, in W ops; unset "
                          "--tp-comm-overlap or use a schedule without W (1f1b, 1f1b-interleaved)")
    tp = _get(args, "tensor_model_parallel_size", 1)
    ordered = [f for f in ("sequence_parallel", "tp_comm_overlap") if _get(args, f, False)]
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if tp > 1 and ordered and connections != "1":
        raise ConfigError(f"CUDA_DEVICE_MAX_CONNECTIONS={connections or 'unset'} with --tensor-model-parallel-size={tp} "
                          f"and {', '.join('--' + f.replace('_', '-') for f in ordered)}: megatron-core overlaps the "
                          "tensor-parallel communication with compute by the order kernels are issued in, which only "
                          "one device queue keeps; export CUDA_DEVICE_MAX_CONNECTIONS=1 (the pipeline's own "
                          "communication is proven deadlock-free under it)")


def _te_version():
    """(major, minor) of the installed Transformer Engine, or None; reads package metadata, imports nothing."""
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            text = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in text.split(".")[:2]]
        return tuple(parts + [0] * (2 - len(parts)))
    return None


def _check_runtime_options(args) -> None:
    timeout = _get(args, "pipeline_p2p_timeout", 300.0)
    if not timeout > 0:
        raise ConfigError(f"--pipeline-p2p-timeout={timeout} must be > 0 seconds")
    budget = getattr(args, "pipeline_memory_budget", None)
    if budget is not None and not budget > 0:
        raise ConfigError(f"--pipeline-memory-budget={budget} must be > 0 (1.0 = 1F1B's activation memory)")
    after = getattr(args, "pipeline_replan_after", None)
    if after is not None:
        if after < 1:
            raise ConfigError(f"--pipeline-replan-after={after} must be an iteration >= 1")
        if not replan_available():
            raise ConfigError(f"--pipeline-replan-after={after}: re-planning from measured op times is not available "
                              "in this version (the executor has no replan()); unset it")


# (attribute, flag, unset values) of the flags that act only through a megatron_vshape schedule.
SCHEDULE_FLAGS = (("pipeline_layout", "--pipeline-layout", (None,)),
                  ("pipeline_memory_budget", "--pipeline-memory-budget", (None,)),
                  ("pipeline_costs", "--pipeline-costs", (None,)),
                  ("pipeline_balance", "--pipeline-balance auto", (None, "even")),
                  ("pipeline_replan_after", "--pipeline-replan-after", (None,)))


def _check_no_schedule_flags(args) -> None:
    """With pp >= 2 and no --pipeline-schedule (Megatron-LM's hook: Megatron's own schedules run), the
    flags that only a megatron_vshape schedule reads would be dropped without a word: refuse them."""
    if _get(args, "pipeline_model_parallel_size", 1) < 2:
        return  # no pipeline: the driver names each such flag itself
    given = [flag for attr, flag, unset in SCHEDULE_FLAGS if getattr(args, attr, None) not in unset]
    if given:
        they = len(given) > 1
        raise ConfigError(f"{', '.join(given)} appl{'y' if they else 'ies'} to a --pipeline-schedule of megatron_vshape, "
                          f"but none is given: Megatron's own schedule would run and ignore {'them' if they else 'it'}; "
                          f"pass --pipeline-schedule NAME (1f1b for the 1F1B order) or unset {'them' if they else 'it'}")


def replan_available() -> bool:
    """Whether the executor can re-plan its schedule during a run (imports the runtime: torch)."""
    try:
        from ..runtime import executor
    except ImportError:
        return False
    return callable(getattr(executor._Executor, "replan", None))


def _choose_auto(args, pp: int, m: int, costs: Costs):
    budget = getattr(args, "pipeline_memory_budget", None)
    if budget is None:
        raise ConfigError("--pipeline-schedule auto needs --pipeline-memory-budget X (activation memory per rank "
                          "relative to 1F1B, e.g. 0.5)")
    return fastest_within(pp, m, costs, budget, flag="--pipeline-memory-budget")


def validate_pipeline_args(args) -> Optional[PipelinePlan]:
    """Check the pipeline options against Megatron's sizes; the plan every rank will run, or None
    when --pipeline-schedule is unset.  Raises ConfigError before any process group exists."""
    name = getattr(args, "pipeline_schedule", None)
    path = getattr(args, "pipeline_schedule_file", None)
    _check_runtime_options(args)
    if name is None and path is None:
        _check_no_schedule_flags(args)
        return None
    if name is not None and path is not None:
        raise ConfigError(f"--pipeline-schedule {name} and --pipeline-schedule-file {path}: pass one (the file "
                          "holds its own schedule)")
    pp = _get(args, "pipeline_model_parallel_size", 1)
    if pp < 2:
        given = f"--pipeline-schedule {name}" if name else f"--pipeline-schedule-file {path}"
        raise ConfigError(f"{given} needs --pipeline-model-parallel-size >= 2, got {pp}; "
                          f"without pipelining no schedule applies (unset {given.split()[0]})")
    group = getattr(args, "microbatch_group_size_per_vp_stage", None)
    if group and (path is not None or name == AUTO):
        held = f"--pipeline-schedule-file {path} holds its own order" if path is not None else \
            "--pipeline-schedule auto weighs each schedule at its defaults"
        raise ConfigError(f"--microbatch-group-size-per-virtual-pipeline-stage={group} orders 1f1b-interleaved when it "
                          f"is built by name, but {held}: unset it (or pass --pipeline-schedule 1f1b-interleaved)")
    dp = data_parallel_size(args)
    m = num_microbatches(args, dp)
    costs = _costs(args)
    reason = None
    if path is not None:
        schedule = _schedule_file(args, path, pp, m)
        name, options, costs = schedule.name, {}, schedule.costs
    elif name == AUTO:
        chosen = _choose_auto(args, pp, m, costs)
        schedule, reason = _chosen_schedule(chosen)
        name = schedule.name
        # The budget the choice was planned at (v-auto's may be a step below the flag's): rebuilt by name
        # (another microbatch count in a ramp, Megatron-LM's hook) it is planned there again.
        planned = getattr(schedule, "memory_budget", None)
        options = {"memory_budget": planned} if planned is not None and registry.plans_under_budget(name) else {}
    else:
        options = _generator_options(name, args, pp)
        try:
            schedule = registry.build(name, pp, m, costs, **options)
        except ConfigError as e:
            raise ConfigError(f"{e} (--global-batch-size={_get(args, 'global_batch_size', m * dp)} / "
                              f"(--micro-batch-size={_get(args, 'micro_batch_size', 1)} x data-parallel {dp}) = "
                              f"{m} microbatches); raise --global-batch-size or pick another schedule") from None
    _check_virtual_pipeline(args, name, schedule)
    stage_layers = _check_layers(args, name, schedule)
    _check_options_the_runtime_refuses(args, name, schedule)
    balanced = None
    if getattr(args, "pipeline_balance", None) == "auto":
        from .layout import balanced_layout

        options.pop("memory_budget", None)  # balance plans v-auto under the flag's budget itself
        schedule, stage_layers, balanced = balanced_layout(args, name, pp, m, costs, options, path)
    else:
        given = f"--pipeline-schedule-file {path}" if path else f"--pipeline-schedule {name}" if reason is None else \
            f"--pipeline-schedule {AUTO}'s choice {name} (weighed on equal stages)"
        _check_budget_holds(args, given, schedule, stage_layers)
    return PipelinePlan(name, schedule, pp, dp, m, costs, options, reason, path, stage_layers, balanced)


def _schedule_file(args, path: str, pp: int, m: int) -> Schedule:
    """The verified schedule of --pipeline-schedule-file, for this run's pp and microbatches."""
    from ..schedule.export import load_json

    flag = "--pipeline-schedule-file"
    try:
        schedule = load_json(path)  # the verifier `megatron-vshape check` runs
    except OSError as e:
        raise ConfigError(f"{flag} {path}: {e.strerror or e}") from None
    except ConfigError as e:
        raise ConfigError(f"{flag} {e}") from None
    if schedule.meta.get("forward_only"):
        raise ConfigError(f"{flag} {path} holds a forward-only schedule; export the training schedule")
    if (schedule.pp, schedule.microbatches) != (pp, m):
        raise ConfigError(f"{flag} {path} holds {schedule.name} for pp={schedule.pp} and {schedule.microbatches} "
                          f"microbatches; this run has pp={pp} and {m} microbatches (--global-batch-size / "
                          f"(--micro-batch-size x data-parallel size)): export the schedule for these sizes")
    if getattr(args, "pipeline_replan_after", None) is not None:
        raise ConfigError(f"--pipeline-replan-after re-plans by name from measured costs, replacing the order of "
                          f"{flag} {path}; unset one of them")
    return schedule


def _chosen_schedule(chosen):
    """(schedule, reason) from whatever fastest_within returns: a Schedule, or (Schedule, reason), or an
    object with .schedule and .reason."""
    if isinstance(chosen, Schedule):
        return chosen, None
    if isinstance(chosen, tuple):
        return chosen[0], (chosen[1] if len(chosen) > 1 else None)
    return chosen.schedule, getattr(chosen, "reason", None)
