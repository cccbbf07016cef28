"""The driver's start-up checks that need no model: every numeric flag in its range, the flags that
only make sense together, and every path the run will read or write.  Called by `train.validate`
before any process group exists or any model is built, so a mistake costs seconds, not the
training up to the first save.  Each raises ConfigError naming the flag, its value and the fix.
"""
from __future__ import annotations

import math
import os

from ..argtypes import unwritable
from ..schedule.errors import ConfigError

# (flag dest, lowest value, whether the value may equal it, what to say); None values are unset flags.
_AT_LEAST = (
    [(name, 1, "a whole number >= 1") for name in (
        "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters",
        "log_interval", "tensor_model_parallel_size", "pipeline_model_parallel_size", "ffn_hidden_size",
        "max_position_embeddings", "global_batch_size", "vocab_size", "make_vocab_size_divisible_by", "eval_iters",
        "eval_interval", "save_interval", "lr_decay_iters", "save_retain",
        "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
        "microbatch_group_size_per_vp_stage")]
    + [(name, 0, "a whole number >= 0") for name in ("lr_warmup_iters", "seed", "ckpt_step")]
)
# Floats: (dest, low, high, low allowed, high allowed).
_RANGES = (
    ("lr", 0.0, math.inf, True, False), ("min_lr", 0.0, math.inf, True, False),
    ("weight_decay", 0.0, math.inf, True, False), ("clip_grad", 0.0, math.inf, True, False),
    ("hidden_dropout", 0.0, 1.0, True, False), ("attention_dropout", 0.0, 1.0, True, False),
    ("adam_beta1", 0.0, 1.0, True, False), ("adam_beta2", 0.0, 1.0, True, False),
    ("adam_eps", 0.0, math.inf, False, False), ("init_method_std", 0.0, math.inf, False, False),
    ("peak_tflops", 0.0, math.inf, False, False),
)


def _flag(dest: str) -> str:
    return "--" + {"microbatch_group_size_per_vp_stage": "microbatch_group_size_per_virtual_pipeline_stage"} \
        .get(dest, dest).replace("_", "-")


def check_numbers(args) -> None:
    """Every numeric flag alone: whole numbers at least their minimum, floats finite and in range."""
    for dest, low, what in _AT_LEAST:
        value = getattr(args, dest, None)
        if value is not None and value < low:
            raise ConfigError(f"{_flag(dest)}={value} must be {what}")
    for dest, low, high, low_ok, high_ok in _RANGES:
        value = getattr(args, dest, None)
        if value is None:
            continue
        inside = math.isfinite(value) and (low < value or (low_ok and value == low)) \
            and (value < high or (high_ok and value == high))
        if not inside:
            lo, hi = ("[" if low_ok else "("), ("]" if high_ok else ")")
            span = f"a finite number >= {low:g}" if high == math.inf and low_ok else \
                f"a finite number > {low:g}" if high == math.inf else f"in {lo}{low:g}, {high:g}{hi}"
            raise ConfigError(f"{_flag(dest)}={value} must be {span}")


def check_combinations(args) -> None:
    """Flags that depend on each other; the message blames the one that is out of line."""
    decay = args.lr_decay_iters or args.train_iters
    decay_flag = f"--lr-decay-iters={args.lr_decay_iters}" if args.lr_decay_iters else \
        f"--train-iters={args.train_iters}"
    if args.lr_warmup_iters >= decay:
        raise ConfigError(f"--lr-warmup-iters={args.lr_warmup_iters} must be below the decay iterations "
                          f"({decay_flag}); lower --lr-warmup-iters to at most {decay - 1}, or raise "
                          f"{decay_flag.split('=')[0]}")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr={args.min_lr} is above --lr={args.lr}; the learning rate decays from --lr down to "
                          f"--min-lr: lower --min-lr or raise --lr")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        raise ConfigError(f"--max-position-embeddings={args.max_position_embeddings} is below --seq-length="
                          f"{args.seq_length}; raise it, or leave it unset (default: --seq-length)")
    after = getattr(args, "pipeline_replan_after", None)
    if after is not None and after >= args.train_iters:
        raise ConfigError(f"--pipeline-replan-after={after} is not below --train-iters={args.train_iters}: no iteration "
                          f"would run what it re-plans; use an iteration from 1 to {args.train_iters - 1}")
    if getattr(args, "override_opt_param_scheduler", False) and getattr(args, "use_checkpoint_opt_param_scheduler", False):
        raise ConfigError("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive: the "
                          "first takes this run's learning-rate flags on --load, the second the checkpoint's; pass one")
    for dest, needs in (("load_fallback", "load"), ("ckpt_step", "load"), ("save_retain", "save")):
        value = getattr(args, dest, None)
        if value not in (None, False) and not getattr(args, needs, None):
            shown = _flag(dest) if value is True else f"{_flag(dest)}={value}"
            raise ConfigError(f"{shown} needs --{needs} DIR")


def check_paths(args) -> None:
    """What the run writes (--save, --data-cache-path) can be written; what it reads exists
    (--data-path's .bin/.idx, --load's checkpoint)."""
    for dest in ("save", "data_cache_path"):
        path = getattr(args, dest, None)
        if path:
            why = unwritable(os.path.join(path, "probe"))  # a file inside it: the directory must be makeable
            if why:
                raise ConfigError(f"{_flag(dest)} {path}: cannot write there: {why}; choose a directory you can write")
    from .data import _blend  # Megatron's PREFIX or WEIGHT PREFIX ... pairs (ConfigError when malformed)

    prefixes, _ = _blend(getattr(args, "data_path", None)) or ([], None)
    for prefix in prefixes:
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ConfigError(f"--data-path {prefix}: {' and '.join(missing)} "
                              f"{'do' if len(missing) > 1 else 'does'} not exist; give the prefix of a megatron "
                              f"indexed dataset (PREFIX.bin and PREFIX.idx, without the extension)")
    if getattr(args, "load", None):
        from .checkpoint import find_checkpoint

        find_checkpoint(args.load, getattr(args, "ckpt_step", None))
