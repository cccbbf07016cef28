"""`install()`: run Megatron-LM's own `pretrain_gpt.py` under a megatron_vshape schedule.

Megatron-LM (tag core_v0.16.1) decides the pipeline in a handful of functions.  `install()` wraps
each one where Megatron-LM looks it up, so the script itself stays unchanged:

  Megatron-LM function (module where it is looked up)         what the wrapper changes
  ---------------------------------------------------------   -------------------------------------------
  parse_args (megatron.training.initialize)                   adds --pipeline-schedule and its options
  validate_args (megatron.training.initialize)                checks them first (ConfigError before any
                                                               process group), then asks Megatron for the
                                                               placement's virtual pipeline size
  initialize_megatron (megatron.training.training)            V: embedding group = first pipeline rank
  get_model (megatron.training.training)                      V: chunk c of rank r is stage r or 2p-1-r
                                                               (pre/post_process), layer offsets along
                                                               the V, tied weight shared on rank 0
  get_forward_backward_func (megatron.training.training)      the executor running the schedule
  is_first_or_last_pipeline_stage (megatron.training.utils)   V: rank 0 loads data (both ends live there)
  get_batch_on_this_tp_rank (megatron.training.utils)         V: rank 0 gets every field over TP, as pp=1

A function is rebound in its module and wherever it was already imported by name (a script that
calls install() after its imports).  Without --pipeline-schedule every wrapper calls Megatron-LM's
own function unchanged.  Loss placement needs no hook: the executor ships the loss dicts from rank 0
to the last pipeline rank, where Megatron-LM's train_step and evaluate reduce them.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Callable, Optional

from ..schedule.errors import ConfigError

SUPPORTED_TAGS = ("core_v0.16.0", "core_v0.16.1")

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

        return orig(provider, ignore_unknown_args)
    return parse_args


def _validate_args(orig):
    def validate_args(args, defaults={}):
        global _plan
        from .args import validate_pipeline_args

        plan = validate_pipeline_args(args)
        if plan is None:
            _plan = None
            return orig(args, defaults)
        if plan.schedule.placement.kind == "v" and getattr(args, "yaml_cfg", None) is not None:
            raise ConfigError(f"--yaml-cfg is not supported with --pipeline-schedule {plan.name}: the V builds its "
                              "chunks from Megatron-LM's flags; pass the model with flags instead")
        vp = plan.virtual_pipeline_model_parallel_size
        if vp is not None and getattr(args, "num_layers_per_virtual_pipeline_stage", None) is None:
            # Megatron-LM derives its virtual pipeline size from this flag in validate_args.
            args.num_virtual_stages_per_pipeline_rank = vp
        result = orig(args, defaults)
        if args.virtual_pipeline_model_parallel_size != vp:
            raise ConfigError(f"--pipeline-schedule {plan.name} needs a virtual pipeline size of {vp}, but Megatron-LM's "
                              f"flags give {args.virtual_pipeline_model_parallel_size}; unset "
                              "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
        _plan = plan
        _announce(plan, args)
        return result
    return validate_args


def _announce(plan, args) -> None:
    if getattr(args, "rank", 0) == 0:
        placement = plan.schedule.placement
        why = f" ({plan.reason})" if plan.reason else f" (from {plan.source})" if plan.source else ""
        print(f"megatron_vshape: pipeline schedule {plan.name}{why}: pp={plan.pp}, {placement.kind} placement, "
              f"{placement.chunks} chunk(s) per rank, {plan.num_microbatches} microbatches", flush=True)


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


def _get_model(orig):
    def get_model(model_provider_func, *args, **kwargs):
        if _is_v():
            model_provider_func = _v_model_provider(model_provider_func, _placement())
        return orig(model_provider_func, *args, **kwargs)
    return get_model


def _v_model_provider(provider: Callable, placement):
    """Megatron-LM's get_model asks for pre/post_process by pipeline rank and virtual stage; on the V,
    chunk c of rank r holds stage `placement.stage_of(r, c)`: the embedding on stage 0, the output layer
    and loss on stage 2p-1, both on rank 0."""
    from megatron.core import parallel_state

    from ..runtime.chunks import _tie_output_to_embedding, _without_embedding_group, chunk_config

    built = {}

    def provide(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, **kwargs):
        rank = parallel_state.get_pipeline_model_parallel_rank()
        stage = placement.stage_of(rank, vp_stage or 0)
        if config is None:
            config = _config_from_args()
        model = provider(pre_process=stage == 0, post_process=stage == placement.num_stages - 1,
                         vp_stage=vp_stage, config=chunk_config(config, placement),
                         pg_collection=_without_embedding_group(pg_collection), **kwargs)
        built[vp_stage] = model
        if rank == 0 and vp_stage == 1 and getattr(model, "share_embeddings_and_output_weights", False):
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

    def get_forward_backward_func(*args, **kwargs):
        if _plan is None:
            return orig(*args, **kwargs)
        if id(_plan) not in cache:
            cache.clear()
            cache[id(_plan)] = _executor(_plan)
        return cache[id(_plan)]
    return get_forward_backward_func


def _executor(plan):
    from megatron.training import get_args

    from ..runtime.executor import get_forward_backward_func
    from ..schedule import registry

    args = get_args()
    named = plan.name in registry.names() and not plan.source  # a --pipeline-schedule-file runs as read
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
    def get_batch_on_this_tp_rank(data_iterator, *args, **kwargs):
        if _is_v():
            from megatron.core import parallel_state

            if parallel_state.get_pipeline_model_parallel_rank() == 0:
                # Rank 0 is the first and the last stage: like pp=1 (or a rank with MTP layers) it needs
                # tokens, labels and loss mask, and Megatron-LM broadcasts them all over TP for this flag.
                args, kwargs = (), {**kwargs, "mtp_on_this_rank": True}
        return orig(data_iterator, *args, **kwargs)
    return get_batch_on_this_tp_rank


HOOKS = (
    ("megatron.training.initialize", "parse_args", _parse_args),
    ("megatron.training.initialize", "validate_args", _validate_args),
    ("megatron.training.training", "initialize_megatron", _initialize_megatron),
    ("megatron.training.training", "get_model", _get_model),
    ("megatron.training.training", "get_forward_backward_func", _get_forward_backward_func),
    ("megatron.training.utils", "is_first_or_last_pipeline_stage", _is_first_or_last_pipeline_stage),
    ("megatron.training.utils", "get_batch_on_this_tp_rank", _get_batch_on_this_tp_rank),
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
    try:
        importlib.import_module("megatron.training")
    except ImportError as e:
        raise ConfigError(f"megatron_vshape.install() needs Megatron-LM's megatron.training package ({e}); run from a "
                          f"Megatron-LM checkout ({' or '.join(SUPPORTED_TAGS)}) or put it on PYTHONPATH") from None
    for module_name, name, make in HOOKS:
        module = importlib.import_module(module_name)
        orig = getattr(module, name, None)
        if orig is None:
            raise ConfigError(f"Megatron-LM's {module_name} has no {name}; megatron_vshape supports Megatron-LM "
                              f"{', '.join(SUPPORTED_TAGS)}")
        _rebind(module, name, orig, functools.wraps(orig)(make(orig)))
    _installed = True


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
