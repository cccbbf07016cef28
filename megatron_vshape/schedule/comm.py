"""Communication derived from compute op lists: the one matching rule.

The runtime and the verifier both use this module, so what the verifier proves
deadlock-free is exactly what the runtime executes.

The rule:
  * After F(m)@s, the activation goes to stage s+1; after B(m)@s or BW(m)@s, the input
    gradient goes to stage s-1.  When both stages live on the same rank (the V's turn on
    rank p-1) the tensor is handed over locally: no message.
  * Every ordered rank pair (src, dst) is one FIFO channel.  The sender posts its messages
    on the channel in the order its op list produces them, right after the producing op,
    and never waits for them before the end of the step.
  * The receiver takes messages off each incoming channel strictly in channel order.
    Before an op that consumes a message, it receives every not-yet-received message of
    that channel up to and including the one it needs, keeping the earlier ones for the
    ops that will consume them (they may arrive in a different order than they are
    consumed, e.g. activations and gradients sharing a channel in the V shape).
  * A schedule is deadlock-free iff executing all ranks' lists under this rule, with
    sends that never block and receives that block, finishes.  `verify` checks that.

On GPUs the rule must also hold under NCCL's semantics, which are stricter (`device_stall`):
a send completes only once the receiver has posted its receive, messages of one communicator
run in order on its stream, and with CUDA_DEVICE_MAX_CONNECTIONS=1 a rank's device work
launches in the order the host issued it (one hardware queue: a send stuck behind an unmatched
send of the same stream holds back everything issued after it).  So the runtime rotates each
channel's messages over `channel_streams(schedule)` communicators (message k on k mod n), each
with one receive posted ahead from the step's start; `verify` proves every schedule
deadlock-free under that too.

Each direction of a rank pair is its own channel, so the runtime gives each direction its
own communicator: a blocked send in one direction cannot stall a receive in the other
(this is what goes wrong with same-peer batched p2p at pp=2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .ops import B, BACKWARD_KINDS, F, Op, Placement, Schedule, W

ACT, GRAD = "act", "grad"
# Most communicators per channel direction (`channel_streams`); one is enough for every schedule
# but a few v-auto plans (large budgets and hop costs), which need two.
MAX_CHANNEL_STREAMS = 4


@dataclass(frozen=True)
class Message:
    """A tensor crossing from stage `src_stage` to `dst_stage` for one microbatch."""

    kind: str  # ACT (forward activation) or GRAD (input gradient)
    microbatch: int
    src_stage: int
    dst_stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}:{self.src_stage}->{self.dst_stage}"


def output_message(op: Op, num_stages: int) -> Optional[Message]:
    """The tensor `op` produces for a neighbouring stage, if any (local or remote)."""
    if op.kind == F and op.stage < num_stages - 1:
        return Message(ACT, op.microbatch, op.stage, op.stage + 1)
    if op.kind in BACKWARD_KINDS and op.stage > 0:
        return Message(GRAD, op.microbatch, op.stage, op.stage - 1)
    return None


def input_message(op: Op, num_stages: int) -> Optional[Message]:
    """The tensor `op` needs from a neighbouring stage, if any."""
    if op.kind == F and op.stage > 0:
        return Message(ACT, op.microbatch, op.stage - 1, op.stage)
    if op.kind in BACKWARD_KINDS and op.stage < num_stages - 1:
        return Message(GRAD, op.microbatch, op.stage + 1, op.stage)
    return None


def local_predecessor(op: Op) -> Optional[Tuple[str, ...]]:
    """Op kinds of the same (stage, microbatch) that must run earlier on the same rank."""
    if op.kind in BACKWARD_KINDS:
        return (F,)
    if op.kind == W:
        return (B,)
    return None


def is_remote(msg: Message, placement: Placement) -> bool:
    return placement.rank_of(msg.src_stage) != placement.rank_of(msg.dst_stage)


@dataclass
class Step:
    """One op of a rank's list with the communication around it.

    `recvs`: messages to take off incoming channels before the op (in channel order; may
    include earlier messages for later ops).  `sends`: remote message to post after it.
    `local_in`/`local_out`: a tensor handed over on the same rank.
    """

    op: Op
    recvs: List[Message]
    sends: List[Message]
    local_in: Optional[Message]
    local_out: Optional[Message]


def channels(schedule: Schedule) -> Dict[Tuple[int, int], List[Message]]:
    """Every remote channel (src_rank, dst_rank) and its messages in sender order."""
    pl, S = schedule.placement, schedule.num_stages
    out: Dict[Tuple[int, int], List[Message]] = {}
    for rank, ops in enumerate(schedule.ranks):
        for op in ops:
            msg = output_message(op, S)
            if msg is not None and is_remote(msg, pl):
                out.setdefault((rank, pl.rank_of(msg.dst_stage)), []).append(msg)
    return out


def rank_plan(schedule: Schedule, rank: int, chans: Optional[Dict] = None) -> List[Step]:
    """The steps `rank` executes: its ops with the receives and sends the rule derives."""
    pl, S = schedule.placement, schedule.num_stages
    chans = channels(schedule) if chans is None else chans
    incoming = {src: msgs for (src, dst), msgs in chans.items() if dst == rank}
    position = {src: {m: i for i, m in enumerate(msgs)} for src, msgs in incoming.items()}
    received = {src: 0 for src in incoming}
    steps: List[Step] = []
    for op in schedule.ranks[rank]:
        recvs: List[Message] = []
        need = input_message(op, S)
        local_in = None
        if need is not None:
            if is_remote(need, pl):
                src = pl.rank_of(need.src_stage)
                idx = position.get(src, {}).get(need)
                if idx is None:
                    raise KeyError(f"rank {rank}: {op} needs {need}, which rank {src} never sends")
                if idx >= received[src]:
                    recvs = incoming[src][received[src] : idx + 1]
                    received[src] = idx + 1
            else:
                local_in = need
        out = output_message(op, S)
        sends = [out] if out is not None and is_remote(out, pl) else []
        local_out = out if out is not None and not is_remote(out, pl) else None
        steps.append(Step(op, recvs, sends, local_in, local_out))
    return steps


def _issue_order(schedule: Schedule, rank: int, chans, streams: int, post_ahead: bool) -> List[tuple]:
    """What `rank` hands its device, in host order: ("post", src, k) a receive of message k of
    channel src->rank, ("wait", src, k) compute waits for it, ("op",), ("send", dst, k), and at
    the end ("sent", dst, k) the waits for the last sends of each channel."""
    pl = schedule.placement
    incoming = {src: msgs for (src, dst), msgs in chans.items() if dst == rank}
    index = {m: i for (src, dst), msgs in chans.items() if rank in (src, dst) for i, m in enumerate(msgs)}
    out: List[tuple] = [("post", src, k) for src, msgs in incoming.items()
                        for k in range(min(streams, len(msgs)) if post_ahead else 0)]
    for step in rank_plan(schedule, rank, chans):
        for msg in step.recvs:
            src = pl.rank_of(msg.src_stage)
            k = index[msg]
            if not post_ahead:  # posted only when needed
                out.append(("post", src, k))
            out.append(("wait", src, k))
            if post_ahead and k + streams < len(incoming[src]):
                out.append(("post", src, k + streams))
        out.append(("op", step.op))
        for msg in step.sends:
            out.append(("send", pl.rank_of(msg.dst_stage), index[msg]))
    out += [("sent", dst, len(msgs) - 1 - j) for (src, dst), msgs in chans.items() if src == rank
            for j in range(min(streams, len(msgs)))]
    return out


def device_stall(schedule: Schedule, streams: int = 1, post_ahead: bool = True) -> List[str]:
    """Where ranks stall under NCCL's semantics (empty: deadlock-free) when each channel's
    messages rotate over `streams` communicators (message k on k mod streams), each keeping one
    receive posted ahead (`post_ahead=False`: a receive is posted just before its wait).

    Model: each rank launches its device work strictly in issue order (one hardware queue, the
    worst case: more queues only remove constraints); a receive or send launches once the one
    before it on its communicator (its stream) has completed; a send and its receive complete
    together, once both have launched; compute waits on its received inputs; every other kernel
    completes (TP/DP collectives: all their ranks issue the same sequence)."""
    chans = channels(schedule)
    issued = [_issue_order(schedule, r, chans, streams, post_ahead) for r in range(schedule.pp)]
    pos = [0] * schedule.pp
    launched: set = set()

    def complete(src: int, dst: int, k: int) -> bool:
        return k < 0 or (("send", src, dst, k) in launched and ("recv", src, dst, k) in launched)

    moved = True
    while moved:
        moved = False
        for r, entries in enumerate(issued):
            while pos[r] < len(entries):
                what, peer, k = entries[pos[r]] + (None,) * (3 - len(entries[pos[r]]))
                if what != "op":
                    src, dst = (peer, r) if what in ("post", "wait") else (r, peer)
                    launches = what in ("post", "send")  # else a wait for message k to complete
                    # A launch waits for the message before it on its stream; a wait for this one.
                    if not complete(src, dst, k - streams if launches else k):
                        break
                    if launches:
                        launched.add(("recv" if what == "post" else "send", src, dst, k))
                pos[r] += 1
                moved = True
    return [f"rank {r} at {' '.join(map(str, entries[pos[r]]))}" for r, entries in enumerate(issued)
            if pos[r] < len(entries)]


def channel_streams(schedule: Schedule) -> Optional[int]:
    """Communicators per channel direction the runtime uses for `schedule`: the fewest (up to
    MAX_CHANNEL_STREAMS) under which `device_stall` finds no stall; None if none suffices."""
    for streams in range(1, MAX_CHANNEL_STREAMS + 1):
        if not device_stall(schedule, streams):
            return streams
    return None
