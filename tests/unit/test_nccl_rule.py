"""The matching rule under NCCL's semantics (schedule.comm.device_stall): sends that complete only
when received, one stream per communicator, device work launched in issue order (one hardware
queue, CUDA_DEVICE_MAX_CONNECTIONS=1).  Every registered schedule is deadlock-free with one
communicator per channel and its receive posted ahead; the model finds the deadlocks that posting
each receive only when it is needed would cause, and the plans that need a second communicator
per channel (tests/distributed/test_gpu_rules.py runs one), so it is not vacuous."""
from __future__ import annotations

import pytest

from megatron_vshape.schedule import registry
from megatron_vshape.schedule.comm import channel_streams, device_stall
from megatron_vshape.schedule.ops import Costs
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.verify import problems


def _build(name, pp, m):
    for options in ({}, {"group": m}):
        try:
            return registry.build(name, pp, m, **options)
        except ConfigError:
            if name != "1f1b-interleaved":
                return None
    return None


@pytest.mark.parametrize("name", registry.names())
def test_every_schedule_is_deadlock_free_under_nccl_ordering(name):
    checked = 0
    for pp in (2, 3, 4):
        for m in sorted({1, pp, 2 * pp + 1}):
            sched = _build(name, pp, m)
            if sched is None:
                continue
            assert device_stall(sched) == [] and channel_streams(sched) == 1, (name, pp, m)
            checked += 1
    assert checked >= 6


def test_receives_posted_only_when_needed_deadlock():
    # The V's channels carry activations and gradients in another order than they are consumed:
    # a second send on a channel waits behind an unmatched first one, which holds the device queue.
    for name, pp, m in (("v-zb", 4, 8), ("1f1b-interleaved", 2, 4)):
        sched = _build(name, pp, m)
        stalled = device_stall(sched, post_ahead=False)
        assert stalled and any(" send " in s for s in stalled), (name, stalled)
        assert device_stall(sched) == []


def test_a_plan_that_needs_two_communicators_per_channel():
    # A v-auto plan at a large budget and hop cost: with one communicator a second send on a
    # channel waits behind the first, unmatched, and holds the device queue; two suffice.
    sched = registry.build("v-auto", 4, 6, Costs(1, 2, 1, 1.0), memory_budget=1.5)
    assert device_stall(sched, 1) and not device_stall(sched, 2) and channel_streams(sched) == 2


def test_verify_reports_a_device_stall(monkeypatch):
    from megatron_vshape.schedule import verify

    sched = _build("v-zb", 4, 8)
    monkeypatch.setattr(verify, "channel_streams", lambda s: None)
    monkeypatch.setattr(verify, "device_stall", lambda s, streams: device_stall(s, post_ahead=False))
    found = problems(sched)
    assert len(found) == 1 and found[0].startswith("deadlock under NCCL's ordering"), found
