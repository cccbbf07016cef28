"""Point-to-point transport for the executor: one FIFO channel per direction of a rank pair.

The order of messages on each channel comes from `schedule.comm.rank_plan` (the matching rule);
this module only moves tensors.  Each direction of each neighbouring rank pair gets its own
process group, so at pp=2 (previous and next rank are the same peer) a send in one direction
can never be matched against a receive of the other: messages of one group are matched in
posting order, and only one direction ever uses it.

Each channel's messages rotate over `streams` process groups (`schedule.comm.channel_streams`:
one for almost every schedule), and one receive per stream is posted ahead, always for the next
messages of that channel, so they overlap compute; sends are posted right after the
producing op and waited for at the end of the step.  Nothing here is CUDA-specific: the device
comes from the model's parameters, the backend from the process group.

GPU rules (docs/architecture.md): from the first posted receive to `finish()`, nothing may block
the host on the device, since a posted NCCL receive is a kernel waiting for a peer that may wait
for this rank.  So on NCCL a wait is `work.wait()`, which
makes the compute stream wait for the communication and returns at once; a peer that never sends
is reported by the process group's watchdog when the channel's timeout (the executor's
`p2p_timeout`, set on each channel's group) passes: it names the operation (RECV or SEND) and the
group (`vshape p2p SRC->DST`), and with TORCH_NCCL_ASYNC_ERROR_HANDLING (default on) it aborts
the communicator and ends the process, so torchrun reports the rank.
"""
from __future__ import annotations

import time
from collections import deque
from datetime import timedelta
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..schedule.comm import Message

# This rank's pipeline groups: pipeline ranks -> {(src, dst, stream): group}; `stream` numbers the
# communicators of one direction (schedule.comm.channel_streams), made in the same order everywhere.
_GROUPS: Dict[Tuple[int, ...], Dict[Tuple[int, int, int], dist.ProcessGroup]] = {}
_MADE: Dict[Tuple[int, ...], Tuple[list, int]] = {}  # pipeline ranks -> (every pipeline of the world, streams made)


class P2PTimeout(RuntimeError):
    """A receive (or the end-of-step wait for a send) did not complete within the timeout."""


def _ring_pairs(ranks: Tuple[int, ...]) -> List[Tuple[int, int]]:
    """Both directions of each pair of pipeline-ring neighbours: r <-> r+1 (single and V
    placements) and, for Megatron's loop placement, the last rank -> the first."""
    pairs: List[Tuple[int, int]] = []
    p = len(ranks)
    for i in range(p if p > 2 else p - 1):
        a, b = ranks[i], ranks[(i + 1) % p]
        pairs += [pair for pair in ((a, b), (b, a)) if pair not in pairs]
    return pairs


def directional_groups(pp_ranks: Sequence[int], device: Optional[torch.device] = None,
                       timeout: Optional[float] = None, streams: int = 1
                       ) -> Dict[Tuple[int, int, int], dist.ProcessGroup]:
    """`streams` process groups per direction (src, dst) of each pair of pipeline-ring neighbours,
    keyed (src, dst, stream) by global ranks.

    `device` is where this rank's tensors live (used under NCCL); `timeout` (seconds) bounds every
    operation on them (NCCL's watchdog enforces it; the first call's value stays).  Creating
    groups is collective over the whole world, so every rank learns every pipeline's ranks first
    and all ranks create the same groups in the same order; every rank runs the same schedule, so
    all ask for the same `streams`.  Cached: call it from every rank on the first step (the
    executor does), and again when a schedule needs more streams.
    """
    key = tuple(pp_ranks)
    if key not in _MADE:
        pipelines: List[Optional[Tuple[int, ...]]] = [None] * dist.get_world_size()
        dist.all_gather_object(pipelines, key)
        _MADE[key] = (sorted(set(pipelines)), 0)
    world, made = _MADE[key]
    if made >= streams:
        return _GROUPS[key]
    me, limit = dist.get_rank(), None if timeout is None else timedelta(seconds=timeout)
    new = []
    for stream in range(made, streams):
        for ranks in world:
            for a, b in _ring_pairs(ranks):  # collective: all ranks, same order
                group = dist.new_group([a, b], timeout=limit, group_desc=f"vshape p2p {a}->{b} #{stream}")
                if me in (a, b):
                    _GROUPS.setdefault(ranks, {})[(a, b, stream)] = group
                    new.append(group)
    _MADE[key] = (world, streams)
    # NCCL creates a communicator at its first operation, blocking until the peer's first one: a
    # receive posted ahead on one direction could then wait for a peer that itself waits on the
    # other direction.  So every group is used once now, in the same global order on all ranks, on
    # the device the step's tensors use: whatever the default group's backend string says
    # ("nccl", "cpu:gloo,cuda:nccl", or none given), the backend that serves this device is the
    # one initialised.  Where it needs no initialising (gloo), that costs one tiny all-reduce.
    for group in new:
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    return _GROUPS[key]


def agree(group, values: Sequence[int], device: torch.device, timeout: float, peers: str) -> List[Tuple[int, ...]]:
    """Every member's `values` (int64s) gathered over `group`, by its rank in the group.  Call it
    from every member before the step's first receive is posted (it waits on the host).  The wait
    is the channels' (bounded_wait): on gloo a member that never arrives is a P2PTimeout naming
    `peers`; on NCCL the group's own timeout and watchdog apply."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(everyone, mine, group=group, async_op=True)
    bounded_wait(work, torch.device(device).type == "cpu", timeout,
                 f"rank {dist.get_rank()}: comparing plans with the other {peers} ranks, not every one arrived")
    return [tuple(t.tolist()) for t in everyone]


class _PendingRecv:
    def __init__(self, msg: Message, tensor: torch.Tensor, work):
        self.msg, self.tensor, self.work = msg, tensor, work


class P2P:
    """Channels of one rank for one step.

    `pp_ranks`: global ranks of this pipeline, indexed by pipeline rank.  `expected`: for each
    source pipeline rank, the messages that arrive on its channel in order (from the plan).
    """

    def __init__(self, pp_ranks: Sequence[int], rank: int, expected: Dict[int, List[Message]],
                 shape: Sequence[int], dtype: torch.dtype, device: torch.device, timeout: float, streams: int = 1):
        self.pp_ranks, self.rank, self.streams = list(pp_ranks), rank, streams
        self.shape, self.dtype, self.device, self.timeout = tuple(shape), dtype, device, timeout
        self.groups = directional_groups(self.pp_ranks, device, timeout, streams)
        self.count: Dict[Tuple[int, int], int] = {}  # messages posted so far per (src, dst)
        self.expected = {src: deque(msgs) for src, msgs in expected.items()}
        self.posted: Dict[int, Deque[_PendingRecv]] = {src: deque() for src in expected}
        self.sends: List[Tuple[Message, int, object, torch.Tensor]] = []
        # CPU tensors go over gloo, whose wait() blocks the host and takes a timeout; device tensors over
        # NCCL-like backends, whose wait() only orders streams (decided by the device, not by the
        # default group's backend string, which may name several or none).
        self.host_waits = torch.device(device).type == "cpu"
        for src in self.expected:
            self._post_next(src)

    def _group(self, src: int, dst: int):
        """The communicator of the channel's next message: message k goes on stream k mod streams."""
        k = self.count.get((src, dst), 0)
        self.count[(src, dst)] = k + 1
        return self.groups[(self.pp_ranks[src], self.pp_ranks[dst], k % self.streams)]

    def _post_next(self, src: int) -> None:
        """Keep one receive posted per stream of channel `src` -> self, for its next messages
        (what schedule.comm.device_stall proves deadlock-free under NCCL's ordering)."""
        while self.expected[src] and len(self.posted[src]) < self.streams:
            msg = self.expected[src].popleft()
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            op = dist.P2POp(dist.irecv, buf, self.pp_ranks[src], self._group(src, self.rank))
            work = dist.batch_isend_irecv([op])[0]
            self.posted[src].append(_PendingRecv(msg, buf, work))

    def recv(self, msg: Message, src: int, op_name: str) -> torch.Tensor:
        """Take the next message off channel `src`; the plan says it is `msg`."""
        pending = self.posted[src].popleft()
        if pending.msg != msg:  # the plan and the transport disagree: a bug, never a user error
            raise RuntimeError(f"rank {self.rank}: {op_name} expected {msg} from rank {src}, channel holds {pending.msg}")
        self._wait(pending.work, f"rank {self.rank}: {op_name} waiting to receive {msg} from rank {src}")
        self._post_next(src)
        return pending.tensor

    def send(self, msg: Message, dst: int, tensor: torch.Tensor, op_name: str) -> None:
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(
                f"rank {self.rank}: {op_name} produced {tuple(tensor.shape)} {tensor.dtype} for {msg}, but the "
                f"pipeline exchanges {self.shape} {self.dtype} ([seq_length/cp(/tp with sequence parallelism), "
                f"micro_batch_size, hidden_size] in config.pipeline_dtype)")
        # A detached alias: the caller may release `tensor.data` (deallocate_pipeline_outputs)
        # while the send is in flight; the alias keeps the storage alive until it completes.
        payload = tensor.detach().contiguous()
        op = dist.P2POp(dist.isend, payload, self.pp_ranks[dst], self._group(self.rank, dst))
        work = dist.batch_isend_irecv([op])[0]
        self.sends.append((msg, dst, work, payload))
        # Drop finished sends, so their payloads (stage outputs) are freed during the step;
        # is_completed() queries without blocking on every backend.
        self.sends = [s for s in self.sends if not s[2].is_completed()]

    def buffers(self) -> List[torch.Tensor]:
        """Receive buffers posted and send payloads in flight (for memory accounting)."""
        return [p.tensor for q in self.posted.values() for p in q] + [s[3] for s in self.sends]

    def finish(self) -> None:
        """Wait for every send of the step; every receive must have been consumed."""
        left = {src: [p.msg for p in q] + list(self.expected[src]) for src, q in self.posted.items()}
        left = {src: msgs for src, msgs in left.items() if msgs}
        if left:
            raise RuntimeError(f"rank {self.rank}: step ended with unreceived messages {left}")
        for msg, dst, work, _ in self.sends:
            self._wait(work, f"rank {self.rank}: end of step waiting for send of {msg} to rank {dst}")
        self.sends = []

    def _wait(self, work, what: str) -> None:
        bounded_wait(work, self.host_waits, self.timeout, f"{what}: nothing arrived")


def bounded_wait(work, on_host: bool, timeout: float, missing: str) -> None:
    """Wait for `work`.  Off the host (NCCL) wait() makes the current (compute) stream wait for
    the communication and returns: the host never blocks here (see the module docstring for
    timeouts).  On the host (gloo) wait() blocks and honours `timeout`, with no spinning on
    shared CPU cores; running out of it is a P2PTimeout saying `missing` and the flag to raise,
    any other failure (a peer gone) is raised as it is."""
    if not on_host:
        work.wait()
        return
    start = time.monotonic()
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as exc:
        if time.monotonic() - start < timeout * 0.99 and "imeout" not in str(exc):
            raise
        raise P2PTimeout(f"{missing} within {timeout:g}s (raise --pipeline-p2p-timeout, "
                         f"or get_forward_backward_func's p2p_timeout, to wait longer)") from exc


def local_activation(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """The V's turn on rank p-1: hand stage p-1's output to stage p without communication."""
    out = tensor.detach()
    return out.requires_grad_(True) if requires_grad else out


def tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int, cp: int = 1, tp: int = 1,
                 sequence_parallel: bool = False) -> Tuple[int, int, int]:
    """Shape of one activation (and of its gradient) crossing stages."""
    seq = seq_length // cp
    if sequence_parallel:
        seq //= tp
    return (seq, micro_batch_size, hidden_size)
