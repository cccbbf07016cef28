"""The B/W split: weight-gradient GEMMs deferred from B to the W op of the same stage and microbatch.

Scope.  megatron-core's `ColumnParallelLinear` and `RowParallelLinear` (the GPT output layer
included) defer their weight GEMM; every other parameter (norms, biases, embeddings) gets its
gradient in B, as autograd computes it.  `install(chunk)` routes those layers' matmul through
`_SplitLinear` below; it behaves exactly like megatron-core's own
`LinearWithGradAccumulationAndAsyncCommunication` unless a forward runs inside
`split_forward()`, so schedules without a split (BW ops) run megatron-core's code unchanged.

How a weight's gradient is kept away from B.  A forward under `split_forward()` gives autograd
the weight *detached*, so B (an ordinary `backward`) has no edge to the weight: neither its
`.grad` nor the gradient-accumulation hooks of distributed data parallelism see anything in B.
Its backward stores (weight, grad_output, input) in the list `collect()` installed for that B.
`run(entries)` at W computes the GEMMs and then lets autograd accumulate the results into the
weights (`torch.autograd.backward` on the weights as leaves), which fires the accumulation hooks
exactly once per weight per microbatch, after the weight's gradient of that microbatch exists.

Paths.  `gradient_accumulation_fusion` (a weight with `main_grad`): the GEMM accumulates into
`main_grad` (apex's fused kernel on CUDA when present, `addmm_` otherwise) and, as megatron-core
does, a dummy gradient with `grad_added_to_main_grad = True` drives the hooks.  Plain path: the
GEMM result is accumulated into `.grad` by autograd.

Tensor and sequence parallelism.  B does the input-gradient GEMM and its all-reduce (TP) or
reduce-scatter (sequence parallelism), as megatron-core does.  With sequence parallelism W
**re-gathers** the input from its sequence shard (one all-gather per layer at W) instead of
keeping the gathered input alive from B to W; it costs communication, saves tp times the
memory, and matches what megatron-core does at backward time.  All ranks of a TP group run the
same op list, so those collectives line up.

Transformer Engine >= 2.3 (GPU only, import-guarded, never imported here at module import):
layers built with `delay_wgrad_compute` defer by themselves; `te_backward_dw(chunk)` calls
their `backward_dw()` at W.  TE keeps one FIFO per layer, so it needs W in B order per stage;
`check_fifo_w_order` says whether a schedule satisfies that.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist


class _State:
    split = False  # forwards now record for a deferred W
    collect: Optional[List["WgradEntry"]] = None  # B now stores deferred GEMMs here
    tracker: Optional[Callable[[torch.Tensor], object]] = None  # stats: hold memory of stored tensors


_state = _State()


class WgradEntry:
    """One deferred weight-gradient GEMM."""

    __slots__ = ("weight", "grad_output", "input", "sequence_parallel", "tp_group", "fusion", "held")

    def __init__(self, weight, grad_output, input, sequence_parallel, tp_group, fusion):
        self.weight, self.grad_output, self.input = weight, grad_output, input
        self.sequence_parallel, self.tp_group, self.fusion = sequence_parallel, tp_group, fusion
        self.held = [_state.tracker(t) for t in (grad_output, input)] if _state.tracker else None

    def compute(self) -> Optional[torch.Tensor]:
        """Run the GEMM. Returns the gradient for autograd to accumulate (dummy on main_grad)."""
        total_input = _gather_sequence(self.input, self.tp_group) if self.sequence_parallel else self.input
        g = self.grad_output.reshape(-1, self.grad_output.shape[-1])
        x = total_input.reshape(-1, total_input.shape[-1])
        w = self.weight
        if self.fusion and hasattr(w, "main_grad"):
            fused = _apex_wgrad_kernel() if g.is_cuda else None
            if fused is not None:
                fn = fused.wgrad_gemm_accum_fp32 if w.main_grad.dtype == torch.float32 else fused.wgrad_gemm_accum_fp16
                fn(x, g, w.main_grad)
            else:
                w.main_grad.addmm_(g.t().to(w.main_grad.dtype), x.to(w.main_grad.dtype))
            if not hasattr(w, "grad_added_to_main_grad"):
                return None  # no DDP hooks to drive
            w.grad_added_to_main_grad = True
            make = torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty
            return make(w.main_grad.shape, dtype=self.input.dtype, device=w.main_grad.device)
        return g.t().matmul(x)


@functools.lru_cache(maxsize=None)
def _apex_wgrad_kernel():
    """apex's fused wgrad-accumulate kernel, or None; imported on first CUDA use, never at module import."""
    try:
        import fused_weight_gradient_mlp_cuda  # type: ignore
    except ImportError:
        return None
    return fused_weight_gradient_mlp_cuda


def _gather_sequence(t: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = torch.empty((t.shape[0] * size,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


class _Ref:
    """Carries the weight Parameter past autograd.Function.apply without creating an edge."""

    __slots__ = ("param",)

    def __init__(self, param):
        self.param = param


# Backward under the autocast state of the forward, as megatron-core's linear does (its
# config.enable_autocast is CUDA autocast; without it these are no-ops on every device).
_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="cuda")
_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="cuda")


class _SplitLinear(torch.autograd.Function):
    """megatron-core's linear with the weight GEMM left to W (see the module docstring)."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input, weight_data, bias, ref, fusion, allreduce_dgrad, sequence_parallel, tp_group):
        ctx.save_for_backward(input, weight_data)
        ctx.ref, ctx.fusion, ctx.use_bias = ref, fusion, bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        total_input = _gather_sequence(input, tp_group) if sequence_parallel else input
        output = torch.matmul(total_input, weight_data.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        if ctx.sequence_parallel:
            sub = torch.empty(input.shape, dtype=input.dtype, device=input.device)
            handle = dist.reduce_scatter_tensor(sub, grad_input.contiguous(), group=ctx.tp_group, async_op=True)
            grad_input = sub
        entry = WgradEntry(ctx.ref.param, grad_output, input, ctx.sequence_parallel, ctx.tp_group, ctx.fusion)
        if _state.collect is not None:
            _state.collect.append(entry)
        else:  # a backward outside any B op (e.g. a user's own backward): no W will come
            run([entry])
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, None, grad_bias, None, None, None, None, None


# Arguments of megatron-core's linear_with_grad_accumulation_and_async_allreduce, in order.
_LINEAR_ARGS = ("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
                "grad_output_buffer", "wgrad_deferral_limit", "tp_group")


def _split_forward_impl(module, args, kwargs):
    """Replacement for `{Column,Row}ParallelLinear._forward_impl` installed by `install`."""
    call = dict(zip(_LINEAR_ARGS, args), **kwargs)
    if not (_state.split and call["weight"].requires_grad):
        return type(module)._forward_impl(module, *args, **kwargs)  # megatron-core's own, as called
    from ..schedule.errors import ConfigError

    # A newer megatron-core may pass options this split does not implement: refuse rather than ignore.
    unknown = {k: v for k, v in call.items() if k not in _LINEAR_ARGS and v is not None}
    if unknown:
        raise ConfigError(f"{type(module).__name__} passes {sorted(unknown)} to its linear function, which the B/W "
                          "split of megatron_vshape does not implement; use a schedule without a split (1f1b)")
    if call.get("grad_output_buffer") is not None:
        raise ConfigError("defer_embedding_wgrad_compute=True conflicts with a B/W-split schedule, which already "
                          "defers the output layer's weight gradient to W; set defer_embedding_wgrad_compute=False")
    tp_group = call.get("tp_group")
    if tp_group is None and (call["allreduce_dgrad"] or call["sequence_parallel"]):
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()  # megatron-core's fallback for None
    weight = call["weight"]
    return _SplitLinear.apply(call["input"], weight.detach(), call["bias"], _Ref(weight),
                              call["gradient_accumulation_fusion"], call["allreduce_dgrad"], call["sequence_parallel"],
                              tp_group)


def install(chunk: torch.nn.Module) -> int:
    """Route the chunk's Column/RowParallelLinear matmuls through the splittable function.

    Idempotent; returns how many layers were routed.  Outside `split_forward()` they run
    megatron-core's own function, so installing is harmless for schedules without a split.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    count = 0
    for module in chunk.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if "_forward_impl" not in vars(module):
                module._forward_impl = _bind(module)
            count += 1
    return count


def _bind(module):
    def forward_impl(*args, **kwargs):
        return _split_forward_impl(module, args, kwargs)

    return forward_impl


@contextmanager
def split_forward(enabled: bool = True) -> Iterator[None]:
    """Forwards inside leave their weight GEMMs' backward to a later W."""
    prev, _state.split = _state.split, enabled
    try:
        yield
    finally:
        _state.split = prev


@contextmanager
def collect(entries: List[WgradEntry]) -> Iterator[List[WgradEntry]]:
    """A B op: deferred weight GEMMs of the backward inside are appended to `entries`."""
    prev, _state.collect = _state.collect, entries
    try:
        yield entries
    finally:
        _state.collect = prev


def run(entries: List[WgradEntry]) -> None:
    """A W op: compute the deferred GEMMs and accumulate them (firing the weights' grad hooks)."""
    weights, grads = [], []
    for entry in entries:
        with torch.no_grad():  # as inside autograd's backward; gloo's all-gather writes into views
            grad = entry.compute()
        if grad is not None:
            weights.append(entry.weight)
            grads.append(grad)
        entry.grad_output = entry.input = entry.held = None
    if weights:
        torch.autograd.backward(weights, grads)


def set_tracker(tracker: Optional[Callable[[torch.Tensor], object]]) -> None:
    """Stats hook: `tracker(t)` returns a token that holds t's bytes until the token is dropped."""
    _state.tracker = tracker


def te_modules(chunk: torch.nn.Module) -> list:
    """Transformer Engine layers of the chunk (megatron-core's TE wrappers included) built with
    delay_wgrad_compute, which defer their weight gradients themselves.  [] without TE."""
    try:  # imported here, never at module import: TE is GPU-only and optional
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    except ImportError:
        return []
    return [m for m in chunk.modules()
            if isinstance(m, TransformerEngineBaseModule) and callable(getattr(m, "need_backward_dw", None))
            and m.need_backward_dw()]


def te_backward_dw(modules: list) -> None:
    """W for Transformer Engine layers built with delay_wgrad_compute (TE >= 2.3)."""
    for module in modules:
        module.backward_dw()


def check_fifo_w_order(ops) -> Optional[str]:
    """None if, on every stage, W ops come in the order of their B ops (TE's per-layer FIFO needs it)."""
    b_order, w_order = {}, {}
    for op in ops:
        if op.kind == "B":
            b_order.setdefault(op.stage, []).append(op.microbatch)
        elif op.kind == "W":
            w_order.setdefault(op.stage, []).append(op.microbatch)
    for stage, ws in w_order.items():
        if ws != b_order.get(stage):
            return f"stage {stage}: B order {b_order.get(stage)} but W order {ws}"
    return None
