"""The gradient-hook mechanics of megatron-core's DDP (which is CUDA-only), per model chunk,
shared by the executor tests on linear stages and on the tiny GPT."""
from __future__ import annotations

import contextlib
import functools

import torch


class DDPLike:
    """Hooks on each parameter's gradient accumulator, a `no_sync` context per chunk, main_grad
    buffers with gradient_accumulation_fusion on the linear layers.  `names(chunk)` gives the
    chunk's own {name: parameter} (a borrowed tied weight is hooked once, by its owner, as DDP
    does).  Records, for every hook that fires while its chunk's sync is on, the parameter and a
    copy of its accumulated gradient."""

    def __init__(self, chunks, cfg, fusion, names):
        self.sync_on = [True] * len(chunks)
        self.fired = []  # (name, grad copy) while sync was on
        self.none_grad = []
        self._keep = []
        for c, chunk in enumerate(chunks):
            for mod in chunk.modules():
                if fusion and hasattr(mod, "gradient_accumulation_fusion"):
                    mod.gradient_accumulation_fusion = True
            for name, p in names(chunk).items():
                p.main_grad = torch.zeros_like(p)
                p.grad_added_to_main_grad = False
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(self._hook(c, name, p))
                self._keep.append(acc)
        cfg.no_sync_func = [functools.partial(self._no_sync, c) for c in range(len(chunks))]

    def _hook(self, c, name, p):
        def hook(*_):
            if p.grad is None:
                self.none_grad.append(name)
                return
            if not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad)
            p.grad = None
            p.grad_added_to_main_grad = False
            if self.sync_on[c]:
                self.fired.append((name, p.main_grad.detach().clone()))
        return hook

    def _no_sync(self, c):
        @contextlib.contextmanager
        def ctx():
            self.sync_on[c] = False
            try:
                yield
            finally:
                self.sync_on[c] = True
        return ctx()

    def report(self):
        return {"fired": self.fired, "none_grad": self.none_grad}
