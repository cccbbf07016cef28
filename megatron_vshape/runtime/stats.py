"""Optional instrumentation of one rank's step: op start/end times and activation memory.

`Recorder` is passed to the executor (`get_forward_backward_func(..., stats=recorder)`).  It
records, per executed op, `(kind, microbatch, stage, start, end)` in seconds on the
`time.perf_counter()` clock, and tracks the bytes of tensors saved for backward:

* tensors autograd saves during an F op (through `torch.autograd.graph.saved_tensors_hooks`),
* tensors a B op keeps for its deferred W (grad_output and input of each deferred GEMM),

counted once per distinct storage while alive, parameters excluded.  `peak_bytes` is the
largest total seen during the step(s); `current_bytes` what is alive now.  This is the measure
the simulator's `peak_activations` predicts (times the bytes of one stage-activation).

Pipeline buffers are counted beside it (`sample`, after every op): posted receive buffers,
messages received but not yet consumed, sends in flight and stage outputs kept whole (not
deallocated).  `peak_total_bytes` is the most of activations and buffers alive together, with
`activations_at_peak` and `buffers_at_peak` its two parts.

On an accelerator an op is timed by two events recorded on the current stream, read by
`resolve()` after the step: waiting for the device inside a step would also wait for the posted
receives, whose senders may be waiting for this rank (docs/architecture.md, GPU rules).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, List, Tuple

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
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        # CPU ops' clock: time.thread_time instead times the compute thread's CPU time, which
        # other processes on a shared machine do not inflate (durations only: no common origin).
        self.clock = clock
        self.ops: List[Tuple[str, int, int, float, float]] = []
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: Dict[int, List[int]] = {}  # storage ptr -> [nbytes, holders]
        self._params: set = set()
        # stage -> bytes saved for backward by each of its F ops (alive at the F's end): the
        # per-stage activation sizes re-planning uses (runtime.replan).
        self.saved_by_stage: Dict[int, List[int]] = {}
        self.peak_total_bytes = self.activations_at_peak = self.buffers_at_peak = 0
        self._pending: List[tuple] = []  # (kind, microbatch, stage, start event, end event)
        self._origin = None  # (perf_counter, event) taken together at the first pending op

    def exclude_parameters(self, params: Iterable[torch.Tensor]) -> None:
        self._params.update(p.untyped_storage().data_ptr() for p in params)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
        self.peak_total_bytes = self.activations_at_peak = self.buffers_at_peak = 0

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

    def sample(self, buffers: Iterable[torch.Tensor]) -> None:
        """Count the pipeline buffers alive now (each storage once, none already counted as
        saved for backward) and keep the peak of activations plus buffers."""
        seen, size = set(), 0
        for t in buffers:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in seen or key in self._live or key in self._params:
                continue
            seen.add(key)
            size += storage.nbytes()
        if self.current_bytes + size > self.peak_total_bytes:
            self.peak_total_bytes = self.current_bytes + size
            self.activations_at_peak, self.buffers_at_peak = self.current_bytes, size

    # -- time ----------------------------------------------------------------------------
    @contextmanager
    def op(self, kind: str, microbatch: int, stage: int, device: torch.device) -> Iterator[None]:
        before = self.current_bytes
        if device.type == "cpu":
            start = self.clock()
            yield
            self.ops.append((kind, microbatch, stage, start, self.clock()))
        else:  # kernels run asynchronously: time them on the stream, read after the step
            begin, end = _timing_event(device), _timing_event(device)
            begin.record()
            if self._origin is None:
                self._origin = (time.perf_counter(), begin)
            yield
            end.record()
            self._pending.append((kind, microbatch, stage, begin, end))
        if kind == "F":
            self.saved_by_stage.setdefault(stage, []).append(self.current_bytes - before)

    def resolve(self) -> None:
        """Turn the events of the ops timed on an accelerator into times; this waits for the
        device, so call it after the step (the executor does, once its last wait is issued)."""
        if not self._pending:
            return
        host, origin = self._origin
        self._pending[-1][4].synchronize()
        for kind, microbatch, stage, begin, end in self._pending:
            self.ops.append((kind, microbatch, stage, host + origin.elapsed_time(begin) / 1e3,
                             host + origin.elapsed_time(end) / 1e3))
        self._pending.clear()
        self._origin = None

    def clear(self) -> None:
        """Forget recorded op times and sizes (e.g. after a warm-up step); memory tracking goes on."""
        self.resolve()
        self.ops.clear()
        self.saved_by_stage.clear()

    def to_dict(self) -> dict:
        """Picklable summary (what a launched rank returns, and what Recorder.dump writes)."""
        self.resolve()
        return {"ops": list(self.ops), "peak_bytes": self.peak_bytes, "current_bytes": self.current_bytes,
                "saved_by_stage": {s: list(v) for s, v in self.saved_by_stage.items()},
                "peak_total_bytes": self.peak_total_bytes, "activations_at_peak": self.activations_at_peak,
                "buffers_at_peak": self.buffers_at_peak}

    def dump(self, path: str) -> None:
        """Write `to_dict()` as JSON: one rank's input to `megatron-vshape profile`."""
        import json

        with open(path, "w") as f:
            json.dump(self.to_dict(), f)


def _timing_event(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=True)
    return torch.Event(device=device, enable_timing=True)
