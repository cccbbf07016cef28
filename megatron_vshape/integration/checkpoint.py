"""Checkpoints through megatron-core's dist_checkpointing that any schedule can resume.

Every tensor is stored under what it is in the non-pipelined model (the chunks' own
`sharded_state_dict()`: global layer numbers, which `runtime.chunks.VShapeLayerLayout` makes true
on the V too), never under the rank or chunk that held it, so megatron-core reshards on load: a run
saved under one schedule, pp or tp resumes under any other with the same model sizes.  On disk the
layout is Megatron-LM's: `DIR/iter_0000010/` (torch_dist backend) and
`DIR/latest_checkpointed_iteration.txt`, written after every rank has finished saving.

Saved:
  * model: each chunk's sharded state dict (the V's tied weight once, under the embedding key).
  * optimizer: a MegatronOptimizer's own `sharded_state_dict`; a plain `torch.optim` optimizer's
    per-parameter tensors (Adam's exp_avg, exp_avg_sq, SGD's momentum_buffer) as
    `optimizer.state.<name>.<parameter key>`, sharded like their parameter, and its per-parameter
    scalars (Adam's step, equal for all parameters) and group hyper-parameters as common state.
  * the scheduler's state_dict(), the iteration, `extra`, the model sizes (checked on load) and
    the parallel layout.
  * every rank's RNG states (python, numpy, torch, CUDA, megatron-core's tracker), restored only
    when pp, tp, dp and the world size are unchanged: another layout draws other streams.

Each checkpoint also records the size and SHA-256 of every file it wrote (`ckpt_integrity`);
a load checks them first and refuses a damaged checkpoint, naming the file and the newest intact
checkpoint beside it (which `fallback` loads instead).

Both functions are collective (every rank calls them); a problem any rank finds before a
collective starts (no checkpoint, a damaged file, other model sizes, another optimizer) is raised
on every rank.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import random
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..schedule.errors import ConfigError
from . import ckpt_integrity as integrity

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1
# Model sizes that must match for a checkpoint to load (what a GPT's tensors' global shapes follow).
_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
          "kv_channels", "normalization", "add_bias_linear", "gated_linear_unit")


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's directory of one checkpoint under a --save/--load directory."""
    return os.path.join(root, f"iter_{iteration:07d}")


def save_checkpoint(path: str, iteration: int, model_chunks: List[torch.nn.Module], optimizer,
                    scheduler=None, extra: Optional[dict] = None, *, retain: Optional[int] = None,
                    keep: Tuple[str, ...] = ()) -> str:
    """Save this rank's share of the model, optimizer, scheduler and RNG as `path/iter_<iteration>`,
    with the checksums of its files (`ckpt_integrity`).

    Collective.  `extra` (picklable, equal on all ranks) comes back from `load_checkpoint`; the
    driver puts the schedule name and its arguments there.  `retain`: then delete all but the
    newest `retain` checkpoints in `path`, never one in `keep`.  Returns the checkpoint's directory.
    """
    from megatron.core import dist_checkpointing

    target = iteration_dir(path, iteration)
    error = None
    if importlib.util.find_spec("psutil") is None:
        # Without it megatron-core's writer processes fail and its save waits for them forever.
        error = "saving a checkpoint needs psutil (megatron-core's torch_dist writer uses it): pip install psutil"
    elif _rank() == 0:
        try:
            os.makedirs(target, exist_ok=True)
        except OSError as e:
            error = f"cannot create checkpoint directory {target}: {e}"
    _agree(error)
    model_sd = _model_sharded(model_chunks)
    state = {
        **model_sd,
        "optimizer": _optimizer_sharded(optimizer, model_sd, loading=False),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "iteration": int(iteration),
        "extra": extra,
        "checkpoint": {"format_version": FORMAT_VERSION, "model": _model_sizes(model_chunks),
                       "layout": _layout(), "optimizer_type": _optimizer_type(optimizer)},
        "rng_state": _rng_sharded(_rng_state()),
    }
    with _torch_dist_in_process():
        dist_checkpointing.save(state, target)
    _barrier()
    names = integrity.files(target) if _rank() == 0 else None
    names = _broadcast(names)
    entries = {}
    for part in _gather(integrity.digests(target, integrity.share(names, _rank(), _world()))):
        entries.update(part)
    if _rank() == 0:  # the tracker names a checkpoint only once all of it, and its checksums, are on disk
        integrity.write_manifest(target, entries)
        tmp = os.path.join(path, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(f"{iteration}\n")
        os.replace(tmp, os.path.join(path, TRACKER))
        if retain:
            integrity.retire(path, retain, keep=(target,) + tuple(keep))
    _barrier()
    return target


def load_checkpoint(path: str, model_chunks: List[torch.nn.Module], optimizer, scheduler=None, *,
                    load_optimizer: bool = True, load_rng: bool = True, step: Optional[int] = None,
                    fallback: bool = False) -> Tuple[int, Any]:
    """Load the checkpoint at `path` (a --save directory, whose tracker names the latest one, or
    an `iter_*` directory; `step`: that iteration's under the --save directory) into this rank's
    chunks, optimizer and scheduler; return (iteration, extra).  Collective.  ConfigError (on every
    rank) when there is no checkpoint, when a file of it does not match its checksum (naming the
    newest intact checkpoint beside it, which `fallback` loads instead), or when it was saved for
    other model sizes or another optimizer; other schedules, pp and tp are fine.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    error, common, target = None, None, None
    try:
        target = find_checkpoint(path, step)
    except ConfigError as e:
        error = str(e)
    _agree(error)
    target = _intact(target, fallback)
    try:
        common = dist_checkpointing.load_common_state_dict(target)
        error = _incompatibility(target, common, model_chunks, optimizer if load_optimizer else None)
    except ConfigError as e:
        error = str(e)
    except Exception as e:  # unreadable common state: not a dist checkpoint of ours
        error = f"{path}: not a readable dist_checkpointing checkpoint ({type(e).__name__}: {e})"
    _agree(error)

    model_sd = _model_sharded(model_chunks)
    request = dict(model_sd)
    if load_optimizer and optimizer is not None:
        request["optimizer"] = _optimizer_sharded(optimizer, model_sd, loading=True, common=common["optimizer"])
    same_layout = common["checkpoint"]["layout"] == _layout()
    if load_rng and same_layout:
        request["rng_state"] = _rng_sharded(_rng_state())
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: `Exception` misses it

    try:
        with _torch_dist_in_process():
            loaded, _, absent = dist_checkpointing.load(request, target, strict=StrictHandling.RETURN_ALL)
    except (Exception, CheckpointException) as e:  # only a checkpoint without checksums gets here damaged: one line
        raise ConfigError(f"checkpoint {target} cannot be read ({type(e).__name__}: {e}); it has no "
                          f"{integrity.MANIFEST} to tell which file is damaged; load another checkpoint") from None
    _agree(f"{target} has no {', '.join(sorted(absent)[:8])}{' ...' if len(absent) > 8 else ''} "
           f"that this model needs (saved from another model?)" if absent else None)

    for chunk, key in zip(model_chunks, _model_keys(model_chunks)):
        _unwrap(chunk).load_state_dict(loaded[key], strict=True)
    if load_optimizer and optimizer is not None:
        _load_optimizer(optimizer, loaded["optimizer"])
    if scheduler is not None and loaded.get("scheduler") is not None:
        try:
            scheduler.load_state_dict(loaded["scheduler"])
        except AssertionError as e:  # megatron-core's scheduler: a flag differs from the checkpoint's
            raise ConfigError(f"{target}: {str(e).replace('checkpointvalue', 'checkpoint value')} (the learning-rate "
                              "schedule of this run's flags is not the checkpoint's); pass "
                              "--override-opt-param-scheduler to train on with this run's flags, or "
                              "--use-checkpoint-opt-param-scheduler to keep the checkpoint's") from None
    if load_rng and same_layout:
        _set_rng_state(loaded["rng_state"])
    return int(loaded["iteration"]), loaded.get("extra")


def find_checkpoint(path: str, step: Optional[int] = None) -> str:
    """The checkpoint directory `path` names: itself when it holds one, else the one its
    tracker file names (or `step`'s, Megatron-LM's --ckpt-step).  ConfigError when there is none."""
    if step is not None:
        target = iteration_dir(path, step)
        if not os.path.isfile(os.path.join(target, "metadata.json")):
            have = [it for it, d in integrity.iteration_dirs(path) if os.path.isfile(os.path.join(d, "metadata.json"))]
            raise ConfigError(f"--ckpt-step {step}: {target} holds no complete checkpoint; {path} has iterations "
                              f"{', '.join(map(str, sorted(have))) or 'none'}")
        return target
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        what = "does not exist" if not os.path.exists(path) else f"has no {TRACKER} and is no checkpoint"
        raise ConfigError(f"no checkpoint to load at {path}: it {what}; pass the --save directory of an "
                          f"earlier run (or drop --load to start from scratch)")
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ConfigError(f"{tracker} holds {text!r}, not an iteration number; Megatron-LM's 'release' "
                          f"checkpoints are not supported")
    target = iteration_dir(path, int(text))
    if not os.path.isfile(os.path.join(target, "metadata.json")):
        raise ConfigError(f"{tracker} names iteration {text}, but {target} holds no complete checkpoint")
    return target


def _damage(target: str, note_unchecked: bool = False) -> Optional[str]:
    """What is wrong with the files of `target` (each rank checks its share), or None; the same on
    every rank.  Collective."""
    problem = None
    try:
        manifest = integrity.read_manifest(target)
    except ValueError as e:
        problem = str(e)
    else:
        if manifest is not None:
            names = integrity.share(sorted(manifest), _rank(), _world())
            problem = integrity.problem(target, manifest, names)
        elif note_unchecked and _rank() == 0:
            print(f"  {target} has no {integrity.MANIFEST} (saved by an older version): loading it unchecked",
                  flush=True)
    return next((p for p in _gather(problem) if p), None)


def _intact(target: str, fallback: bool) -> str:
    """`target` when its files match their checksums, else (with `fallback`) the newest intact
    checkpoint beside it; ConfigError naming the damaged file and that checkpoint.  Collective."""
    problem = _damage(target, note_unchecked=True)
    if problem is None:
        return target
    root = os.path.dirname(os.path.abspath(target))
    intact = next((d for _, d in integrity.iteration_dirs(root)
                   if os.path.abspath(d) != os.path.abspath(target)
                   and os.path.isfile(os.path.join(d, "metadata.json")) and _damage(d) is None), None)
    head = f"checkpoint {target} is damaged: {problem}"
    if intact is None:
        raise ConfigError(f"{head}; no intact checkpoint in {root} to load instead; start without --load")
    if not fallback:
        iteration = os.path.basename(intact)[len("iter_"):].lstrip("0") or "0"
        raise ConfigError(f"{head}; the newest intact checkpoint is {intact}: pass --load {root} --load-fallback "
                          f"(or --ckpt-step {iteration})")
    if _rank() == 0:
        print(f"  {head}; loading the newest intact checkpoint, {intact} (--load-fallback)", flush=True)
    return intact


# ---- model ----------------------------------------------------------------------------------

def _unwrap(chunk):
    """The GPTModel inside wrappers (DDP, Float16Module, ...): they keep it in `.module`."""
    while not hasattr(chunk, "vocab_size") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_keys(model_chunks) -> List[str]:
    # Megatron-LM's names; a tensor's checkpoint key is its ShardedTensor key, not this dict key.
    return ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]


def _model_sharded(model_chunks) -> Dict[str, dict]:
    # The GPTModel's own keys, as Megatron-LM saves them (it unwraps too): megatron-core's DDP has no
    # sharded_state_dict of its own and would prefix every key with "module.".
    return {key: _unwrap(chunk).sharded_state_dict() for key, chunk in zip(_model_keys(model_chunks), model_chunks)}


def _model_sizes(model_chunks) -> dict:
    model = _unwrap(model_chunks[0])
    config = model.config
    sizes = {k: getattr(config, k, None) for k in _SIZES}
    sizes.update(vocab_size=getattr(model, "vocab_size", None),
                 tied_embeddings=bool(getattr(model, "share_embeddings_and_output_weights", False)),
                 position_embedding_type=getattr(model, "position_embedding_type", None),
                 max_sequence_length=getattr(model, "max_sequence_length", None))  # learned positions' rows
    return sizes


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {"pp": ps.get_pipeline_model_parallel_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "world_size": _world()}


def _incompatibility(target: str, common: dict, model_chunks, optimizer) -> Optional[str]:
    meta = common.get("checkpoint") if isinstance(common, dict) else None
    if not meta or meta.get("format_version") != FORMAT_VERSION:
        return (f"{target} is not a megatron_vshape checkpoint of format {FORMAT_VERSION} "
                f"(found {None if not meta else meta.get('format_version')}); save it with this version")
    saved, mine = meta["model"], _model_sizes(model_chunks)
    # A size an older checkpoint did not record (max_sequence_length) is not compared.
    differ = [f"{k}={saved[k]} (this model: {mine[k]})" for k in mine if k in saved and saved[k] != mine[k]]
    if differ:
        hint = ""
        if [d.split("=")[0] for d in differ] == ["vocab_size"]:
            # The driver and Megatron-LM pad the vocabulary to a multiple of --make-vocab-size-divisible-by x tp.
            hint = (" (the vocabulary is padded to a multiple of --make-vocab-size-divisible-by x tensor-parallel size: "
                    "after a tp change, scale --make-vocab-size-divisible-by by old tp / new tp to pad as it was saved)")
        return (f"{target} was saved for another model: {', '.join(differ)}; load it with the model sizes it was "
                f"saved with{hint}")
    if optimizer is not None and meta["optimizer_type"] != _optimizer_type(optimizer):
        return (f"{target} holds the state of optimizer {meta['optimizer_type']}, this run uses "
                f"{_optimizer_type(optimizer)}; use the same optimizer (or load without the optimizer state)")
    return None


# ---- optimizer ------------------------------------------------------------------------------

def _is_megatron_optimizer(optimizer) -> bool:
    return not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "sharded_state_dict")


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer itself, inside a thin wrapper that keeps it in `.optimizer` (the
    driver's CPU stand-in for megatron-core's optimizer)."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"cannot checkpoint optimizer {type(optimizer).__name__}: it is neither a torch.optim "
                          f"optimizer nor a megatron-core MegatronOptimizer (nor wraps one in .optimizer)")
    return optimizer


def _optimizer_type(optimizer) -> Optional[str]:
    """What the saved optimizer state is the state of (a load needs the same)."""
    if optimizer is None:
        return None
    if _is_megatron_optimizer(optimizer):
        inner = getattr(optimizer, "optimizer", None)
        return type(optimizer).__name__ + (f"({type(inner).__name__})" if inner is not None else "")
    return type(_torch_optimizer(optimizer)).__name__


def _params(optimizer) -> List[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _optimizer_sharded(optimizer, model_sd, *, loading: bool, common: Optional[dict] = None):
    """The optimizer's sharded state dict; when loading, templates shaped like the saved state."""
    if optimizer is None:
        return None
    if _is_megatron_optimizer(optimizer):
        return optimizer.sharded_state_dict(model_sd, is_loading=loading)
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            make_sharded_optimizer_tensor)

    optimizer = _torch_optimizer(optimizer)
    params = _params(optimizer)
    by_id = get_param_id_to_sharded_param_map(model_sd, params)
    unmapped = [i for i in range(len(params)) if i not in by_id]
    _agree(f"the optimizer holds {len(unmapped)} parameter(s) that are not in the model chunks' sharded "
           f"state dict (shapes {[tuple(params[i].shape) for i in unmapped[:4]]}); build the optimizer "
           f"over the chunks' parameters" if unmapped else None)
    if loading:
        tensor_keys = common["tensor_keys"] if common else []
        per_param = [{k: torch.empty_like(p) for k in tensor_keys} for p in params]
    else:
        per_param = [optimizer.state.get(p, {}) for p in params]
    tensors: Dict[str, Dict[int, Any]] = {}
    scalars: Dict[str, Any] = {}
    error = None
    for i, (p, state) in enumerate(zip(params, per_param)):
        for name, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == p.shape:
                tensors.setdefault(name, {})[i] = make_sharded_optimizer_tensor(
                    by_id[i], value, prefix=f"optimizer.state.{name}")
            elif name not in scalars:
                scalars[name] = value
            elif not _equal(scalars[name], value):
                error = (f"optimizer state {name!r} differs between parameters ({scalars[name]} and {value}); "
                         f"only per-parameter scalars that all parameters share can be checkpointed")
    _agree(error)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"tensors": tensors, "scalars": scalars, "tensor_keys": sorted(tensors), "param_groups": groups}


def _equal(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    return a == b


def _load_optimizer(optimizer, loaded) -> None:
    if _is_megatron_optimizer(optimizer):
        optimizer.load_state_dict(loaded)
        return
    optimizer = _torch_optimizer(optimizer)
    params = _params(optimizer)
    state = {i: {} for i in range(len(params))} if (loaded["tensors"] or loaded["scalars"]) else {}
    for name, by_index in loaded["tensors"].items():
        for i, value in by_index.items():
            state[int(i)][name] = value
    for i in state:
        for name, value in loaded["scalars"].items():
            state[i][name] = value.clone() if torch.is_tensor(value) else value
    # Hyper-parameters come from the checkpoint when its groups line up with this optimizer's
    # (the scheduler sets lr and weight decay each step anyway); the parameters stay local.
    saved = loaded["param_groups"]
    groups = [{**(saved[j] if len(saved) == len(optimizer.param_groups) else
                  {k: v for k, v in g.items() if k != "params"}),
               "params": list(range(sum(len(h["params"]) for h in optimizer.param_groups[:j]),
                                    sum(len(h["params"]) for h in optimizer.param_groups[:j + 1])))}
              for j, g in enumerate(optimizer.param_groups)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---- RNG ------------------------------------------------------------------------------------

def _rng_state() -> dict:
    import numpy as np
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state["tracker"]:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded(state: dict):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # One object per global rank: restored only into the same layout, where rank r is the same place.
    return ShardedObject("rng_state", state, (_world(),), (_rank(),), replica_id=0)


@contextlib.contextmanager
def _torch_dist_in_process():
    """Run megatron-core 0.16's synchronous torch_dist save/load inside this process.

    * Its writer collects write results through a module-level queue that it creates, on first
      use, from a multiprocessing Manager: a server process that outlives a rank which is killed
      rather than exited.  A synchronous save puts and gets in this process, so a plain queue
      serves (set for the call only; an asynchronous save would make its own).
    * It calls torch.cuda.synchronize() after staging tensors and puts its write-failure flag on
      torch.cuda.current_device(); without CUDA both only raise, so on such a machine (CPU ranks
      over gloo) they mean "the CPU" for the duration of the call.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    saved_queue = filesystem_async._results_queue
    if saved_queue is None:
        filesystem_async._results_queue = queue.Queue()
    saved_cuda = torch.cuda.synchronize, torch.cuda.current_device
    if not torch.cuda.is_available():
        torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: torch.device("cpu"))
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved_cuda
        filesystem_async._results_queue = saved_queue


# ---- collectives ------------------------------------------------------------------------------

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _gather(value) -> list:
    """`value` of every rank, in rank order."""
    if _world() == 1:
        return [value]
    out = [None] * _world()
    dist.all_gather_object(out, value)
    return out


def _broadcast(value):
    """Rank 0's `value` on every rank."""
    box = [value]
    if _world() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _agree(error: Optional[str]) -> None:
    """Raise ConfigError on every rank when any rank found a problem, before anyone enters a
    collective that the others would wait in forever."""
    errors = [error]
    if _world() > 1:
        errors = [None] * _world()
        dist.all_gather_object(errors, error)
    for rank, message in enumerate(errors):
        if message:
            raise ConfigError(message if message == error or _world() == 1 else f"rank {rank}: {message}")
