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
does, a dummy gradient with `grad_added_to_main_grad = True` drives the hooks (one reused buffer
per shape and dtype).  Plain path: the GEMM result is accumulated into `.grad` by autograd.  Either
way W handles one weight at a time, so it holds one weight's gradient, not the stage's.

Tensor and sequence parallelism.  B does the input-gradient GEMM and its all-reduce (TP) or
reduce-scatter (sequence parallelism), as megatron-core does.  With sequence parallelism W
**re-gathers** the input from its sequence shard (one all-gather per layer at W) instead of
keeping the gathered input alive from B to W; it costs communication, saves tp times the
memory, and matches what megatron-core does at backward time.  All ranks of a TP group run the
same op list, so those collectives line up.

Transformer Engine (GPU only, never imported: found by its documented contract): layers built with
`delay_wgrad_compute` (`defer_te_wgrad`) defer by themselves into one FIFO per layer; `te_backward_dw`
runs their `backward_dw()` at W, which fires the hooks megatron-core's DDP registered with them.
`check_te_split` refuses, before a step, what TE cannot honour (W out of B order on a stage, no hooks,
layers that do not defer under a schedule with W, userbuffer overlap).  Supported from TE 2.8 (README).
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

    __slots__ = ("weight", "grad_output", "input", "sequence_parallel", "tp_group", "fusion", "held", "dtype")

    def __init__(self, weight, grad_output, input, sequence_parallel, tp_group, fusion):
        self.weight, self.grad_output, self.input, self.dtype = weight, grad_output, input, input.dtype
        self.sequence_parallel, self.tp_group, self.fusion = sequence_parallel, tp_group, fusion
        self.held = [_state.tracker(t) for t in (grad_output, input)] if _state.tracker else None

    def compute(self) -> Optional[torch.Tensor]:
        """Run the GEMM and drop the stored tensors.  Returns the weight gradient, or None on the
        fused path, where it went into `main_grad` (`run` then drives the hooks with a dummy)."""
        total_input = _gather_sequence(self.input, self.tp_group) if self.sequence_parallel else self.input
        # Contiguous 2-D views, as megatron-core hands them to apex's kernel.
        g = self.grad_output.contiguous().view(-1, self.grad_output.shape[-1])
        x = total_input.contiguous().view(-1, total_input.shape[-1])
        self.grad_output = self.input = self.held = total_input = None
        w = self.weight
        if x.dtype != g.dtype:
            # Forwards under autocast (config.enable_autocast) save the input uncast, while B's gradient
            # is in the autocast dtype: megatron-core's backward, run under the forward's autocast, does
            # this GEMM in that dtype; W runs outside autocast, so it casts as autocast would.
            x = x.to(g.dtype)
        if self.fusion and hasattr(w, "main_grad"):
            fused = _apex_wgrad_kernel() if g.is_cuda else None
            if fused is not None:
                fn = fused.wgrad_gemm_accum_fp32 if w.main_grad.dtype == torch.float32 else fused.wgrad_gemm_accum_fp16
                fn(x, g, w.main_grad)
            else:
                w.main_grad.addmm_(g.t().to(w.main_grad.dtype), x.to(w.main_grad.dtype))
            return None
        return g.t().matmul(x)


_dummies: dict = {}  # (shape, dtype, device) -> the one dummy gradient of that kind (fused path)


def _dummy_grad(weight, dtype) -> Optional[torch.Tensor]:
    """What megatron-core's linear returns for a weight whose gradient went into main_grad: None without
    DDP's marker, else a dummy that drives DDP's hook, which skips it (`grad_added_to_main_grad`) unless
    `zero_out_wgrad` asks for zeros (a weight whose other use adds a real `.grad`, as the V's tied
    embedding).  One reused buffer per shape and dtype, as megatron-core does through TE's get_dummy_wgrad."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    key = (tuple(weight.main_grad.shape), dtype, weight.main_grad.device)
    if key not in _dummies:
        _dummies[key] = torch.empty(key[0], dtype=dtype, device=key[2])
    dummy = _dummies[key]
    if getattr(weight, "zero_out_wgrad", False):
        dummy.zero_()
    return dummy.detach()


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
    from .compat import linear_options

    unknown = linear_options(call, _LINEAR_ARGS)  # gtp_remat_size=1 (megatron-core 0.19) passes
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
    """A W op: compute the deferred GEMMs and accumulate them (firing the weights' grad hooks).

    One weight at a time: its entries' GEMMs summed, handed to autograd (its hook fires once), and
    freed before the next weight's, so a W holds one weight's gradient at a time, not the stage's."""
    by_weight: dict = {}
    for entry in entries:
        by_weight.setdefault(id(entry.weight), []).append(entry)
    entries.clear()  # each entry's stored tensors go as its GEMM runs
    for group in by_weight.values():
        weight, dtype, grad = group[0].weight, group[0].dtype, None
        for entry in group:
            with torch.no_grad():  # as inside autograd's backward; gloo's all-gather writes into views
                g = entry.compute()
            if g is not None:
                grad = g if grad is None else grad.add_(g)
        group.clear()
        if grad is None:  # fused path: the gradients are in main_grad
            grad = _dummy_grad(weight, dtype)
        if grad is not None:
            torch.autograd.backward([weight], [grad])
        grad = g = None


def set_tracker(tracker: Optional[Callable[[torch.Tensor], object]]) -> None:
    """Stats hook: `tracker(t)` returns a token that holds t's bytes until the token is dropped."""
    _state.tracker = tracker


def defer_te_wgrad(config, ddp_config=None) -> None:
    """Make Transformer Engine layers built from `config` defer their weight gradients, and megatron-core's
    DDP built from `ddp_config` take their gradients from TE's hooks at W instead of autograd's in B.

    Sets `delay_wgrad_compute` on the already constructed configs: megatron-core 0.16's
    TransformerConfig.__post_init__ refuses the flag without MoE expert-parallel overlap (the only user
    of it in megatron-core's own schedules), but its TE wrappers and its DDP read it as plain
    attributes.  Call it before the chunks are built (TE reads it when a layer is made) and before DDP
    wraps them.  Local layers ignore it."""
    config.delay_wgrad_compute = True
    if ddp_config is not None:
        ddp_config.delay_wgrad_compute = True


def te_modules(chunk: torch.nn.Module, deferring: bool = True) -> list:
    """The chunk's Transformer Engine layers (megatron-core's TE wrappers included) that defer their
    weight gradients (`deferring=False`: those that do not).  Found by TE's documented contract (TE >=
    2.3): a `wgrad_store` (the layer's FIFO of deferred GEMMs) saying `delay_wgrad_compute()`, and a
    `backward_dw()` that runs the oldest; so nothing imports TE.  megatron-core's attention/MLP wrappers
    have backward_dw but no store and are skipped (they would pop their layers' FIFOs a second time)."""
    out = []
    for module in chunk.modules():
        store = getattr(module, "wgrad_store", None)
        if store is not None and callable(getattr(module, "backward_dw", None)) and \
                bool(store.delay_wgrad_compute()) == deferring:
            out.append(module)
    return out


def check_te_split(chunks, ops, split: bool, tp_comm_overlap: bool = False) -> List[list]:
    """Per chunk, its deferring TE layers (see te_modules); ConfigError when the step cannot honour them.

    A schedule with W ops (`split`) needs every TE layer to defer, or its W does nothing for them.

    TE keeps one FIFO per layer, so W (and BW, a B with its W at once) must pop in the order B pushed,
    per stage.  And TE's `backward_dw()` only assigns `.grad` (TE >= 2.8: overwrites it) and then calls
    the hooks registered through `register_wgrad_accumulation_and_reduce_hooks` (TE >= 2.7): without
    such a hook (megatron-core's DDP with ddp_config.delay_wgrad_compute) nothing accumulates the
    microbatches' gradients or starts their reduction."""
    from ..schedule.errors import ConfigError

    if split:
        eager = [type(m).__name__ for chunk in chunks for m in te_modules(chunk, deferring=False)]
        if eager:
            raise ConfigError(f"Transformer Engine layers ({', '.join(sorted(set(eager)))}) compute their weight "
                              "gradients in B, so W would be empty for them: build the chunks with "
                              "build_model_chunks(..., split_backward=True) (or call "
                              "runtime.wgrad.defer_te_wgrad(config) before building them)")
    modules = [te_modules(chunk) for chunk in chunks]
    if not any(modules):
        return modules
    if tp_comm_overlap:
        raise ConfigError("tp_comm_overlap=True (Transformer Engine's userbuffer communication) with Transformer "
                          "Engine layers that defer their weight gradients: TE does not support that (it raises); "
                          "set tp_comm_overlap=False or use a schedule without W (1f1b, 1f1b-interleaved)")
    problem = check_fifo_w_order(ops)
    if problem:
        raise ConfigError(f"Transformer Engine defers weight gradients per layer in B order, but {problem}; "
                          "use a schedule whose W follow B order per stage")
    for module in (m for ms in modules for m in ms):
        if not getattr(module, "wgrad_accumulation_and_reduce_hooks", None):
            raise ConfigError(f"Transformer Engine layer {type(module).__name__} defers its weight gradient "
                              "(delay_wgrad_compute) but no gradient hook is registered with it; wrap the chunks "
                              "in megatron-core's DistributedDataParallel with ddp_config.delay_wgrad_compute=True "
                              "(runtime.wgrad.defer_te_wgrad(config, ddp_config)), on a Transformer Engine that "
                              "registers them (>= 2.7; the split needs >= 2.8, see README)")
    return modules


def te_backward_dw(modules: list) -> None:
    """W for Transformer Engine layers that defer: each pops its oldest deferred GEMM (this
    microbatch's, by the FIFO order check) and fires its hooks."""
    with torch.no_grad():  # as inside autograd's backward, where TE's own GEMMs would have run
        for module in modules:
            _grads_for_hooks(module)
            module.backward_dw()


def _grads_for_hooks(module) -> None:
    """Give TE's hooks the `.grad` megatron-core's DDP hook expects where TE would leave none.

    TE passes the gradients of B to its hooks at W (the layer's weights and biases skip autograd's
    hook).  Two of them are made in B, by autograd, not by the W's GEMM: the dummy weight gradient of
    the fused path (`fuse_wgrad_accumulation`: the real one goes into main_grad at W), and the gradient
    of a bias TE adds outside its GEMM (`return_bias`, which megatron-core's wrappers ask for with
    skip_bias_add, or `gemm_bias_unfused_add`).  When two B ran before a W (B k+1 before W k, as
    zero-bubble schedules do), the first W's hook took both and cleared `.grad`; the second W would hand
    DDP's hook None (refused with overlapped reduction), and TE's backward_dw would fail setting the bias
    from a GEMM that made none.  Give them what one B alone would have left: the fused path's dummy, and
    a zero bias gradient (B's real ones were already added)."""
    for weight in module.parameters(recurse=False):
        if weight.dim() >= 2 and weight.grad is None and getattr(module, "fuse_wgrad_accumulation", False) \
                and getattr(weight, "skip_backward_post_hook", False) and hasattr(weight, "main_grad"):
            weight.grad = _dummy_grad(weight, weight.dtype)
    if not (getattr(module, "return_bias", False) or getattr(module, "gemm_bias_unfused_add", False)):
        return
    for name in getattr(module, "bias_names", ()):
        bias = getattr(module, name, None)
        if isinstance(bias, torch.Tensor) and bias.requires_grad and bias.grad is None:
            bias.grad = torch.zeros_like(bias)


def check_fifo_w_order(ops) -> Optional[str]:
    """None if, on every stage, weight gradients are taken in the order they were deferred: a B
    defers one, a W takes the oldest, a BW defers and takes at once (so nothing may be pending)."""
    pending: dict = {}
    for op in ops:
        queue = pending.setdefault(op.stage, [])
        if op.kind in ("B", "BW"):
            queue.append(op.microbatch)
        if op.kind in ("W", "BW"):
            oldest = queue.pop(0) if queue else None
            if oldest != op.microbatch:
                return (f"stage {op.stage}: {op} would take the weight gradient of microbatch {oldest} "
                        f"(TE's FIFO holds {[oldest] + queue if oldest is not None else queue})")
    return None
