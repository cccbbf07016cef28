"""TEST DOUBLE of Transformer Engine's documented contract for deferred weight gradients.

Transformer Engine cannot be installed on a CPU-only machine, so the B/W split's plumbing for TE layers
is tested against this stand-in.  It is not TE: it implements, for a plain linear layer on one
tensor-parallel rank, what TE >= 2.8 documents and does for `Linear(delay_wgrad_compute=True)`:

* `wgrad_store`: one FIFO per layer; `wgrad_store.delay_wgrad_compute()` says whether the layer defers.
* backward (B): computes the input gradient, pushes (input, grad_output) to the FIFO and returns no
  weight or bias gradient; on the fused path (`fuse_wgrad_accumulation` with megatron-core's
  `grad_added_to_main_grad` marker) it returns a dummy weight gradient and sets the marker, as TE does.
* `backward_dw()` (W): pops the OLDEST entry, computes the weight (and bias) gradient, accumulates it
  into `main_grad` (fused) or assigns `.grad` (TE >= 2.8 overwrites it), sets the bias `.grad` only when
  it is None (from the GEMM's bias gradient: none for a bias returned to the caller, `return_bias`, whose
  gradient autograd makes in B), then calls every hook given to
  `register_wgrad_accumulation_and_reduce_hooks` (TE >= 2.7).
* With delay on, the weight and bias carry `skip_backward_post_hook`, which tells megatron-core's DDP
  (ddp_config.delay_wgrad_compute) to register its gradient hook with the layer, not with autograd.

It takes megatron-core's linear constructor arguments (config, init_method, bias, skip_bias_add, ...)
and reads `config.delay_wgrad_compute` and `config.gradient_accumulation_fusion` as megatron-core's TE
wrappers do.  `LOG` records, per push and pop, the op the executor was running (set by `OpTracker`),
so a test can check that each W took the weight gradient of its own microbatch.
"""
from __future__ import annotations

import contextlib
import queue

import torch

from megatron_vshape.runtime.stats import Recorder

LOG = []  # ("push" | "pop", layer id, op text of the op running, op text the entry was pushed in)
_current = {"op": None}


class OpTracker(Recorder):
    """The executor's stats recorder, also noting which op is running (for LOG)."""

    @contextlib.contextmanager
    def op(self, kind, microbatch, stage, device):
        _current["op"] = f"{kind}{microbatch}@{stage}"
        try:
            with super().op(kind, microbatch, stage, device):
                yield
        finally:
            _current["op"] = None


class WeightGradStore:
    def __init__(self, delay: bool):
        self.enabled, self.context = delay, queue.Queue()

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def put(self, tensors, func):
        self.context.put((tensors, func, _current["op"]))

    def pop(self):
        if self.context.empty():
            raise RuntimeError("Pop empty queue.")  # what TE raises
        tensors, func, pushed_in = self.context.get()
        return func(*tensors), pushed_in


def _dummy(weight):
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        out = torch.matmul(x, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        param = layer.weight  # main_grad and DDP's marker live on the Parameter (a saved tensor may be a copy)
        dx = dy.matmul(weight)
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        fused = layer.fuse_wgrad_accumulation

        def gemm(inp, grad):
            dw = grad.t().matmul(inp)
            if fused:
                param.main_grad.add_(dw)
                dw = None
            return dw, (grad.sum(dim=0) if ctx.has_bias else None)

        if layer.wgrad_store.delay_wgrad_compute():
            layer.wgrad_store.put([x2, dy2], gemm)
            LOG.append(("push", id(layer), _current["op"], None))
            dw, db = None, None
        else:
            dw, db = gemm(x2, dy2)
        if fused and hasattr(param, "grad_added_to_main_grad"):
            param.grad_added_to_main_grad = True
            dw = _dummy(param)
        return dx, dw, db, None


class TELinearDouble(torch.nn.Module):
    """One layer honouring TE's deferred-wgrad contract (see the module docstring), tp=1."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=True, skip_bias_add=False,
                 **_megatron_kwargs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        self.skip_bias_add = skip_bias_add
        self.return_bias = skip_bias_add and bias  # TE's name: the bias is added by the caller, outside
        self.bias_names = ["bias"] if bias else []
        self.fuse_wgrad_accumulation = config.gradient_accumulation_fusion
        self.wgrad_store = WeightGradStore(bool(getattr(config, "delay_wgrad_compute", False)))
        self.wgrad_accumulation_and_reduce_hooks = []
        if self.wgrad_store.delay_wgrad_compute():
            for p in self.parameters():
                p.skip_backward_post_hook = True

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self):
        return self.wgrad_store.delay_wgrad_compute()

    def backward_dw(self):
        if not self.need_backward_dw():
            return
        (dw, db), pushed_in = self.wgrad_store.pop()
        LOG.append(("pop", id(self), _current["op"], pushed_in))
        if not self.fuse_wgrad_accumulation:
            self.weight.grad = dw
        if self.bias is not None and self.bias.grad is None:
            self.bias.grad = db.to(self.bias.dtype)  # as TE: fails when the GEMM made no bias gradient
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def forward(self, x):
        if self.skip_bias_add:
            return _Fn.apply(x, self.weight, None, self), self.bias
        return _Fn.apply(x, self.weight, self.bias, self), None


def te_double_block_spec(config, vp_stage=None):
    """The CPU test spec with every linear (qkv, proj, fc1, fc2) replaced by the TE test double."""
    from megatron_vshape.runtime.cpu_spec import cpu_gpt_block_spec

    block = cpu_gpt_block_spec(config, vp_stage)
    for layer in {id(s): s for s in block.layer_specs}.values():
        sub = layer.submodules
        sub.self_attention.submodules.linear_qkv = TELinearDouble
        sub.self_attention.submodules.linear_proj = TELinearDouble
        sub.mlp.submodules.linear_fc1 = TELinearDouble
        sub.mlp.submodules.linear_fc2 = TELinearDouble
    return block
