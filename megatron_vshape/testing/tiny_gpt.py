"""A tiny GPT for tests, `megatron-vshape verify` and the CPU benchmarks.

Weights are a pure function of (seed, global parameter name), drawn at full size and sliced for
tensor parallelism, so every parallel layout starts from the same model; data is a pure function
of (seed, step, microbatch).  `reference_run` executes the same steps without any pipelining (on
one rank, or on tp ranks at the pipelined run's tensor parallelism), so pipelined losses and
gradients can be compared exactly, by global parameter name.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..runtime.chunks import build_model_chunks, embedding_ranks_for, global_named_parameters
from ..runtime.loss import loss_func
from ..schedule.errors import ConfigError
from ..schedule.ops import Placement


@dataclass(frozen=True)
class TinyGPT:
    """Sizes of the tiny model and its synthetic data (fp32, no dropout)."""

    num_layers: int = 8
    hidden_size: int = 32
    num_attention_heads: int = 4
    vocab_size: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2
    tied_embeddings: bool = False
    position_embedding_type: str = "learned_absolute"  # or "rope"
    seed: int = 1234
    # Layers per stage in model order, for a placement with that many stages (default: even).
    pipeline_layout: Optional[Tuple[int, ...]] = None

    def transformer_config(self, tp: int = 1, pp: int = 1, **overrides):
        from megatron.core.transformer.transformer_config import TransformerConfig

        options = dict(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, ffn_hidden_size=4 * self.hidden_size,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            params_dtype=torch.float32, pipeline_dtype=torch.float32,
            use_cpu_initialization=True,  # perform_initialization stays on: it also sets TP attributes
            hidden_dropout=0.0, attention_dropout=0.0,
            bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        )
        options.update(overrides)
        return TransformerConfig(**options)


def init_parallel(tp: int, pp: int, placement: Placement, seed: int = 1234) -> None:
    """Initialise megatron parallel_state inside a launched rank for this placement.

    Loop and V placements set virtual_pipeline_model_parallel_size to the chunk count so that
    chunks carry vp_stage; V gets an embedding group of the first pipeline rank only.
    """
    import torch.distributed as dist

    from ..runtime.groups import init_megatron
    from megatron.core import parallel_state

    if dist.is_initialized():
        # Gloo's group set-up is no barrier: the groups dropped here may still be connecting on a
        # slower rank ("Connection closed by peer" there).
        dist.barrier()
    parallel_state.destroy_model_parallel()
    init_megatron(
        tp=tp, pp=pp, seed=seed,
        virtual_pipeline_model_parallel_size=placement.chunks if placement.chunks > 1 else None,
        get_embedding_ranks=embedding_ranks_for(placement),
    )


def build_chunks(tiny: TinyGPT, placement: Placement, tp: int = 1, **config_overrides) -> List[torch.nn.Module]:
    """This rank's chunks of the tiny GPT, weights loaded."""
    config = tiny.transformer_config(tp=tp, pp=placement.pp, **config_overrides)
    chunks = build_model_chunks(
        config, placement, vocab_size=tiny.vocab_size, max_sequence_length=tiny.seq_length,
        share_embeddings_and_output_weights=tiny.tied_embeddings,
        position_embedding_type=tiny.position_embedding_type,
        stage_layers=tiny.pipeline_layout if placement.pp > 1 else None,
    )
    load_weights(chunks, tiny.seed)
    device = rank_device()
    if device.type == "cpu":
        from ..runtime.cpu_spec import use_cpu_rotary

        for chunk in chunks:
            use_cpu_rotary(chunk)
    return [chunk.to(device) for chunk in chunks]


def rank_device() -> torch.device:
    """CUDA under NCCL (the launch harness sets this rank's device), else CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- weights ---------------------------------------------------------------------------------

def _generator(*key) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(key).encode()))
    return g


def full_value(name: str, shape, seed: int) -> torch.Tensor:
    """The full (un-sharded) value of parameter `name`; depends only on (seed, name, shape)."""
    x = torch.randn(tuple(shape), generator=_generator(seed, name), dtype=torch.float32)
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        return 1.0 + 0.1 * x if leaf == "weight" else 0.1 * x
    if leaf == "bias":
        return 0.05 * x
    return 0.1 * x


def _tp_layout(param):
    """(partition dim, tp rank, tp size) of a tensor-parallel shard, or None for a full tensor."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    from megatron.core import parallel_state

    return param.partition_dim, parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def full_shape(param) -> List[int]:
    shape, layout = list(param.shape), _tp_layout(param)
    if layout is not None:
        shape[layout[0]] *= layout[2]
    return shape


def shard(full: torch.Tensor, layout) -> torch.Tensor:
    """This rank's slice of `full` for a (dim, rank, size) layout (None: the whole tensor)."""
    if layout is None:
        return full
    dim, rank, size = layout
    return full.chunk(size, dim=dim)[rank]


def load_weights(chunks, seed: int) -> None:
    with torch.no_grad():
        for chunk in chunks:
            for name, param in global_named_parameters(chunk):
                param.copy_(shard(full_value(name, full_shape(param), seed), _tp_layout(param)).to(param.device))


def named_grads(chunks) -> Dict[str, dict]:
    """{global name: {"grad", "layout"}} of this rank's parameters (main_grad when present)."""
    out = {}
    for chunk in chunks:
        for name, param in global_named_parameters(chunk):
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            out[name] = {"grad": None if grad is None else grad.detach().clone(), "layout": _tp_layout(param)}
    return out


# ---- data ------------------------------------------------------------------------------------

def batch(tiny: TinyGPT, step: int, microbatch: int) -> Dict[str, torch.Tensor]:
    """Synthetic microbatch: tokens, next-token labels, positions and a loss mask."""
    g = _generator(tiny.seed, "data", step, microbatch)
    b, s = tiny.micro_batch_size, tiny.seq_length
    text = torch.randint(0, tiny.vocab_size, (b, s + 1), generator=g)
    mask = torch.ones(b, s)
    mask[:, : int(torch.randint(0, s // 4 + 1, (1,), generator=g))] = 0.0  # varying token counts
    return {"tokens": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous(),
            "position_ids": torch.arange(s).expand(b, s).contiguous(), "loss_mask": mask}


def microbatches(tiny: TinyGPT, step: int, num_microbatches: int) -> Iterator[Dict[str, torch.Tensor]]:
    return (batch(tiny, step, i) for i in range(num_microbatches))


def data_iterators(tiny: TinyGPT, step: int, num_microbatches: int, chunks: int) -> List[Iterator]:
    """One iterator per chunk, each yielding the step's microbatches in order."""
    return [microbatches(tiny, step, num_microbatches) for _ in range(chunks)]


def forward_step(data_iterator, model):
    """Megatron forward_step_func: run one chunk on the next microbatch."""
    from functools import partial

    device = next(model.parameters()).device
    b = {k: v.to(device) for k, v in next(data_iterator).items()}
    output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    return output, partial(loss_func, b["loss_mask"])


def microbatch_loss(loss_dict) -> float:
    """Per-microbatch mean token loss from a loss dict `forward_step` produced."""
    total, count = loss_dict["lm loss"].tolist()
    return total / max(count, 1.0)


# ---- reference -------------------------------------------------------------------------------

def reference_run(tiny: TinyGPT, num_microbatches: int, steps: int = 1, lr: float = 0.0,
                  calculate_per_token_loss: bool = False, tp: int = 1,
                  optimizer: Optional[Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer]] = None,
                  initialise: bool = True) -> dict:
    """Run `steps` steps without pipelining, in a launched rank (or `tp` ranks for tensor parallelism).

    Scales each microbatch's loss as megatron-core does (by 1/tokens/microbatches, or by nothing
    and then the gradients by 1/total tokens with calculate_per_token_loss).  Between steps,
    `optimizer(parameters)`'s step, or else SGD with learning rate `lr` (what the pipelined side
    must do too).  With `tp` > 1 the same model is sharded as a pipelined run at that tp shards it,
    so pipelining is the only difference; the gradients returned are gathered to full size.
    `initialise=False`: the caller has already run init_parallel(tp, 1, ...) in every rank (group
    creation is collective, so ranks that each run different references initialise once).
    Returns {"losses": [[float per microbatch] per step], "grads": [{global name: full grad} per step]}.
    """
    from megatron.core import parallel_state

    placement = Placement("single", 1)
    if initialise:
        init_parallel(tp, 1, placement, seed=tiny.seed)
    sizes = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size())
    if sizes != (tp, 1):
        raise ConfigError(f"reference_run(tp={tp}) found parallel state tp={sizes[0]}, pp={sizes[1]}; call "
                          f"init_parallel({tp}, 1, Placement('single', 1)) first, or pass initialise=True")
    (model,) = build_chunks(tiny, placement, tp=tp)
    opt = optimizer(unique_parameters([model])) if optimizer is not None else None
    losses, grads = [], []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        step_losses, total_tokens = [], 0
        for b in microbatches(tiny, step, num_microbatches):
            b = {k: v.to(rank_device()) for k, v in b.items()}
            output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            loss, tokens, report = loss_func(b["loss_mask"], output)
            if not calculate_per_token_loss:
                loss = loss / torch.clamp(tokens, min=1) / num_microbatches
            loss.backward()
            total_tokens += int(tokens)
            step_losses.append(microbatch_loss(report))
        if calculate_per_token_loss:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad /= max(total_tokens, 1)
        grads.append(full_grads(named_grads([model])))
        losses.append(step_losses)
        if opt is not None:
            opt.step()
        else:
            sgd_step([model], lr)
    return portable({"losses": losses, "grads": grads})


def full_grads(grads: Dict[str, dict]) -> Dict[str, Optional[torch.Tensor]]:
    """{name: full gradient} from `named_grads`, gathering tensor-parallel shards over the TP group
    (a collective: every TP rank calls it with the same parameters)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    out = {}
    for name, g in grads.items():
        grad, layout = g["grad"], g["layout"]
        if grad is None or layout is None or layout[2] == 1:
            out[name] = grad
            continue
        parts = [torch.empty_like(grad) for _ in range(layout[2])]
        dist.all_gather(parts, grad.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        out[name] = torch.cat(parts, dim=layout[0])
    return out


def unique_parameters(chunks) -> List[torch.nn.Parameter]:
    """The chunks' parameters, each once (for an optimizer: a tied weight must be stepped once)."""
    return list(dict.fromkeys(p for chunk in chunks for p in chunk.parameters()))


def sgd_step(chunks, lr: float) -> None:
    """Plain SGD on .grad (or main_grad): elementwise, so it is layout-independent."""
    if not lr:
        return
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is not None:
                    p.add_(g, alpha=-lr)


def portable(obj):
    """Tensors as numpy arrays, recursively: a launched rank's result crosses a process boundary,
    and torch ships tensors through shared-memory handles that die with the rank."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj


def compare(reference: dict, rank_results: List[dict]) -> dict:
    """Largest loss and gradient differences of pipelined ranks against the reference.

    `rank_results[i]` holds {"losses": [[...] per step] or None, "grads": [named_grads per step]}.
    Every reference parameter must be covered by some rank; max_rel_grad_diff is relative to the
    largest reference gradient of the step.
    """
    loss_diff, abs_diff, rel_diff = 0.0, 0.0, 0.0
    reported = [r["losses"] for r in rank_results if r.get("losses") is not None]
    if not reported:
        raise AssertionError("no rank returned losses")
    for losses in reported:
        for ref_step, got_step in zip(reference["losses"], losses, strict=True):
            if len(ref_step) != len(got_step):
                raise AssertionError(f"{len(got_step)} microbatch losses, expected {len(ref_step)}")
            loss_diff = max([loss_diff] + [abs(a - b) for a, b in zip(ref_step, got_step)])
    for step, ref in enumerate(reference["grads"]):
        ref = {n: None if g is None else torch.as_tensor(g) for n, g in ref.items()}
        scale = max(float(g.abs().max()) for g in ref.values() if g is not None)
        seen = set()
        for result in rank_results:
            for name, got in result["grads"][step].items():
                if name not in ref:
                    raise AssertionError(f"parameter {name} is not in the reference model")
                seen.add(name)
                want = shard(ref[name], got["layout"])
                if got["grad"] is None or want is None:
                    if not (got["grad"] is None and want is None):
                        raise AssertionError(f"{name}: gradient missing on one side")
                    continue
                d = float((torch.as_tensor(got["grad"]) - want).abs().max())
                abs_diff, rel_diff = max(abs_diff, d), max(rel_diff, d / scale)
        missing = set(ref) - seen
        if missing:
            raise AssertionError(f"no rank holds parameters {sorted(missing)[:5]}")
    return {"max_abs_loss_diff": loss_diff, "max_abs_grad_diff": abs_diff, "max_rel_grad_diff": rel_diff}
