"""Layers per stage from the flags, decided before any process group (no torch).

One of: `--pipeline-layout 3,4,4,3` (ours, model order; Megatron's `E|t*..|..L` syntax too),
Megatron's `--pipeline-model-parallel-layout` (its stages in model order; the schedule's
placement decides the ranks), Megatron's `--decoder-first/last-pipeline-num-layers` and
`--account-for-embedding/loss-in-pipeline-split` (their Megatron meaning; on the V first = stage
0, last = stage 2p-1, both on rank 0: see schedule/layout.py), or none: an even split of any
layer count.  The result is `PipelinePlan.stage_layers`, which the driver and the Megatron-LM
hook build their chunks from.
"""
from __future__ import annotations

from typing import Optional

from ..schedule import layout
from ..schedule.errors import ConfigError
from ..schedule.ops import Placement
from .args import planning_budget

# (Megatron-LM attribute, flag) of the layer-split flags, ours first.
SPLIT_FLAGS = (
    ("pipeline_layout", "--pipeline-layout"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
    ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
    ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"),
)
MEGATRON_SPLIT_ATTRS = tuple(attr for attr, _ in SPLIT_FLAGS[1:])


def given_split(args) -> dict:
    """{flag: value} of the layer-split flags set in `args`."""
    return {flag: getattr(args, attr) for attr, flag in SPLIT_FLAGS if getattr(args, attr, None) not in (None, False)}


def stage_layers(args, name: str, placement: Placement) -> layout.Layout:
    """Layers per stage (model order) for schedule `name`; ConfigError naming the flag and the fix."""
    num_layers = getattr(args, "num_layers", None) or 0
    given = given_split(args)
    for attr, flag in SPLIT_FLAGS[:2]:
        text = getattr(args, attr, None)
        if text is None:
            continue
        others = [f for f in given if f != flag]
        if others:
            raise ConfigError(f"{flag} {text} gives every stage's layers; unset {', '.join(others)}")
        return layout.check(layout.parse(text, flag), num_layers, placement, name, flag, str(text))
    first, last = (getattr(args, a, None) for a in MEGATRON_SPLIT_ATTRS[1:3])
    embedding, loss = (bool(getattr(args, a, False)) for a in MEGATRON_SPLIT_ATTRS[3:])
    if given:
        stages = layout.megatron_split(num_layers, placement, first, last, embedding, loss)
        return layout.check(stages, num_layers, placement, name, ", ".join(f"{k}={v}" for k, v in given.items()))
    return layout.even_split(num_layers, placement, name)


def megatron_layout_args(args, stages: Optional[layout.Layout], placement: Placement) -> None:
    """Hand Megatron-LM the layout as its own --pipeline-model-parallel-layout (stages in model order;
    the hook places them along the V) when it differs from Megatron's even split or split flags were
    given, clearing the split flags it replaces.  Megatron-LM then derives the virtual pipeline size
    from it."""
    if stages is None:
        return
    even = layout.even(sum(stages), placement.num_stages)
    if tuple(stages) == even and sum(stages) % placement.num_stages == 0 and not given_split(args):
        return
    for attr in MEGATRON_SPLIT_ATTRS:
        setattr(args, attr, False if attr.startswith("account") else None)
    args.pipeline_layout = None
    args.pipeline_model_parallel_layout = layout.to_megatron(stages)


def model_shape(args):
    """The model's shape for the stage-cost estimate, from Megatron-LM's attribute names; the machine is
    `args.pipeline_machine` (the driver sets "cpu" without CUDA; Megatron-LM runs on GPUs)."""
    from ..schedule.balance import MACHINES, ModelShape

    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None)
    missing = [f for f, v in (("--hidden-size", getattr(args, "hidden_size", None)),
                              ("--seq-length", getattr(args, "seq_length", None)), ("--vocab-size", vocab)) if not v]
    if missing:
        raise ConfigError(f"--pipeline-balance auto estimates stage costs from the model's shape; give "
                          f"{', '.join(missing)}")
    dtype_bytes = 2 if getattr(args, "bf16", False) or getattr(args, "fp16", False) else 4
    return ModelShape(args.num_layers, args.hidden_size, args.seq_length, vocab,
                      getattr(args, "ffn_hidden_size", None), getattr(args, "tensor_model_parallel_size", None) or 1,
                      getattr(args, "micro_batch_size", None) or 1, dtype_bytes,
                      MACHINES[getattr(args, "pipeline_machine", None) or "gpu"])


def balanced_layout(args, name: str, pp: int, m: int, costs, options: dict, path: Optional[str]):
    """(schedule, layers per stage, report) for --pipeline-balance auto: the layout whose estimated stage
    costs simulate fastest within --pipeline-memory-budget (schedule/balance.py)."""
    from ..schedule.balance import balance

    given = given_split(args)
    if given:
        raise ConfigError(f"--pipeline-balance auto chooses every stage's layers; unset {', '.join(given)}")
    if path is not None:
        raise ConfigError(f"--pipeline-balance auto plans the schedule for the layout it picks; --pipeline-schedule-file "
                          f"{path} holds its own order: pass --pipeline-schedule NAME instead")
    budget = planning_budget(args)
    shape = model_shape(args)
    result = balance(shape, name, pp, m, costs, budget, **options)
    return result.schedule, result.layout, (f"--pipeline-balance auto ({name}, estimated from the model's shape for "
                                            f"{shape.machine.about}):\n" + result.summary())


SHAPE_KEYS = {"num_layers": "num_layers", "hidden_size": "hidden_size", "seq_length": "seq_length",
              "vocab_size": "vocab_size", "ffn_hidden_size": "ffn_hidden_size",
              "tensor_model_parallel_size": "tensor_model_parallel_size", "micro_batch_size": "micro_batch_size"}


def shape_from_config(path: str, vocab_size: Optional[int] = None, machine: Optional[str] = None):
    """The model's shape from a driver config (YAML of flag names, e.g. configs/gpt/gpt-6.7b.yaml); other
    keys are ignored.  `vocab_size` overrides the file's.  `machine`: what the estimate prices, "gpu"
    (default: bf16) or "cpu" (fp32, as the driver trains without CUDA)."""
    import yaml

    from ..schedule.balance import MACHINES, ModelShape

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"--model {path}: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--model {path}: not a YAML file of flag values ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--model {path}: expected a mapping of flag names to values (e.g. configs/gpt/*.yaml)")
    values = {SHAPE_KEYS[k]: v for k, v in ((str(k).lstrip("-").replace("-", "_"), v) for k, v in data.items())
              if k in SHAPE_KEYS}
    if vocab_size:
        values["vocab_size"] = vocab_size
    missing = [k for k in ("num_layers", "hidden_size", "seq_length", "vocab_size") if k not in values]
    if missing:
        raise ConfigError(f"--model {path} has no {', '.join(k.replace('_', '-') for k in missing)}; give the model's "
                          "shape (num-layers, hidden-size, seq-length, vocab-size; ffn-hidden-size and "
                          "tensor-model-parallel-size optional)")
    machine = MACHINES[machine or "gpu"]
    return ModelShape(**values, dtype_bytes=4 if machine.name == "cpu" else 2, machine=machine)
