"""Optional instrumentation of one rank's step: op start/end times and activation memory.

`Recorder` is passed to the executor (`get_forward_backward_func(..., stats=recorder)`).  It
records, per executed op, `(kind, microbatch, stage, start, end)` in seconds from
`time.perf_counter()` (on an accelerator the device is synchronised at the end of each op so
the times are real), and tracks the bytes of tensors saved for backward:

* tensors autograd saves during an F op (through `torch.autograd.graph.saved_tensors_hooks`),
* tensors a B op keeps for its deferred W (grad_output and input of each deferred GEMM),

counted once per distinct storage while alive, parameters excluded.  `peak_bytes` is the
largest total seen during the step(s); `current_bytes` what is alive now.  This is the measure
the simulator's `peak_activations` predicts (times the bytes of one stage-activation).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, List, Tuple

import torch


class _Hold:
    """Keeps a storage's bytes counted while the autograd graph (or a W entry) holds it."""

    __slots__ = ("tensor", "key", "recorder")

    def __init__(self, recorder: "Recorder", tensor: torch.Tensor, key):
        self.recorder, self.tensor, self.key = recorder, tensor, key

    def __del__(self):
        if self.key is not None:
            self.recorder._release(self.key)


class Recorder:
    def __init__(self):
        self.ops: List[Tuple[str, int, int, float, float]] = []
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: Dict[int, List[int]] = {}  # storage ptr -> [nbytes, holders]
        self._params: set = set()
        # stage -> bytes saved for backward by each of its F ops (alive at the F's end): the
        # per-stage activation sizes re-planning uses (runtime.replan).
        self.saved_by_stage: Dict[int, List[int]] = {}

    def exclude_parameters(self, params: Iterable[torch.Tensor]) -> None:
        self._params.update(p.untyped_storage().data_ptr() for p in params)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    # -- memory --------------------------------------------------------------------------
    def hold(self, tensor: torch.Tensor) -> _Hold:
        """Count `tensor`'s storage while the returned token lives."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return _Hold(self, tensor, None)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or storage.nbytes() == 0:
            return _Hold(self, tensor, None)
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [storage.nbytes(), 1]
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        else:
            entry[1] += 1
        return _Hold(self, tensor, key)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.current_bytes -= entry[0]

    @contextmanager
    def saved_tensors(self) -> Iterator[None]:
        """Count tensors autograd saves for backward inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self.hold, lambda h: h.tensor):
            yield

    # -- time ----------------------------------------------------------------------------
    @contextmanager
    def op(self, kind: str, microbatch: int, stage: int, device: torch.device) -> Iterator[None]:
        start, before = time.perf_counter(), self.current_bytes
        yield
        if device.type != "cpu":  # accelerator kernels run asynchronously: wait so the end time is real
            torch.accelerator.synchronize(device)
        self.ops.append((kind, microbatch, stage, start, time.perf_counter()))
        if kind == "F":
            self.saved_by_stage.setdefault(stage, []).append(self.current_bytes - before)

    def clear(self) -> None:
        """Forget recorded op times and sizes (e.g. after a warm-up step); memory tracking goes on."""
        self.ops.clear()
        self.saved_by_stage.clear()

    def to_dict(self) -> dict:
        """Picklable summary (what a launched rank returns, and what Recorder.dump writes)."""
        return {"ops": list(self.ops), "peak_bytes": self.peak_bytes, "current_bytes": self.current_bytes,
                "saved_by_stage": {s: list(v) for s, v in self.saved_by_stage.items()}}

    def dump(self, path: str) -> None:
        """Write `to_dict()` as JSON: one rank's input to `megatron-vshape profile`."""
        import json

        with open(path, "w") as f:
            json.dump(self.to_dict(), f)
