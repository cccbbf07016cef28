"""The forward-backward function Megatron calls once per training step, for any schedule.

`get_forward_backward_func(schedule)` returns a function with megatron-core 0.16's keyword
signature.  It executes this pipeline rank's op list, step by step as
`schedule.comm.rank_plan` lays it out (receives before the op that needs them, sends right
after the op that produces them, the V's turn handed over locally), and nothing else decides
an order.  Forward and backward of one microbatch go through megatron-core's own
`forward_step` / `backward_step`, so loss scaling, token counts, MoE/MTP loss scales and
output deallocation are Megatron's.

Rules derived from the op list (stated once, here):
  * Grad sync (DDP's overlapped reduction) of chunk c covers every op that makes a final
    contribution to one of c's parameters: the last B-or-BW and last W-or-BW ops of c and of
    every chunk that borrows a parameter of c (a tied word embedding owned by chunk 0 and used by
    chunk 1's output layer on the V: `borrowed_parameters`, marked by runtime.chunks).  Without
    `config.grad_sync_func`, c's `no_sync` is lifted exactly during those ops, so every gradient
    hook registers a parameter on its final contribution (B for parameters not split, W for split
    weights; a tied weight also on its other use's last op: the same ops every step, as
    megatron-core's golden registration counts need).  With `grad_sync_func`, it is called for c
    right after the latest of those ops.  After the latest of them, c stays synced.
  * Param sync: `config.param_sync_func[c]` is called right before chunk c's first F.
  * GPU rule (docs/architecture.md): from opening the channels (the first posted receive) to
    P2P.finish(), nothing blocks the host on the device; op times are read after it.
  * Agreement: at the first step of each size every rank compares a hash of the whole schedule
    with its pipeline, tensor-, context- and expert-parallel peers (`_same_plan_everywhere`); a
    difference is a ConfigError on every rank before any message moves.
  * Loss: computed on the rank holding the last stage (rank 0 in the V shape).  Its loss dicts
    and token count are shipped to the last pipeline rank, which returns them, as Megatron
    expects; other ranks return [].
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..schedule import registry
from ..schedule.comm import ACT, Message, channel_streams, channels, input_message, is_remote, rank_plan
from ..schedule.errors import ConfigError
from ..schedule.ops import B, BW, F, W, Costs, Schedule
from ..schedule.verify import forward_only_order, forward_only_view, verify
from . import compat, wgrad
from .microbatch_data import bind, for_op
from .p2p import P2P, agree, local_activation, tensor_shape

DEFAULT_P2P_TIMEOUT = 300.0


def get_forward_backward_func(schedule: Union[str, Schedule], costs: Optional[Costs] = None, **options) -> Callable:
    """The forward-backward function for a schedule name or a `Schedule` object.

    Options: `p2p_timeout` (seconds a receive may wait before an error naming the rank, the op
    and the peer; default 300), `stats` (a `runtime.stats.Recorder` to fill), `schedule_options`
    (extra keyword arguments for the generator of a named schedule).
    """
    if isinstance(schedule, str):
        registry.generator(schedule)  # unknown names fail here, before any rank starts a step
    elif not isinstance(schedule, Schedule):
        raise ConfigError(f"schedule must be a registered name or a Schedule, not {type(schedule).__name__}")
    compat.megatron_steps()  # an untested megatron-core release, or a changed signature, fails here, at start-up
    return _Executor(schedule, costs, **options)


class _Executor:
    def __init__(self, schedule, costs=None, p2p_timeout: float = DEFAULT_P2P_TIMEOUT, stats=None,
                 schedule_options: Optional[dict] = None):
        self.schedule, self.costs, self.p2p_timeout, self.stats = schedule, costs, p2p_timeout, stats
        self.schedule_options = dict(schedule_options or {})
        self.stage_costs = None  # measured per-stage costs once replan() has run
        self._last_step: Optional[tuple] = None  # (pp, microbatches, rank, device) of the latest training step
        self._cache: Dict[Tuple[int, int, bool, int], tuple] = {}
        self._agreed: set = set()  # (pp, microbatches, forward_only) whose schedule the peers agreed on
        self.__name__ = f"forward_backward_{getattr(schedule, 'name', schedule)}"

    def replan(self, group=None, hop_latency: float = 0.0) -> Schedule:
        """Re-plan from this executor's measured op times (`stats`); collective over `group`
        (default: the world), so every rank calls it at the same step.  Returns the new schedule,
        which every rank shares; later steps run it.  See runtime.replan."""
        from .replan import replan_executor

        return replan_executor(self, group, hop_latency)

    def forget_plans(self) -> None:
        """Drop every cached plan (and the ranks' agreement on it): the next step plans anew."""
        self._cache.clear()
        self._agreed.clear()

    # The schedule and its per-rank plan, generated identically on every rank and cached.
    def _plan(self, pp: int, m: int, forward_only: bool, rank: int):
        key = (pp, m, forward_only, rank)
        if key not in self._cache:
            if not forward_only:
                sched = self._training(pp, m)
            else:
                try:
                    sched = verify(forward_only_view(self._training(pp, m)), forward_only=True)
                except ConfigError:
                    # Evaluation at a count the training schedule cannot run (Megatron-LM's
                    # --eval-micro-batch-size/--eval-global-batch-size, a plan made for one count): its
                    # forward ops in pipeline order, on the same placement.
                    sched = verify(forward_only_order(self._placed(pp), m), forward_only=True)
            chans = channels(sched)
            self._cache[key] = (sched, rank_plan(sched, rank, chans), chans, channel_streams(sched))
        return self._cache[key]

    def _training(self, pp: int, m: int) -> Schedule:
        if isinstance(self.schedule, str):
            measured = {} if self.stage_costs is None else {"stage_costs": self.stage_costs}
            return registry.build(self.schedule, pp, m, self.costs, **measured, **self.schedule_options)
        sched = self.schedule
        if sched.pp != pp or sched.microbatches != m:
            raise ConfigError(
                f"schedule {sched.name!r} was built for pp={sched.pp}, microbatches={sched.microbatches}, "
                f"but this step runs pp={pp}, num_microbatches={m}; build it for these sizes or pass its name")
        return verify(sched)

    def _placed(self, pp: int) -> Schedule:
        """A training schedule at pp, for its placement: the one given, or the named one at 4p microbatches
        (a multiple of p, at least 2p: a count every registered schedule runs)."""
        if isinstance(self.schedule, str):
            return self._training(pp, 4 * pp)
        if self.schedule.pp != pp:
            self._training(pp, self.schedule.microbatches)  # the error that names both sizes
        return self.schedule

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                 decoder_seq_length=None, forward_only=False, collect_non_loss_data=False, first_val_step=None,
                 adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None, force_all_reduce=False,
                 **kwargs):
        return _Step(self, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                     forward_only, collect_non_loss_data, first_val_step, adjust_tensor_shapes_fn, p2p_communicator,
                     pg_collection, force_all_reduce).run()


def _same_plan_everywhere(sched: Schedule, streams: int, groups, device, timeout: float) -> None:
    """Every rank plans on its own (the search is deterministic), and nothing a rank exchanges
    carries a name: pipeline ranks whose plans differ (another megatron_vshape on some node,
    other flags) pair tensors with the wrong microbatch and train on with wrong losses, and
    tensor-, context- or expert-parallel peers running their ops in another order (a W
    re-gathers its input under sequence parallelism) pair their collectives wrongly.  So each
    rank's hash of the whole schedule is compared over each of `groups` ((peers, group), in the
    same order on every rank), once per schedule size, before the first receive is posted; a
    difference in the schedule is a ConfigError on every member, naming each rank's hash and its
    planner sources' hash (which says whether to install the same package or pass the same flags)."""
    from ..planner.plan_cache import code_version

    whole = repr((sched.placement.kind, sched.placement.chunks, sched.pp, sched.microbatches, streams,
                  [[str(op) for op in ops] for ops in sched.ranks]))
    mine = [_hash(whole), _hash(code_version())]
    for peers, group in groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        seen = agree(group, mine, device, timeout, peers)
        if len({schedule for schedule, _ in seen}) == 1:
            continue  # the same schedule, whatever planner made it
        ranks: Dict[tuple, List[int]] = {}
        for r, got in zip(dist.get_process_group_ranks(group), seen):
            ranks.setdefault(got, []).append(r)
        said = "; ".join(f"ranks {rs}: schedule {got[0]:015x}, planner sources {got[1]:015x}" for got, rs in ranks.items())
        fix = ("install the same megatron_vshape on every node: the planner sources differ"
               if len({sources for _, sources in seen}) > 1 else
               "the planner sources are the same: give every rank the same schedule, costs, memory budget and layout")
        raise ConfigError(f"the {peers} ranks planned schedule {sched.name!r} differently at pp={sched.pp}, "
                          f"microbatches={sched.microbatches} ({said}); {fix}")


def _hash(text: str) -> int:
    """60 bits of the text's SHA-256: an int64 every backend can all_gather."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def _expert_group(pg_collection):
    """The expert-model-parallel group (None where Megatron made none)."""
    from megatron.core import parallel_state as ps

    if pg_collection is not None:
        return getattr(pg_collection, "ep", None)
    return ps.get_expert_model_parallel_group(check_initialized=False)


def _groups(pg_collection, p2p_communicator):
    """(pp, tp, cp) process groups, from pg_collection or megatron-core's parallel_state."""
    from megatron.core import parallel_state as ps

    if pg_collection is not None:
        return pg_collection.pp, pg_collection.tp, pg_collection.cp
    pp = p2p_communicator.pp_group if p2p_communicator is not None else ps.get_pipeline_model_parallel_group()
    return pp, ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()


class _Step:
    """One call: one rank executing its plan for one training (or evaluation) step."""

    def __init__(self, ex: _Executor, forward_step_func, data_iterator, model, m, seq_length, micro_batch_size,
                 forward_only, collect_non_loss_data, first_val_step, adjust_tensor_shapes_fn, p2p_communicator,
                 pg_collection, force_all_reduce):
        from megatron.core.utils import get_model_config, get_model_type

        self.forward_step, self.backward_step, self.check_first_val_step = compat.megatron_steps()
        self.model = model if isinstance(model, list) else [model]
        self.config = get_model_config(self.model[0])
        self.model_type = get_model_type(self.model[0])
        if adjust_tensor_shapes_fn is not None:
            raise ConfigError("adjust_tensor_shapes_fn is not supported by megatron_vshape schedules; "
                              "all stages must exchange [seq, micro_batch, hidden] tensors")
        if getattr(self.config, "variable_seq_lengths", False):
            raise ConfigError("variable_seq_lengths=True is not supported by megatron_vshape schedules; "
                              "use a fixed seq_length")
        if getattr(self.config, "defer_embedding_wgrad_compute", False):
            raise ConfigError("defer_embedding_wgrad_compute=True is not supported by megatron_vshape schedules; "
                              "zero-bubble schedules defer the output layer's weight gradient to W themselves")
        self.pp_group, tp_group, cp_group = _groups(pg_collection, p2p_communicator)
        self.pg_collection, self.force_all_reduce = pg_collection, force_all_reduce
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.pp, self.rank = len(self.pp_ranks), self.pp_ranks.index(dist.get_rank())
        self.sched, self.plan, chans, streams = ex._plan(self.pp, m, forward_only, self.rank)
        params = next(self.model[0].parameters())
        self.device = params.device
        if (self.pp, m, forward_only) not in ex._agreed:  # first, before any per-rank check could differ
            peers = [("pipeline", self.pp_group), ("tensor-parallel", tp_group), ("context-parallel", cp_group),
                     ("expert-parallel", _expert_group(pg_collection))]  # MoE's all-to-all spans data-parallel replicas
            _same_plan_everywhere(self.sched, streams, peers, self.device, ex.p2p_timeout)
            ex._agreed.add((self.pp, m, forward_only))
        self.placement = self.sched.placement
        if len(self.model) != self.placement.chunks:
            raise ConfigError(f"schedule {self.sched.name!r} places {self.placement.chunks} model chunk(s) per rank "
                              f"({self.placement.kind} placement) but model has {len(self.model)}; build the chunks "
                              f"with megatron_vshape.runtime.chunks for this schedule")
        iters = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(self.model)
        if len(iters) != len(self.model):
            raise ConfigError(f"data_iterator has {len(iters)} iterators for {len(self.model)} model chunks; "
                              "pass one iterator, or one per chunk")
        self.iters = bind(iters, shared=not isinstance(data_iterator, list))  # item k -> microbatch k
        self.ex, self.m, self.forward_step_func = ex, m, forward_step_func
        self.forward_only, self.collect_non_loss_data, self.first_val_step = forward_only, collect_non_loss_data, first_val_step
        self.cp_size = cp_group.size() if cp_group is not None else 1
        self.S = self.placement.num_stages
        self.loss_rank = self.placement.rank_of(self.S - 1)
        if not forward_only:
            ex._last_step = (self.pp, m, self.rank, self.device)
        dtype = self.config.pipeline_dtype or params.dtype
        shape = tensor_shape(seq_length, micro_batch_size, self.config.hidden_size, self.cp_size,
                             tp_group.size() if tp_group is not None else 1, self.config.sequence_parallel)
        self.split = self.sched.split_backward and not forward_only
        if self.split:
            for chunk in self.model:
                wgrad.install(chunk)
        self.te = [[] for _ in self.model]  # Transformer Engine layers that defer: backward_dw() at W and BW
        if not forward_only:
            try:
                self.te = wgrad.check_te_split(self.model, self.sched.ranks[self.rank], self.split,
                                               getattr(self.config, "tp_comm_overlap", False))
            except ConfigError as e:
                raise ConfigError(f"schedule {self.sched.name!r}: {e}") from None
        self.stats = ex.stats
        self.contributors = self._contributors()
        # The channels open in run(): posting the first receives starts the step's GPU rules.
        expected = {src: msgs for (src, dst), msgs in chans.items() if dst == self.rank}
        self.open_p2p = lambda: P2P(self.pp_ranks, self.rank, expected, shape, dtype, self.device, ex.p2p_timeout,
                                    streams)

    # ---- grad / param sync rules (see module docstring) --------------------------------------
    def _sync_points(self):
        """(lifts, done, first_f): the op indices during which each chunk's no_sync is lifted, the
        index after which it stays synced (grad_sync_func's turn), and each chunk's first F."""
        last_b, last_w, first_f = {}, {}, {}
        for i, step in enumerate(self.plan):
            c = self.placement.chunk_of(step.op.stage)
            if step.op.kind in (B, BW):
                last_b[c] = i
            if step.op.kind in (W, BW):
                last_w[c] = i
            if step.op.kind == F:
                first_f.setdefault(c, i)
        lifts, done = {}, {}
        for c, covered in enumerate(self.contributors):
            lifts[c] = {last[k] for k in covered for last in (last_b, last_w) if k in last}
            done[c] = max(lifts[c], default=None)
        return lifts, done, first_f

    def _contributors(self) -> List[set]:
        """For each chunk, the chunks whose ops contribute to its parameters: itself and every
        chunk borrowing one of them (matched by identity; the owner registers the parameter)."""
        owned = [{id(p) for p in chunk.parameters()} for chunk in self.model]
        out = [{c} for c in range(len(self.model))]
        for k, chunk in enumerate(self.model):
            for p in _borrowed_parameters(chunk):
                owners = [c for c, ids in enumerate(owned) if id(p) in ids]
                if not owners:
                    raise ConfigError(f"model chunk {k} borrows a parameter of shape {tuple(p.shape)} that no model "
                                      "chunk of this rank owns, so no chunk's grad sync would cover it; register it "
                                      "in the chunk that owns it")
                for c in owners:
                    out[c].add(k)
        return out

    def _no_sync_funcs(self):
        f = self.config.no_sync_func
        if f is None:
            return [contextlib.nullcontext] * len(self.model)
        if isinstance(f, list):
            if len(f) != len(self.model):
                raise ConfigError(f"config.no_sync_func has {len(f)} entries for {len(self.model)} model chunks")
            return f
        if len(self.model) > 1:
            raise ConfigError("config.no_sync_func is one function for several model chunks; pass a list with one "
                              "per chunk ([chunk.no_sync for chunk in model], as Megatron's training loop does)")
        return [f]

    def run(self):
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        cfg, nchunks = self.config, len(self.model)
        no_sync = self._no_sync_funcs()
        grad_sync = cfg.grad_sync_func if not self.forward_only else None
        param_sync = cfg.param_sync_func if not self.forward_only else None
        if grad_sync is not None and not isinstance(grad_sync, list):
            grad_sync = [grad_sync] * nchunks
        if param_sync is not None and not isinstance(param_sync, list):
            param_sync = [param_sync] * nchunks
        lifts, done, first_f = self._sync_points()
        lifted_at: Dict[int, List[int]] = {}
        for c, ops in lifts.items():
            for i in ops:
                lifted_at.setdefault(i, []).append(c)
        contexts: List[Optional[contextlib.AbstractContextManager]] = [None] * nchunks

        def disable(c):
            if contexts[c] is None:
                contexts[c] = no_sync[c]()
                contexts[c].__enter__()

        def enable(c):
            if contexts[c] is not None:
                contexts[c].__exit__(None, None, None)
                contexts[c] = None

        # Megatron's timers synchronize the device: start this one before any receive is posted,
        # and keep megatron's per-microbatch ones (forward_step, backward_step) out of the step.
        timers = cfg.timers
        if timers is not None:
            timers("forward-backward", log_level=1).start(barrier=cfg.barrier_with_L1_time)
        if self.stats is not None:
            for chunk in self.model:
                self.stats.exclude_parameters(chunk.parameters())
            wgrad.set_tracker(self.stats.hold)
        for c in range(nchunks):
            disable(c)
        inputs: Dict[Tuple[int, int], object] = {}
        outputs: Dict[Tuple[int, int], object] = {}
        arrived: Dict[Message, torch.Tensor] = {}
        wgrads: Dict[Tuple[int, int], list] = {}
        store: list = []
        total_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        try:
            cfg.timers = None
            self.p2p = self.open_p2p()
            for i, step in enumerate(self.plan):
                op = step.op
                c = self.placement.chunk_of(op.stage)
                for msg in step.recvs:
                    src = self.placement.rank_of(msg.src_stage)
                    arrived[msg] = self.p2p.recv(msg, src, str(op))
                if op.kind == F and param_sync is not None and first_f.get(c) == i:
                    param_sync[c](self.model[c].parameters())
                lifted = lifted_at.get(i, []) if grad_sync is None else []
                for k in lifted:
                    enable(k)
                timer = self.stats.op(op.kind, op.microbatch, op.stage, self.device) if self.stats else contextlib.nullcontext()
                with timer:
                    out = self._compute(op, c, inputs, outputs, arrived, wgrads, store)
                if op.kind == F and out is not None:
                    total_tokens += out[1]
                    out = out[0]
                self._deliver(op, step, out, arrived)
                if op.kind == F and op.stage < self.S - 1 and not self.forward_only:
                    # Sent (or handed over) through a detached alias: free the data, keep grad_fn.
                    deallocate_output_tensor(out, cfg.deallocate_pipeline_outputs)
                if self.stats is not None:
                    self.stats.sample(self._buffers(outputs, arrived))
                for k in lifted:
                    if i != done[k]:
                        disable(k)
                if grad_sync is not None:
                    for k in lifted_at.get(i, []):
                        if i == done[k]:
                            enable(k)
                            grad_sync[k](self.model[k].parameters())
            self.p2p.finish()
        finally:
            cfg.timers = timers
            if self.stats is not None:
                wgrad.set_tracker(None)
            for c in range(nchunks):
                enable(c)
        if self.stats is not None:
            self.stats.resolve()  # waits for the device: every receive of the step is issued
        losses = self._ship_losses(store, total_tokens)
        if cfg.finalize_model_grads_func is not None and not self.forward_only:
            cfg.finalize_model_grads_func(self.model, total_tokens if cfg.calculate_per_token_loss else None,
                                          pg_collection=self.pg_collection, force_all_reduce=self.force_all_reduce)
        if timers is not None:
            timers("forward-backward").stop()
        return losses

    def _buffers(self, outputs, arrived):
        """Pipeline tensors alive beside the saved activations: posted receive buffers, received
        messages not yet consumed, sends in flight, stage outputs kept whole (not deallocated)."""
        kept = [y for y in outputs.values() if isinstance(y, torch.Tensor) and y.numel() > 1]
        return self.p2p.buffers() + list(arrived.values()) + kept

    # ---- one op ------------------------------------------------------------------------------
    def _compute(self, op, c, inputs, outputs, arrived, wgrads, store):
        key = (op.stage, op.microbatch)
        need = input_message(op, self.S)
        if op.kind == F:
            x = arrived.pop(need) if need is not None else None
            if x is not None:
                if is_remote(need, self.placement):
                    x.requires_grad_(not self.forward_only)  # a fresh receive buffer
                else:
                    x = local_activation(x, requires_grad=not self.forward_only)
            saving = self.stats.saved_tensors() if (self.stats and not self.forward_only) else contextlib.nullcontext()
            with wgrad.split_forward(self.split), saving:
                out, tokens = self.forward_step(
                    self.forward_step_func, for_op(self.iters[c], op.microbatch), self.model[c], self.m, x, store,
                    self.config,
                    cp_group_size=self.cp_size, collect_non_loss_data=self.collect_non_loss_data,
                    is_first_microbatch=self.check_first_val_step(self.first_val_step, self.forward_only,
                                                                  op.microbatch == 0),
                    current_microbatch=op.microbatch, is_last_stage=op.stage == self.S - 1)
            if not self.forward_only:
                inputs[key], outputs[key] = x, out
            return out, tokens
        if op.kind in (B, BW):
            dy = arrived.pop(need) if need is not None else None
            x, y = inputs.pop(key), outputs.pop(key)
            if op.kind == B:
                entries: list = []
                # split_forward too: a forward recomputed inside B (activation checkpointing)
                # defers its weight GEMMs to this stage's W like the original forward.
                with wgrad.split_forward(True), wgrad.collect(entries):
                    dx = self.backward_step(x, y, dy, self.model_type, self.config)
                wgrads[key] = entries
            else:
                dx = self.backward_step(x, y, dy, self.model_type, self.config)
                wgrad.te_backward_dw(self.te[c])
            return dx
        # W
        wgrad.run(wgrads.pop(key))
        wgrad.te_backward_dw(self.te[c])
        return None

    def _deliver(self, op, step, out, arrived):
        """Send the op's output to the next stage's rank, or hand it over locally."""
        if out is None:
            return
        for msg in step.sends:
            dst = self.placement.rank_of(msg.dst_stage)
            self.p2p.send(msg, dst, out, str(op))
        if step.local_out is not None:
            arrived[step.local_out] = out if step.local_out.kind != ACT else out.detach()

    # ---- losses and token count to the last pipeline rank ---------------------------------------
    def _ship_losses(self, store, total_tokens):
        """Loss dicts to the last pipeline rank (returned there, [] elsewhere); `total_tokens` is
        broadcast in place from the loss rank, so every rank, the last included, holds the count."""
        last = self.pp - 1
        if self.loss_rank == last:
            return store if self.rank == last else []
        src = self.pp_ranks[self.loss_rank]
        # Pickled tensors unpickle onto the sender's device: ship them on CPU and put them on this
        # rank's device, where Megatron's training loop reduces them over its own groups.
        box = [_on_device(store, torch.device("cpu")) if self.rank == self.loss_rank else None]
        dist.broadcast_object_list(box, src=src, group=self.pp_group, device=self.device if self.device.type != "cpu" else None)
        dist.broadcast(total_tokens, src=src, group=self.pp_group)
        return _on_device(box[0], self.device) if self.rank == last else []


def _borrowed_parameters(module) -> tuple:
    """Parameters a chunk uses without owning them (its `borrowed_parameters`), looked up
    through Megatron's wrappers (DDP, Float16Module) the way get_attr_wrapped_model walks them."""
    while True:
        found = getattr(module, "borrowed_parameters", None)
        if found is not None:
            return tuple(found)
        if not hasattr(module, "module"):
            return ()
        module = module.module


def _on_device(obj, device: torch.device):
    """Tensors inside loss dicts (dicts, lists, tuples of them) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _on_device(v, device) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_on_device(v, device) for v in obj)
    return obj
