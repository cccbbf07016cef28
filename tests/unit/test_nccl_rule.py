"""The matching rule under NCCL's semantics (schedule.comm.device_stall): sends that complete only
when received, one stream per channel, device work launched in issue order (one hardware queue,
CUDA_DEVICE_MAX_CONNECTIONS=1).  Every registered schedule is deadlock-free with the runtime's
receives posted ahead; the model finds the deadlocks that posting each receive only when it is
needed would cause, so it is not vacuous."""
from __future__ import annotations

import pytest

from megatron_vshape.schedule import registry
from megatron_vshape.schedule.comm import RECEIVES_AHEAD, device_stall
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
            assert device_stall(sched, RECEIVES_AHEAD) == [], (name, pp, m)
            checked += 1
    assert checked >= 6


def test_receives_posted_only_when_needed_deadlock():
    # The V's channels carry activations and gradients in another order than they are consumed:
    # a second send on a channel waits behind an unmatched first one, which holds the device queue.
    for name, pp, m in (("v-zb", 4, 8), ("1f1b-interleaved", 2, 4)):
        sched = _build(name, pp, m)
        stalled = device_stall(sched, ahead=0)
        assert stalled and any(" send " in s for s in stalled), (name, stalled)
        assert device_stall(sched) == []


def test_verify_reports_a_device_stall(monkeypatch):
    from megatron_vshape.schedule import verify

    sched = _build("v-zb", 4, 8)
    monkeypatch.setattr(verify, "device_stall", lambda s: device_stall(s, ahead=0))
    found = problems(sched)
    assert len(found) == 1 and found[0].startswith("deadlock under NCCL's ordering"), found
