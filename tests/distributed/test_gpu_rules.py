"""The GPU rule, checked on CPU: nothing inside a step blocks the host on the device while the
step's channels are open (from the first posted receive to P2P.finish()).  On NCCL a posted
receive is a kernel waiting for its sender; a device-wide wait on one rank then waits for a peer
that waits for this rank, and every rank hangs.  gloo does not share that semantics, so the test
instruments every host wait instead and fails if one runs while a step's channels are open:
torch.cuda/torch.accelerator synchronize, Event/Stream synchronize, Tensor.item/tolist and
torch.distributed.barrier (a device-wide wait on NCCL).

The step runs as on a GPU where it matters: the recorder takes its accelerator branch (the branch
a CUDA rank takes), with `FakeCudaEvent`, a test double of torch.cuda.Event's documented contract
(record() on the current stream, synchronize() waits on the host, elapsed_time() in ms), and
megatron-core's real Timers (log level 2, barrier_with_L1_time), whose synchronize calls reach
the instrumented torch.cuda.synchronize.  Every registered schedule, a training and an evaluation
step each; a control case that synchronizes inside forward_step_func must be caught.
"""
from __future__ import annotations

import time
import traceback

import torch

from megatron_vshape.integration.launch import launch
from megatron_vshape.schedule import registry
from megatron_vshape.testing.tiny_gpt import TinyGPT
from test_executor_linear import schedule_cases

PP = 2
CONTROL = "control: torch.cuda.synchronize() inside forward_step_func"


class FakeCudaEvent:
    """Test double of torch.cuda.Event (enable_timing=True) on CPU: record() stamps the host clock."""

    def __init__(self, enable_timing=False, **_):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def query(self):
        return self.at is not None

    def synchronize(self):  # replaced by the instrumented version in _instrument
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


class _Watch:
    """Host waits seen while a step's channels are open (violations) and outside (counted)."""

    def __init__(self):
        self.open_steps, self.violations, self.outside = 0, [], 0

    def hit(self, name):
        if self.open_steps:
            where = "".join(traceback.format_stack(limit=6)[:-2])
            self.violations.append(f"{name} while receives are posted:\n{where}")
        else:
            self.outside += 1


def _instrument(watch):
    import torch.distributed as dist

    from megatron_vshape.runtime import p2p

    def wrap(owner, name, call_through=True):
        original = getattr(owner, name)

        def waiting(*args, **kwargs):
            watch.hit(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs) if call_through else None

        setattr(owner, name, waiting)

    torch.cuda.Event = FakeCudaEvent
    # No device here: the synchronize calls return after being recorded.
    for owner in (torch.cuda, torch.accelerator):
        wrap(owner, "synchronize", call_through=False)
    for owner in (FakeCudaEvent, torch.cuda.Stream):  # torch.Stream, torch.Event: C types, not patchable
        wrap(owner, "synchronize", call_through=False)
    for name in ("item", "tolist"):
        wrap(torch.Tensor, name)
    wrap(dist, "barrier")
    opened, finished = p2p.P2P.__init__, p2p.P2P.finish

    def init(self, *a, **k):
        opened(self, *a, **k)  # creates the channels' groups (first step), then posts the receives
        watch.open_steps += 1

    def finish(self):
        finished(self)
        watch.open_steps -= 1

    p2p.P2P.__init__, p2p.P2P.finish = init, finish


def _job(rank, world_size, cases):
    from megatron.core.timers import Timers

    from megatron_vshape.runtime.executor import get_forward_backward_func
    from megatron_vshape.runtime.stats import Recorder
    from megatron_vshape.testing.tiny_gpt import build_chunks, data_iterators, forward_step, init_parallel

    class AcceleratorRecorder(Recorder):
        """Takes the recorder's accelerator branch, as a rank on a CUDA device does."""

        def op(self, kind, microbatch, stage, device):
            return super().op(kind, microbatch, stage, torch.device("cuda", 0))

    def synchronizing_forward_step(data_iterator, model):
        torch.cuda.synchronize()
        return forward_step(data_iterator, model)

    watch = _Watch()
    _instrument(watch)
    tiny = TinyGPT(num_layers=2 * world_size, seq_length=8)
    out, layout = {}, None
    for name, m, options, control in cases:
        sched = registry.build(name, world_size, m, **dict(options))
        if (sched.placement.kind, sched.placement.chunks) != layout:
            init_parallel(1, world_size, sched.placement, seed=tiny.seed)
            layout = (sched.placement.kind, sched.placement.chunks)
        chunks = build_chunks(tiny, sched.placement)
        chunks[0].config.timers = Timers(2, "minmax")
        chunks[0].config.barrier_with_L1_time = True
        recorder = AcceleratorRecorder()
        fb = get_forward_backward_func(name, p2p_timeout=60, stats=recorder, schedule_options=dict(options))
        step = synchronizing_forward_step if control else forward_step
        before, outside = len(watch.violations), watch.outside
        for forward_only in (False, True):
            fb(forward_step_func=step, data_iterator=data_iterators(tiny, 0, m, len(chunks)), model=chunks,
               num_microbatches=m, seq_length=tiny.seq_length, micro_batch_size=tiny.micro_batch_size,
               forward_only=forward_only)
        ops = len(sched.ranks[rank]) + sum(op.kind == "F" for op in sched.ranks[rank])
        out[(name, control)] = {"violations": watch.violations[before:], "outside": watch.outside - outside,
                                "timed": len(recorder.ops), "ops": ops,
                                "durations_ok": all(e >= s for *_, s, e in recorder.ops),
                                "peak_total": getattr(recorder, "peak_total_bytes", None),
                                "buffers_at_peak": getattr(recorder, "buffers_at_peak", None)}
    return out


def test_no_host_wait_while_receives_are_posted_every_schedule():
    cases = [(name, m, options, False) for name, m, options in schedule_cases(PP, counts=[2 * PP])]
    cases.append(("1f1b", 2 * PP, (), True))
    assert {c[0] for c in cases} == set(registry.names())
    jobs = launch(_job, PP, (cases,), timeout=240)
    for rank, job in enumerate(jobs):
        for (name, control), r in job.items():
            if control:
                assert r["violations"], f"rank {rank}: the {CONTROL} was not caught"
                continue
            assert not r["violations"], f"rank {rank}, {name}:\n" + "\n".join(r["violations"][:3])
            # The instrumentation is live: the timers and the recorder wait after the step.
            assert r["outside"] > 0, (rank, name, r)
            assert r["timed"] == r["ops"] and r["durations_ok"], (rank, name, r)
            # Receive buffers (or sends in flight) are alive beside the activations at some op.
            assert r["peak_total"] > 0 and r["buffers_at_peak"] > 0, (rank, name, r)


# ---- a schedule whose channels need two communicators each under NCCL's ordering ------------------

TWO_STREAMS = dict(pp=4, m=6, costs=(1.0, 2.0, 1.0, 1.0), memory_budget=1.5)


def _two_streams_schedule():
    from megatron_vshape.schedule.ops import Costs

    t = TWO_STREAMS
    return registry.build("v-auto", t["pp"], t["m"], Costs(*t["costs"]), memory_budget=t["memory_budget"])


def _streams_job(rank, world_size):
    from megatron_vshape.runtime.executor import get_forward_backward_func
    from megatron_vshape.testing.tiny_gpt import (build_chunks, data_iterators, forward_step, init_parallel,
                                                  microbatch_loss, named_grads, portable)

    sched = _two_streams_schedule()
    tiny = TinyGPT(num_layers=2 * world_size, seq_length=8)
    init_parallel(1, world_size, sched.placement, seed=tiny.seed)
    out = {}
    for label, schedule in (("two streams", sched), ("v-half", "v-half")):
        chunks = build_chunks(tiny, sched.placement)
        fb = get_forward_backward_func(schedule, p2p_timeout=60)
        res = fb(forward_step_func=forward_step, data_iterator=data_iterators(tiny, 0, sched.microbatches, 2),
                 model=chunks, num_microbatches=sched.microbatches, seq_length=tiny.seq_length,
                 micro_batch_size=tiny.micro_batch_size)
        out[label] = portable({"losses": [microbatch_loss(d) for d in res], "grads": named_grads(chunks)})
    from megatron_vshape.runtime.p2p import _GROUPS

    out["streams"] = sorted({stream for groups in _GROUPS.values() for *_, stream in groups})
    return out


def test_channels_on_two_communicators_deliver_every_message_in_order():
    from megatron_vshape.schedule.comm import channel_streams, device_stall

    sched = _two_streams_schedule()
    assert device_stall(sched, 1) and channel_streams(sched) == 2  # one communicator would stall on NCCL
    for job in launch(_streams_job, TWO_STREAMS["pp"], (), timeout=240):
        assert job["streams"] == [0, 1]  # the executor opened a second communicator per channel
        two, one = job["two streams"], job["v-half"]
        assert two["losses"] == one["losses"]
        for name, g in one["grads"].items():
            got = torch.as_tensor(two["grads"][name]["grad"])
            want = torch.as_tensor(g["grad"])
            assert torch.allclose(got, want, rtol=0, atol=1e-6 * float(want.abs().max())), name
