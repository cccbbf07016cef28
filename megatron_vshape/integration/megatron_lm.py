"""`install()`: run Megatron-LM's own `pretrain_gpt.py` under a megatron_vshape schedule.

Megatron-LM (core_v0.16.x to main) decides the pipeline in a handful of functions.  `install()` wraps
each one where that release looks it up, so the script itself stays unchanged:

  Megatron-LM function (module where it is looked up)         what the wrapper changes
  ---------------------------------------------------------   -------------------------------------------
  parse_args (megatron.training.arguments; initialize_megatron adds --pipeline-schedule and its options
    calls it up to core_v0.17, parse_and_validate_args from 0.18)
  validate_args (megatron.training.arguments, as parse_args)  checks them first (ConfigError before any
                                                               process group), with the Megatron-LM flags a
                                                               schedule cannot honour, then asks Megatron for
                                                               the placement's virtual pipeline size
  initialize_megatron (megatron.training.training)            V: embedding group = first pipeline rank
  get_model (megatron.training.training)                      V: chunk c of rank r is stage r or 2p-1-r
                                                               (pre/post_process), layer offsets along
                                                               the V, tied weight shared on rank 0,
                                                               Float16Module upcasting stage 2p-1 only;
                                                               TE under a split: delay_wgrad_compute on
                                                               the config and the DDP config
  GPTModelBuilder.build_model (megatron.training.models.gpt;  V: the same chunks, for the config-container
    core_v0.19 and main, which build without get_model)        path
  get_forward_backward_func (megatron.training.training)      the executor running the schedule; its
                                                               pp_size, vp_size, schedule_pg_collection
                                                               (core_v0.19) are checked or honoured
  is_first_or_last_pipeline_stage (megatron.training.utils)   V: rank 0 loads data (both ends live there)
  get_batch_on_this_tp_rank (megatron.training.utils up to    V: rank 0 gets every field over TP, as pp=1
    core_v0.17, megatron.core.utils with a batch dict from 0.18)

A function is rebound in its module and wherever it was already imported by name (a script that
calls install() after its imports).  Without --pipeline-schedule every wrapper calls Megatron-LM's
own function unchanged.  Loss placement needs no hook: the executor ships the loss dicts from rank 0
to the last pipeline rank, where Megatron-LM's train_step and evaluate reduce them.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import sys
from typing import Callable, Optional

from ..schedule.errors import ConfigError

# Megatron-LM releases install() supports, by the megatron-core release their checkout carries
# (megatron/core/package_info.py): (major, minor) -> the tags tested (README's support table).
SUPPORTED = {(0, 16): ("core_v0.16.0", "core_v0.16.1"), (0, 17): ("core_v0.17.1",), (0, 18): ("core_v0.18.2",),
             (0, 19): ("core_v0.19.0",), (0, 20): ("main (d98e8a6, megatron-core 0.20.0)",)}
SUPPORTED_TAGS = tuple(tag for tags in SUPPORTED.values() for tag in tags)

# The plan validated on this process (set by the validate_args hook, read by the others).
_plan = None
_installed = False


def current_plan():
    """The PipelinePlan validated in this process, or None (no --pipeline-schedule, or not yet parsed)."""
    return _plan


def _placement():
    return _plan.schedule.placement if _plan is not None else None


def _is_v() -> bool:
    placement = _placement()
    return placement is not None and placement.kind == "v"


# ---- the hooks ---------------------------------------------------------------------------------

def _parse_args(orig):
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        from .args import add_pipeline_arguments

        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_pipeline_arguments(parser)

        _refuse_yaml_with_a_schedule()
        return orig(provider, ignore_unknown_args)
    return parse_args


def _refuse_yaml_with_a_schedule() -> None:
    """--yaml-cfg replaces the parsed flags with the YAML's (core_v0.16-17 in parse_args) and is validated by
    validate_yaml instead of validate_args, so --pipeline-schedule would be dropped without a word and Megatron's own
    schedule run: refused from the command line before Megatron-LM parses it."""
    import argparse

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--yaml-cfg")
    pre.add_argument("--pipeline-schedule")
    given, _ = pre.parse_known_args(sys.argv[1:])
    if given.yaml_cfg is not None and given.pipeline_schedule:
        raise ConfigError(f"--yaml-cfg is not supported with --pipeline-schedule {given.pipeline_schedule}: "
                          "Megatron-LM reads a YAML configuration in place of the command line and validates it "
                          "without the schedule's checks; pass the model with flags instead")


def _validate_args(orig):
    def validate_args(args, defaults={}):
        global _plan
        from .args import validate_pipeline_args
        from .layout import megatron_layout_args

        plan = validate_pipeline_args(args)
        if plan is None:
            _plan = None
            return orig(args, defaults)
        _check_megatron_lm_flags(args, plan)
        vp = plan.virtual_pipeline_model_parallel_size
        megatron_layout_args(args, plan.stage_layers, plan.schedule.placement)  # uneven: as Megatron's layout
        if vp is not None and getattr(args, "num_layers_per_virtual_pipeline_stage", None) is None \
                and getattr(args, "pipeline_model_parallel_layout", None) is None:
            # Megatron-LM derives its virtual pipeline size from this flag in validate_args.
            args.num_virtual_stages_per_pipeline_rank = vp
        if vp is not None and plan.pp == 2 and getattr(args, "overlap_p2p_comm", True) is False:
            # Megatron-LM refuses two chunks at pp=2 without it: its interleaved schedule would batch two sends
            # between the same ranks.  Our executor does its own p2p and reads neither flag.
            args.overlap_p2p_comm = True
            if getattr(args, "rank", 0) == 0:
                print("megatron_vshape: --no-overlap-p2p-communication does not apply (megatron_vshape's executor "
                      "does its own pipeline communication); ignored", flush=True)
        result = orig(args, defaults)
        if args.virtual_pipeline_model_parallel_size != vp:
            raise ConfigError(f"--pipeline-schedule {plan.name} needs a virtual pipeline size of {vp}, but Megatron-LM's "
                              f"flags give {args.virtual_pipeline_model_parallel_size}; unset "
                              "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
        _plan = plan
        _announce(plan, args)
        return result
    return validate_args


def _check_megatron_lm_flags(args, plan) -> None:
    """Megatron-LM flags that its own validation accepts but that a megatron_vshape schedule cannot honour:
    a ConfigError with the reason and the fix, before any process group exists."""
    name, split = plan.name, plan.schedule.split_backward
    fix = f"or drop --pipeline-schedule {name} (Megatron's own schedules)"
    after = getattr(args, "pipeline_replan_after", None)
    if after is not None:
        raise ConfigError(f"--pipeline-replan-after={after} is not implemented under Megatron-LM's training loop "
                          "(re-planning needs the measured op times of every rank at one iteration); unset it, or "
                          "train with megatron_vshape's own driver (megatron-vshape pretrain), which implements it")
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        raise ConfigError("--overlap-moe-expert-parallel-comm is implemented inside Megatron's own 1F1B and "
                          f"interleaved schedules, which --pipeline-schedule {name} replaces: it would be silently "
                          f"lost; unset it {fix}")
    if plan.schedule.placement.kind == "v" and getattr(args, "ckpt_format", None) == "torch":
        raise ConfigError(f"--ckpt-format torch saves each rank's model chunks by position, and on the V chunk 1 of "
                          f"rank r holds stage {2 * plan.pp - 1}-r: a resume under another schedule or placement "
                          "fails late with mismatched keys; use --ckpt-format torch_dist (keys by global layer "
                          "number: the model resumes under any schedule)")
    if split and getattr(args, "tp_comm_overlap", False):
        raise ConfigError(f"--tp-comm-overlap (Transformer Engine's userbuffer communication) cannot run with "
                          f"--pipeline-schedule {name}: its B/W split defers TE's weight gradients, which TE does not "
                          "support with userbuffers (it raises); unset --tp-comm-overlap, or use a schedule without "
                          "W (1f1b, 1f1b-interleaved)")
    fsdp = [flag for flag, attr in (("--use-megatron-fsdp", "use_megatron_fsdp"), ("--use-torch-fsdp2", "use_torch_fsdp2"))
            if getattr(args, attr, False)]
    if fsdp:
        raise ConfigError(f"{fsdp[0]} is not supported with --pipeline-schedule {name}: the executor drives gradient "
                          "and parameter sync through megatron-core's DistributedDataParallel (no_sync, grad_sync_func, "
                          "param_sync_func), and on the V chunk 1 of rank 0 borrows the embedding's weight from chunk 0, "
                          f"which FSDP would shard as two units; use --use-distributed-optimizer instead, {fix}")
    if getattr(args, "delay_wgrad_compute", False):
        raise ConfigError(f"--delay-wgrad-compute is set by megatron_vshape itself where --pipeline-schedule {name} "
                          "splits the backward (Transformer Engine layers); unset it")
    _check_replaced_schedule_features(args, name, fix)
    _check_rampup(args, plan)


def _check_replaced_schedule_features(args, name: str, fix: str) -> None:
    """Features that megatron-core's own schedules drive at the end of each step, in every spelling Megatron-LM
    accepts (--enable-cuda-graph and --external-cuda-graph are its deprecated --cuda-graph-impl local and
    transformer_engine; from core_v0.18 a full-iteration graph is --cuda-graph-impl full_iteration)."""
    impl = getattr(args, "cuda_graph_impl", None) or "none"
    if getattr(args, "enable_cuda_graph", False):
        impl = "local"
    if getattr(args, "external_cuda_graph", False):
        impl = "transformer_engine"
    scopes = getattr(args, "cuda_graph_scope", None) or []
    scopes = scopes if isinstance(scopes, (list, tuple)) else [scopes]
    if impl != "none" or "full_iteration" in {getattr(s, "name", str(s)) for s in scopes}:
        raise ConfigError(f"CUDA graphs (--cuda-graph-impl {impl}) are not supported with --pipeline-schedule "
                          f"{name}: megatron-core's own schedules create the per-layer graphs at the end of each "
                          "step and Transformer Engine captures them in Megatron's schedule order, while a "
                          "full-iteration graph would capture megatron_vshape's executor, whose receives are matched "
                          f"on the host at run time; unset it {fix}")
    if getattr(args, "fine_grained_activation_offloading", False):
        raise ConfigError(f"--fine-grained-activation-offloading is reset by megatron-core's own schedules at the end "
                          f"of each step, which --pipeline-schedule {name} replaces (offloading would stay in its "
                          f"warm-up and keep a handler per forward); unset it {fix}")


def _check_rampup(args, plan) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES: the first steps run START samples; the schedule must be
    buildable for their microbatch count too (the executor builds one per count it meets)."""
    ramp = getattr(args, "rampup_batch_size", None)
    if not ramp:
        return
    from ..schedule import registry
    from .args import data_parallel_size

    start, increment = int(ramp[0]), int(ramp[1])
    per = (getattr(args, "micro_batch_size", None) or 1) * data_parallel_size(args)
    if not _runs_by_name(plan):
        why = "--pipeline-balance auto planned" if plan.balance else "the schedule is"
        raise ConfigError(f"--rampup-batch-size changes the number of microbatches, but {why} one op list of "
                          f"{plan.name} for {plan.num_microbatches} microbatches; unset the ramp, or pass a registered "
                          "--pipeline-schedule" + (" without --pipeline-balance auto" if plan.balance else ""))
    if not getattr(args, "decrease_batch_size_if_needed", False):
        for what, value in (("start", start), ("increment", increment)):
            if value % per:
                raise ConfigError(f"--rampup-batch-size {what} {value} is not a multiple of --micro-batch-size x "
                                  f"data-parallel size = {per}; use {max(per, value // per * per)}")
    # Every batch size of the ramp (Megatron-LM's: start, start + increment, ... up to the global batch),
    # as microbatches (rounded down under --decrease-batch-size-if-needed): the executor builds each when
    # the ramp reaches it, so a count the schedule cannot run would stop training there, hours in.
    final = plan.num_microbatches * per
    for size in range(start, final, max(increment, 1)):
        m = max(1, size // per)
        try:
            registry.build(plan.name, plan.pp, m, plan.costs, **plan.options)
        except ConfigError as e:
            if size == start:
                need = next((k for k in range(m + 1, plan.num_microbatches + 1) if _builds(plan, k)),
                            plan.num_microbatches)
                raise ConfigError(f"--rampup-batch-size starts at {start} samples = {m} microbatches, which "
                                  f"--pipeline-schedule {plan.name} cannot run ({e}); start the ramp at >= "
                                  f"{need * per} samples") from None
            raise ConfigError(f"--rampup-batch-size reaches {size} samples = {m} microbatches, which "
                              f"--pipeline-schedule {plan.name} cannot run ({e}); pick a start and increment whose "
                              "batch sizes it runs, or unset the ramp") from None


def _runs_by_name(plan) -> bool:
    """Whether the executor rebuilds the schedule by name for each microbatch count (with plan.options: auto's
    choice at the budget it was planned at, v-auto at --pipeline-memory-budget), rather than running the one
    op list validation built: a --pipeline-schedule-file's, or one planned for --pipeline-balance auto's layout."""
    from ..schedule import registry

    return plan.name in registry.names() and not plan.source and not plan.balance


def _builds(plan, m: int) -> bool:
    from ..schedule import registry

    try:
        registry.build(plan.name, plan.pp, m, plan.costs, **plan.options)
    except ConfigError:
        return False
    return True


def _announce(plan, args) -> None:
    from ..schedule.layout import describe

    if getattr(args, "rank", 0) == 0:
        placement = plan.schedule.placement
        why = f" ({plan.reason})" if plan.reason else f" (from {plan.source})" if plan.source else ""
        print(f"megatron_vshape: pipeline schedule {plan.name}{why}: pp={plan.pp}, {placement.kind} placement, "
              f"{placement.chunks} chunk(s) per rank, {plan.num_microbatches} microbatches"
              + (f", layers per stage {describe(plan.stage_layers, placement)}" if plan.stage_layers else "")
              + (f"\n{plan.balance}" if plan.balance else ""), flush=True)
        if placement.kind == "v" and getattr(args, "use_distributed_optimizer", False) \
                and getattr(args, "save", None) and not getattr(args, "dist_ckpt_optim_fully_reshardable", False):
            # Megatron-LM's default distributed-optimizer format (dp_reshardable) stores the optimizer state by
            # gradient-buffer position, which differs between the V and Megatron's placements of the same
            # layers; Megatron-LM checks only tp and pp sizes when it loads.
            print("megatron_vshape: checkpoints of this run keep the distributed optimizer's state by the V's "
                  "layer placement: they resume under V schedules with the same layers per stage; to resume them under another "
                  "placement or layout "
                  "(1f1b, 1f1b-interleaved, Megatron's own schedules), also pass --dist-ckpt-optim-fully-reshardable",
                  flush=True)


def _initialize_megatron(orig):
    signature = inspect.signature(orig)

    def initialize_megatron(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        bound.arguments["get_embedding_ranks"] = _embedding_ranks(bound.arguments.get("get_embedding_ranks"))
        return orig(*bound.args, **bound.kwargs)
    return initialize_megatron


def _embedding_ranks(script_fn: Optional[Callable]):
    """Megatron-core's get_embedding_ranks: on the V only the first pipeline rank (embedding and output
    layer both live there, so a tied weight is one parameter and needs no all-reduce)."""
    def get_embedding_ranks(pp_ranks, *rest):
        if _is_v():
            return [pp_ranks[0]]
        if script_fn is not None:
            return script_fn(pp_ranks, *rest)
        from megatron.core import parallel_state

        return parallel_state.default_embedding_ranks(pp_ranks)
    return get_embedding_ranks


def _te_split() -> bool:
    """Whether the plan's B/W split applies to Transformer Engine layers (TE computes weight gradients in B
    unless told to defer them, see _model_provider)."""
    from megatron.training import get_args

    return bool(_plan is not None and _plan.schedule.split_backward
                and getattr(get_args(), "transformer_impl", None) == "transformer_engine")


def _v_float16(wrapper):
    """On the V, Megatron's fp16/bf16 wrapper would upcast the output of the last virtual stage of the last
    pipeline rank: that is stage p, a middle one; only stage 2p-1 (rank 0's chunk 1) may return fp32.  A
    wrapper of the script's own (not megatron-core's Float16Module) is left as given."""
    from megatron.core.transformer.module import Float16Module

    from ..runtime.chunks import VFloat16Module

    return functools.partial(VFloat16Module, placement=_placement()) if _is_v() and wrapper is Float16Module else wrapper


def _get_model(orig):
    def get_model(model_provider_func, *args, **kwargs):
        if _plan is None:
            return orig(model_provider_func, *args, **kwargs)
        from megatron.training import get_args

        margs, te_split = get_args(), _te_split()
        if not (_is_v() or te_split):
            return orig(model_provider_func, *args, **kwargs)
        provider = _model_provider(model_provider_func, _placement(), te_split)
        training = sys.modules[orig.__module__]
        float16 = getattr(training, "Float16Module", None)
        try:
            if float16 is not None:
                training.Float16Module = _v_float16(float16)
            return orig(provider, *args, **kwargs)
        finally:
            if float16 is not None:
                training.Float16Module = float16
            if te_split:
                margs.delay_wgrad_compute = False  # on for get_model's DDP config only (see _model_provider)
    return get_model


def _model_provider(provider: Callable, placement, te_split: bool):
    """Megatron-LM's model provider, called by get_model per virtual stage, with the config made here.

    V: Megatron-LM asks for pre/post_process by pipeline rank and virtual stage; chunk c of rank r holds
    stage `placement.stage_of(r, c)`: the embedding on stage 0, the output layer and loss on stage 2p-1,
    both on rank 0 (tied weight shared there).  TE split: Transformer Engine layers defer their weight
    gradients to W (delay_wgrad_compute set on the built config, which megatron-core 0.16's
    TransformerConfig would refuse at construction without MoE overlap), and get_model's DDP config,
    which it copies from args, takes their gradients from TE's hooks."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    from ..runtime.chunks import _tie_output_to_embedding, _without_embedding_group, chunk_config

    built = {}

    def provide(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, **kwargs):
        args = get_args()
        if config is None:
            args.delay_wgrad_compute = False  # set below for DDP: Megatron's config from args would refuse it
            config = _config_from_args()
        if placement.kind == "v":
            rank = parallel_state.get_pipeline_model_parallel_rank()
            stage = placement.stage_of(rank, vp_stage or 0)
            pre_process, post_process = stage == 0, stage == placement.num_stages - 1
            config = chunk_config(config, placement, _plan.stage_layers)
            pg_collection = _without_embedding_group(pg_collection)
        if te_split:
            from ..runtime.wgrad import defer_te_wgrad

            defer_te_wgrad(config)
            args.delay_wgrad_compute = True  # read by get_model into DistributedDataParallelConfig
        model = provider(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, config=config,
                         pg_collection=pg_collection, **kwargs)
        built[vp_stage] = model
        if placement.kind == "v" and parallel_state.get_pipeline_model_parallel_rank() == 0 and vp_stage == 1 \
                and getattr(model, "share_embeddings_and_output_weights", False):
            _tie_output_to_embedding(model, built[0])
        return model

    return provide


def _config_from_args():
    """The TransformerConfig Megatron-LM's GPT builder would make from its arguments."""
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(get_args())


def _get_forward_backward_func(orig):
    cache = {}  # id(plan) -> executor: train() and evaluate() share one (it caches its op lists)
    signature = inspect.signature(orig)

    def get_forward_backward_func(*args, **kwargs):
        if _plan is None:
            return orig(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments  # an argument this release lacks: TypeError, as orig
        if id(_plan) not in cache:
            cache.clear()
            cache[id(_plan)] = _executor(_plan)
        return _with_schedule_groups(cache[id(_plan)], _plan, given)
    return get_forward_backward_func


def _with_schedule_groups(executor, plan, given: dict):
    """Megatron-core's selectors: pp_size/vp_size (they must be the plan's) and, from core_v0.19,
    schedule_pg_collection: a multi-module (cross-grid) collection is refused, a plain one becomes the
    groups of calls that pass none (Megatron-LM passes the same collection to each call)."""
    vp = plan.virtual_pipeline_model_parallel_size
    for name, want in (("pp_size", plan.pp), ("vp_size", vp)):
        if given.get(name) is not None and given[name] != want:
            raise ConfigError(f"get_forward_backward_func({name}={given[name]}) but --pipeline-schedule {plan.name} "
                              f"runs {name}={want}; call it without {name} or with the schedule's")
    groups = given.get("schedule_pg_collection")
    if groups is None:
        return executor
    if not hasattr(groups, "pp"):  # MultiModuleProcessGroupCollection: megatron-core's bridge schedule
        raise ConfigError(f"--pipeline-schedule {plan.name} runs one model's pipeline; a multi-module "
                          f"{type(groups).__name__} is not supported; drop --pipeline-schedule for it")

    def forward_backward(**kwargs):
        if kwargs.get("pg_collection") is None:
            kwargs["pg_collection"] = groups
        return executor(**kwargs)

    forward_backward.__name__ = executor.__name__
    return forward_backward


def _executor(plan):
    from megatron.training import get_args

    from ..runtime.executor import get_forward_backward_func

    args = get_args()
    named = _runs_by_name(plan)
    return get_forward_backward_func(plan.name if named else plan.schedule, plan.costs,
                                     p2p_timeout=getattr(args, "pipeline_p2p_timeout", None) or 300.0,
                                     schedule_options=plan.options if named else None)


def _is_first_or_last_pipeline_stage(orig):
    def is_first_or_last_pipeline_stage(vp_stage):
        if _is_v():
            from megatron.core import parallel_state

            return parallel_state.get_pipeline_model_parallel_rank() == 0
        return orig(vp_stage)
    return is_first_or_last_pipeline_stage


def _get_batch_on_this_tp_rank(orig):
    signature = inspect.signature(orig)  # (data_iterator, mtp_on_this_rank) up to core_v0.17, (batch, ...) from 0.18

    def get_batch_on_this_tp_rank(*args, **kwargs):
        if _is_v():
            from megatron.core import parallel_state

            if parallel_state.get_pipeline_model_parallel_rank() == 0:
                # Rank 0 is the first and the last stage: like pp=1 (or a rank with MTP layers) it needs
                # tokens, labels and loss mask, and Megatron-LM broadcasts them all over TP for this flag.
                bound = signature.bind(*args, **kwargs)
                bound.arguments["mtp_on_this_rank"] = True
                args, kwargs = bound.args, bound.kwargs
        return orig(*args, **kwargs)
    return get_batch_on_this_tp_rank


def _build_model(orig):
    """GPTModelBuilder.build_model (core_v0.19 and main): the config-container path builds each virtual
    stage with it and never calls get_model; it gets get_model's provider (V stages, TE split)."""
    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        te_split = _te_split()
        if not (_is_v() or te_split):
            return orig(self, pg_collection, pre_process, post_process, vp_stage)
        cfg = self._model_config

        def provider(pre_process, post_process, vp_stage, config, pg_collection):
            saved, cfg.transformer = cfg.transformer, config
            try:
                return orig(self, pg_collection, pre_process, post_process, vp_stage)
            finally:
                cfg.transformer = saved

        if "_vshape_provide" not in vars(self):  # one per builder: chunk 1 ties to chunk 0's embedding
            self._vshape_provide = _model_provider(provider, _placement(), te_split)
        return self._vshape_provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                                    config=cfg.transformer, pg_collection=pg_collection)
    return build_model


def _build_distributed_models(orig):
    """GPTModelBuilder.build_distributed_models (core_v0.19 and main): what get_model's hook does to the wrappers,
    for the config-container path, whose wrapper and DDP config are arguments here rather than read from
    training's globals and args: on the V the fp16/bf16 wrapper upcasts only stage 2p-1's output; with the TE
    split Megatron's DDP takes the weight gradients from TE's hooks (delay_wgrad_compute)."""
    signature = inspect.signature(orig)

    def build_distributed_models(*args, **kwargs):
        if _plan is None:
            return orig(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        given["mixed_precision_wrapper"] = _v_float16(given.get("mixed_precision_wrapper"))
        te_split = _te_split()
        if te_split and given.get("ddp_config") is not None:
            given["ddp_config"] = dataclasses.replace(given["ddp_config"], delay_wgrad_compute=True)
        try:
            return orig(*bound.args, **bound.kwargs)
        finally:
            if te_split:
                from megatron.training import get_args

                get_args().delay_wgrad_compute = False  # _model_provider sets it for get_model's DDP config
    return build_distributed_models


# (modules where Megatron-LM looks the function up: the first that has it is hooked, name, wrapper, needed)
HOOKS = (
    (("megatron.training.arguments",), "parse_args", _parse_args, True),
    (("megatron.training.arguments",), "validate_args", _validate_args, True),
    (("megatron.training.training",), "initialize_megatron", _initialize_megatron, True),
    (("megatron.training.training",), "get_model", _get_model, True),
    (("megatron.training.training",), "get_forward_backward_func", _get_forward_backward_func, True),
    (("megatron.training.utils",), "is_first_or_last_pipeline_stage", _is_first_or_last_pipeline_stage, True),
    (("megatron.training.utils", "megatron.core.utils"), "get_batch_on_this_tp_rank", _get_batch_on_this_tp_rank,
     True),
    (("megatron.training.models.gpt",), "GPTModelBuilder.build_model", _build_model, False),  # core_v0.19 on
    (("megatron.training.models.gpt",), "GPTModelBuilder.build_distributed_models", _build_distributed_models,
     False),
)


# ---- install -----------------------------------------------------------------------------------

def install() -> None:
    """Hook megatron_vshape's schedules into Megatron-LM's training (idempotent).

    Call it before Megatron-LM parses its arguments, ideally before the training script's imports
    (`python -m megatron_vshape.launch` does; so does the two-line patch in patches/).
    """
    global _installed
    if _installed:
        return
    _import("megatron.training")
    version = _megatron_lm_release()
    from ..runtime.compat import check_release

    check_release(version)
    found = []
    for module_names, name, make, needed in HOOKS:
        owner, attr = _find(module_names, name, version, needed)
        if owner is not None:
            found.append((owner, attr, make))
    for owner, attr, make in found:  # all found first: install() hooks everything or nothing
        orig = getattr(owner, attr)
        new = functools.wraps(orig)(make(orig))
        if inspect.isclass(owner):
            setattr(owner, attr, new)
        else:
            _rebind(owner, attr, orig, new)
    _installed = True


def _import(module_name: str):
    """Import a Megatron-LM module; a missing dependency is named with the command that installs it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ConfigError(f"megatron_vshape.install() needs Megatron-LM's {module_name} ({e}); run from a "
                              f"Megatron-LM checkout ({', '.join(SUPPORTED_TAGS)}) or put it on PYTHONPATH") from None
        if "cannot import name 'override' from 'typing'" in str(e):
            raise ConfigError(f"this Megatron-LM ({module_name}) needs Python >= 3.12 (typing.override, used from "
                              f"core_v0.18 on); this is Python {sys.version.split()[0]}: use Python 3.12, or "
                              "Megatron-LM core_v0.17.x or older") from None
        raise ConfigError(f"Megatron-LM's {module_name} needs the Python package {missing or e}, which is not "
                          "installed: pip install .[megatron-lm] (in the megatron_vshape checkout)") from None


def _megatron_lm_release() -> str:
    """The megatron-core release of this Megatron-LM (its checkout carries megatron/core); ConfigError,
    naming it and the supported tags, when install() does not support it."""
    from ..runtime.compat import _parse, release

    version = release()
    parsed = _parse(version)
    if parsed is None or parsed[:2] not in SUPPORTED:
        raise ConfigError(f"Megatron-LM with megatron-core {version} (tag core_v{version} or a branch near it) is not "
                          f"supported; megatron_vshape supports Megatron-LM {', '.join(SUPPORTED_TAGS)}")
    return version


def _find(module_names, name: str, version: str, needed: bool):
    """(module or class, attribute) where Megatron-LM looks `name` up, the first of `module_names` that
    has it; (None, None) for an optional hook this release has no place for."""
    path = name.split(".")
    for module_name in module_names:
        if not needed and not _exists(module_name):
            continue
        owner = _import(module_name)
        for part in path[:-1]:
            owner = getattr(owner, part, None)
        if owner is not None and getattr(owner, path[-1], None) is not None:
            return owner, path[-1]
    if needed:
        raise ConfigError(f"Megatron-LM (megatron-core {version}) has no {name} in {' or '.join(module_names)}; "
                          f"megatron_vshape supports Megatron-LM {', '.join(SUPPORTED_TAGS)}")
    return None, None


def _exists(module_name: str) -> bool:
    """Whether this Megatron-LM has the module (it may still fail to import: _import says why)."""
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError as e:  # a parent package is missing
        return not (e.name and module_name.startswith(e.name))
    except ImportError:
        return True


def _rebind(module, name: str, orig, new) -> None:
    """Bind `new` in `module` and in every loaded module outside megatron.core that imported `orig` by name."""
    setattr(module, name, new)
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is module or mod_name.startswith(("megatron.core", "megatron_vshape", "torch")):
            continue
        try:
            namespace = vars(mod)
        except TypeError:
            continue
        if namespace.get(name) is orig:
            namespace[name] = new
