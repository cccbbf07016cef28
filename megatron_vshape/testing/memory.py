"""Peak bytes of the tensors a block of code allocates, counted exactly on any device (CPU included).

torch has no allocator statistics on CPU, so `PeakBytes` watches every aten op inside the block
(a TorchDispatchMode, which also sees the ops autograd runs for `backward`) and holds a weak
reference to each new storage: the bytes alive are the storages made inside the block and not yet
freed, checked after every op.  Deterministic: it counts tensor bytes, not allocator blocks.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakBytes(TorchDispatchMode):
    """`with PeakBytes() as m: ...` then `m.peak`: the most bytes alive at once among storages
    allocated inside the block (tensors that existed before it are not counted)."""

    def __init__(self):
        super().__init__()
        self.peak = 0
        self._alive = {}  # data_ptr -> (weak reference, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # An output on an input's storage (in-place ops, views) is no new allocation.
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in self._alive and ptr not in inputs:
                    self._alive[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self._alive = {p: v for p, v in self._alive.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self._alive.values()))
        return out


def w_op_peak(layers: int, hidden: int, fused: bool) -> tuple:
    """(peak bytes of one W op of a stage of `layers` megatron-core linears [hidden x hidden], bytes of one
    weight).  `fused`: gradient-accumulation fusion into main_grad with DDP's marker and a hook that
    clears .grad, as megatron-core's DDP; else plain .grad.  Two W ops run; the second is measured (the
    first makes the fused path's reusable dummy).  Needs megatron parallel_state (tp=1)."""
    from ..runtime import wgrad
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    cfg = ModelParallelConfig(use_cpu_initialization=True)
    torch.manual_seed(0)
    model = torch.nn.ModuleList(ColumnParallelLinear(hidden, hidden, config=cfg, init_method=torch.nn.init.normal_,
                                                     bias=False, gather_output=False) for _ in range(layers))
    wgrad.install(model)
    keep = []
    for p in model.parameters():  # megatron-core DDP's hook: take .grad (unless already in main_grad), clear it
        if fused:
            p.main_grad, p.grad_added_to_main_grad = torch.zeros_like(p), False
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(lambda *_, p=p: setattr(p, "grad", None) if fused else None)
        keep.append(acc)
    for mod in model:
        mod.gradient_accumulation_fusion = fused
    peaks = []
    for _ in range(2):
        x = torch.randn(8, 1, hidden, requires_grad=True)
        with wgrad.split_forward():
            h = x
            for mod in model:
                h = mod(h)[0]
        entries = []
        with wgrad.collect(entries):
            h.sum().backward()
        with PeakBytes() as m:
            wgrad.run(entries)
        peaks.append(m.peak)
    return peaks[1], hidden * hidden * 4
