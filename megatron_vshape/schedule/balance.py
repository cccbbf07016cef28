"""Stage costs from the model's shape, and the layout that minimises the simulated iteration time.

The estimate: each op of each part of the model (a transformer layer, the embedding, the output
layer with the loss) takes

    GEMM FLOPs / machine.flops  +  bytes moved / machine.bandwidth  +  operators * machine.op_overhead

per microbatch of T = seq_length * micro_batch_size tokens, divided by tensor parallelism tp.  FLOPs
alone over-price the output layer wherever the rest of a layer is not negligible: on the CPU runs
of this repository (hidden 128-512) a layer's normalisations, activations and its ~50 dispatched
operators per op cost as much as its GEMMs, while the output layer is a few large GEMMs; and they
under-price it on GPUs, where the fp32 loss over a 128k vocabulary streams as long as its GEMM.

* a layer: GEMMs 2(4h^2 + 2h*ffn) FLOPs per token in each of F, B (input gradients) and W (weight
  gradients); attention's two batched matmuls 4sh in F and twice that in B (no weights: nothing in
  W).  Bytes: its activations (LAYER_ACT_PER_H * h elements per token of the training dtype,
  Korthikanti et al. 2022's 34h bytes at 16 bits, flash attention) written and read once in F,
  read with their gradients written in B (three passes); in W the weight gradients accumulated
  (write, read both, write: three fp32 passes) unless the GEMM accumulates them itself (megatron's
  gradient-accumulation fusion on GPUs).
* the output layer and the loss: the logits GEMM 2hV per token in each of F, B and W.  The loss
  works on fp32 logits (megatron-core's vocab-parallel cross-entropy): F reads and writes them
  LOSS_PASSES_F times (upcast, max, subtract, exp, sum, normalise into the softmax kept for
  backward), B LOSS_PASSES_B times (the one-hot update and the scaling by the loss gradient), plus
  the casts to and from a 16-bit dtype.  W accumulates the V x h weight gradient as a layer does.
  Activation: the fp32 softmax kept for the backward, 4V bytes per token.
* the embedding: a lookup in F; in B (autograd's backward, not a deferred W: only linear layers
  defer their weight gradient) a dense V x h gradient added into the parameter's: the accumulated
  gradient read and written (two fp32 passes over V x h per microbatch, whatever the sequence;
  the new one is zero-filled lazily and touched on T rows only).  How much of that memory is
  already mapped depends on the allocator, so this part is the least certain (README's check).
* operators: what megatron-core's local GPT layer spec dispatches per op (aten operators, counted
  with a TorchDispatchMode on the CPU runs): LAYER_OPS, HEAD_OPS, EMBEDDING_OPS.

Machines: GPU (default: H100/H200-class bf16 dense peak and HBM bandwidth; kernels are launched
ahead of their execution, so operators add nothing) and CPU (this repository's fp32 CPU runs, one
thread per rank: GEMM throughput, the effective bandwidth of writing large fresh tensors, and the
cost of one dispatched operator inside megatron-core modules with autograd, each measured alone
by a microbenchmark on the development machine; README "Sizing the stages" quotes the check).

Stage s of a layout holds n_s layers plus the embedding (stage 0) and the output layer with the
loss (last stage).  Times are in units of the F of one rank's share of plain layers (L/p, what
`--costs` means, so schedules compare) and sizes relative to a plain stage's activation (L/S
layers), as StageCost wants; only ratios matter.

The search (`balance`): the layouts on the way from the even split to the one that evens out
each rank's total work (one layer moved per step) are planned by the schedule's generator for
their stage costs and simulated (REBUILDS of them, the ends included); the best is refined by
moving one layer at a time off the busiest ranks' stages while the simulated makespan of its
order drops, and that refinement is kept only if it simulates faster (rebuilt, or in the same
order).  Within the memory budget (peak_vs_1f1b on every rank), the fastest wins if it simulates
MIN_GAIN faster than the even split built the same way (planned for its estimated costs); else the
even split stays, unless it exceeds the budget.  What is printed is the chosen schedule's
simulation, next to the even split's in the order an even run uses: a layout other than the even
one is never shown for less than MIN_GAIN of speed-up, except to fit the budget (the line says so).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from . import registry
from .errors import ConfigError
from .layout import Layout, even, even_split
from .ops import Costs, Placement, Schedule, StageCost
from .simulate import SimResult, simulate

LAYER_ACT_PER_H = 17.0  # activation elements per token per unit of hidden size (34h bytes at 16 bits)
LOSS_PASSES_F, LOSS_PASSES_B = 8, 2  # reads + writes of the fp32 logits by the loss (module docstring)
GRAD_ACCUMULATION_PASSES = 3  # fp32 passes to add a weight gradient into the parameter's (unfused)
EMBEDDING_GRAD_PASSES = 2  # read and write the accumulated V x h gradient
# Aten operators megatron-core's local GPT spec dispatches per microbatch in (F, B, W).
LAYER_OPS, HEAD_OPS, EMBEDDING_OPS = (48, 57, 21), (48, 28, 5), (6, 4, 0)
MAX_EVALUATIONS = 300  # simulations the local refinement may spend
MIN_GAIN = 0.005  # a layout must simulate this much faster than the even split's plan (or the incumbent's) to be chosen
REBUILDS = 4  # layouts on the way to even ranks that are planned and simulated


@dataclass(frozen=True)
class Machine:
    """What an op's time is made of on a device (module docstring)."""

    name: str
    about: str  # what it stands for, in the start-up report
    flops: float  # GEMM FLOP/s in the training dtype
    bandwidth: float  # bytes/s streaming large tensors
    op_overhead: float  # seconds one dispatched operator costs beyond its work
    fused_grad_accumulation: bool  # weight-gradient GEMMs accumulate into the fp32 gradient themselves

    def seconds(self, flops: float, moved: float, ops: int) -> float:
        return flops / self.flops + moved / self.bandwidth + ops * self.op_overhead


# H100/H200 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s (H100's HBM3; H200's 4.8 would price memory lower).
GPU = Machine("gpu", "H100-class GPUs", 989e12, 3.35e12, 0.0, True)
# One core of the development CPU, fp32: GEMMs at the layers' and the output layer's shapes 80-98
# GFLOP/s; writing large freshly allocated tensors 6-40 GB/s (first touch of new pages included);
# an aten operator inside megatron-core modules with autograd ~20 us (a hidden-32 layer: 1.1 ms for
# its 48 forward operators, its GEMMs negligible).
CPU = Machine("cpu", "a CPU core per rank", 90e9, 10e9, 20e-6, False)
MACHINES = {m.name: m for m in (GPU, CPU)}


@dataclass(frozen=True)
class ModelShape:
    """What the estimate reads: GPT sizes as Megatron names them, the training dtype's bytes and the machine."""

    num_layers: int
    hidden_size: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: Optional[int] = None
    tensor_model_parallel_size: int = 1
    micro_batch_size: int = 1
    dtype_bytes: int = 2
    machine: Machine = GPU

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "seq_length", "vocab_size", "tensor_model_parallel_size",
                     "micro_batch_size", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')}={value!r} must be a whole number >= 1 for the "
                                  "stage-cost estimate")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def tokens(self) -> int:
        return self.seq_length * self.micro_batch_size

    def _accumulate(self, weights: float) -> float:
        """Bytes the W op moves to add `weights` fp32 gradients into the parameters' ones."""
        return 0.0 if self.machine.fused_grad_accumulation else GRAD_ACCUMULATION_PASSES * 4.0 * weights

    def _cast(self, elements: float) -> float:
        """Bytes of a cast between fp32 and the training dtype (none when that is fp32)."""
        return 0.0 if self.dtype_bytes == 4 else (4.0 + self.dtype_bytes) * elements

    def layer(self) -> Tuple[float, float, float, float]:
        """(F, B, W seconds, activation bytes) of one transformer layer for one microbatch."""
        h, tp, T, m = self.hidden_size, self.tensor_model_parallel_size, self.tokens, self.machine
        weights = (4 * h * h + 2 * h * self.ffn) / tp
        gemm, attn = 2.0 * weights * T, 4.0 * self.seq_length * h * T / tp
        act = LAYER_ACT_PER_H * h * self.dtype_bytes * T / tp
        return (m.seconds(gemm + attn, 2 * act, LAYER_OPS[0]), m.seconds(gemm + 2 * attn, 3 * act, LAYER_OPS[1]),
                m.seconds(gemm, self._accumulate(weights), LAYER_OPS[2]), act)

    def head(self) -> Tuple[float, float, float, float]:
        """(F, B, W seconds, activation bytes) of the output layer and the loss for one microbatch."""
        h, tp, T, m = self.hidden_size, self.tensor_model_parallel_size, self.tokens, self.machine
        logits = self.vocab_size * T / tp  # elements
        gemm = 2.0 * h * logits
        return (m.seconds(gemm, LOSS_PASSES_F * 4.0 * logits + self._cast(logits), HEAD_OPS[0]),
                m.seconds(gemm, LOSS_PASSES_B * 4.0 * logits + self._cast(logits), HEAD_OPS[1]),
                m.seconds(gemm, self._accumulate(h * self.vocab_size / tp), HEAD_OPS[2]), 4.0 * logits)

    def embedding(self) -> Tuple[float, float, float, float]:
        """(F, B, W seconds, activation bytes) of the embedding for one microbatch: its output is the
        first layer's input, counted there."""
        h, tp, T, m = self.hidden_size, self.tensor_model_parallel_size, self.tokens, self.machine
        lookup = 2.0 * h * self.dtype_bytes * T / tp
        dense_grad = EMBEDDING_GRAD_PASSES * 4.0 * self.vocab_size * h / tp
        return (m.seconds(0.0, lookup, EMBEDDING_OPS[0]), m.seconds(0.0, lookup + dense_grad, EMBEDDING_OPS[1]),
                m.seconds(0.0, 0.0, EMBEDDING_OPS[2]), 0.0)

    def parts(self) -> "PartCosts":
        """The estimate as the costs of the model's parts (seconds and bytes of one microbatch)."""
        return PartCosts(self.num_layers, Part(*self.layer()), Part(*self.embedding()), Part(*self.head()))

    def stage_costs(self, layout: Sequence[int], pp: int) -> Tuple[StageCost, ...]:
        return self.parts().stage_costs(layout, pp)


@dataclass(frozen=True)
class Part:
    """One part's F, B and W time and activation size for one microbatch, in any consistent units."""

    F: float
    B: float
    W: float
    size: float


@dataclass(frozen=True)
class PartCosts:
    """What a stage is made of: `layer` per transformer layer, the embedding on stage 0 and the output
    layer with the loss (`head`) on the last stage.  From the model's shape (ModelShape.parts) or
    from the per-stage times a run measured (`measured_parts`); `balance` reads either."""

    num_layers: int
    layer: Part
    embedding: Part
    head: Part

    def stage_costs(self, layout: Sequence[int], pp: int) -> Tuple[StageCost, ...]:
        """StageCost of every stage of `layout` (model order) at `pp` ranks: times in units of one
        rank's share's F (L/p plain layers: what `--costs` means), sizes relative to a plain stage."""
        S, one = len(layout), self.layer
        unit_t, unit_m = self.num_layers / pp * one.F, self.num_layers / S * one.size
        out = []
        for s, n in enumerate(layout):
            parts = [Part(n * one.F, n * one.B, n * one.W, n * one.size)]
            parts += [self.embedding] * (s == 0) + [self.head] * (s == S - 1)
            F, B, W, M = (sum(getattr(p, k) for p in parts) for k in ("F", "B", "W", "size"))
            out.append(StageCost(F / unit_t, B / unit_t, W / unit_t, M / unit_m if unit_m > 0 else 1.0))
        return tuple(out)


def measured_parts(table: Sequence[StageCost], layout: Sequence[int], prior: PartCosts) -> PartCosts:
    """Per-part costs from per-stage ones a run measured under `layout` (runtime.replan's table:
    seconds and sizes in any one unit).  A layer costs what the middle stages measured per layer
    (their total time over their total layers); the embedding and the head are what
    their end stages measured beyond their layers.  Without middle stages (one chunk per rank at
    pp=2) the layer is solved from the end stage whose extra part `prior` (the shape's estimate)
    says is the smaller share, with the prior's ratio of that part to a layer."""
    S = len(layout)
    if len(table) != S:
        raise ConfigError(f"measured costs of {len(table)} stages for a layout of {S}; measure the run that "
                          f"used layout {','.join(map(str, layout))}")
    kinds = ("F", "B", "W", "size")
    middle = [s for s in range(1, S - 1) if layout[s] > 0]
    if middle:
        n = sum(layout[s] for s in middle)
        layer = Part(*(sum(getattr(table[s], k) for s in middle) / n for k in kinds))
    else:
        ends = [(0, prior.embedding), (S - 1, prior.head)]
        s, extra = min(((s, e) for s, e in ends if layout[s] > 0),
                       key=lambda se: sum(getattr(se[1], k) for k in kinds[:3]) / layout[se[0]],
                       default=(None, None))
        if s is None:
            raise ConfigError(f"layout {','.join(map(str, layout))} has no stage with layers to measure a layer by")
        # table[s] = layout[s] * layer + extra, with extra = ratio * layer (the prior's ratio)
        layer = Part(*(getattr(table[s], k) / (layout[s] + (getattr(extra, k) / getattr(prior.layer, k)
                                                             if getattr(prior.layer, k) else 0.0)) for k in kinds))

    def beyond(s: int) -> Part:
        return Part(*(max(0.0, getattr(table[s], k) - layout[s] * getattr(layer, k)) for k in kinds))

    return PartCosts(sum(layout), layer, beyond(0), beyond(S - 1))


@dataclass
class Balanced:
    """The chosen layout and its schedule, next to the even split's (or the incumbent's)."""

    layout: Layout
    schedule: Schedule = field(repr=False)
    sim: SimResult = field(repr=False)
    even_layout: Layout
    even_sim: SimResult = field(repr=False)
    evaluations: int = 0
    memory_budget: Optional[float] = None

    def summary(self, labels: Tuple[str, str] = ("even", "balanced")) -> str:
        """One line per layout (the kept one first): layers per stage, makespan, bubble, peak per rank;
        the second says when it is the same layout, and when the first exceeds the memory budget."""
        def line(what, layout, sim):
            peaks = " ".join(f"{p:.2f}" for p in sim.peak_vs_1f1b)
            return (f"{what:>8} {','.join(map(str, layout))}: iteration {sim.makespan:.4g} (units of one rank's F), "
                    f"bubble {sim.bubble_rate:.1%}, peak vs 1F1B per rank {peaks}")
        gain = self.even_sim.makespan / self.sim.makespan - 1 if self.sim.makespan else 0.0
        why = ""
        if tuple(self.layout) == tuple(self.even_layout):
            why += f"; the same layout in the order planned for its costs: no other simulates {MIN_GAIN:.1%} faster"
        over = max(self.even_sim.peak_vs_1f1b)
        if self.memory_budget is not None and over > self.memory_budget + 1e-9:
            why += f"; {labels[0]} peaks at {over:.4g}, over the memory budget {self.memory_budget:g}"
        return "\n".join([line(labels[0], self.even_layout, self.even_sim),
                          line(labels[1], self.layout, self.sim) + f" ({gain:+.1%} speed{why})"])


def _valid(layout: Sequence[int]) -> bool:
    return min(layout) >= 0 and all(n >= 1 for n in layout[1:-1])


def _towards_even_ranks(model, placement: Placement) -> List[Layout]:
    """Layouts from the even split towards the one whose ranks' total work (F+B+W) is most even,
    one layer moved per step: from the busiest rank's largest stage to the least busy rank's smallest."""
    S = placement.num_stages
    path = [even(model.num_layers, S)]

    def work(lay):
        costs = model.stage_costs(lay, placement.pp)
        return [sum(costs[s].F + costs[s].B + costs[s].W for s in placement.stages_of(r)) for r in range(placement.pp)]

    for _ in range(model.num_layers * S):
        layout = path[-1]
        loads = work(layout)
        hi, lo = loads.index(max(loads)), loads.index(min(loads))
        src = max(placement.stages_of(hi), key=lambda s: layout[s])
        dst = min(placement.stages_of(lo), key=lambda s: layout[s])
        trial = list(layout)
        trial[src] -= 1
        trial[dst] += 1
        if not _valid(trial) or max(work(trial)) >= max(loads) - 1e-12:
            break
        path.append(tuple(trial))
    return path


def balance(model, name: str, pp: int, microbatches: int, costs: Optional[Costs] = None,
            memory_budget: Optional[float] = None, flag: str = "--pipeline-memory-budget",
            incumbent: Optional[Layout] = None, layers_flag: str = "--num-layers", **options) -> Balanced:
    """The layout of `model.num_layers` layers for schedule `name` that minimises the simulated
    iteration time within `memory_budget` (peak_vs_1f1b on every rank); ConfigError when none fits.
    `model`: a ModelShape (the estimate) or PartCosts (e.g. measured_parts).  `incumbent`: the layout
    kept unless another simulates MIN_GAIN faster (default the even split), built as every candidate
    is (the faster of the order planned for its costs and the plain order under them);
    `even_layout`/`even_sim` report it (the even split in the order an even run uses).  A layout not
    MIN_GAIN faster is chosen only when the incumbent exceeds the budget.  v-auto is planned at that
    budget (its generator's default without one): callers pass it once.  `flag`/`layers_flag`: how
    errors name the budget and the layer count."""
    if registry.plans_under_budget(name):
        options = {**options, "memory_budget": memory_budget}
    plain = registry.build(name, pp, microbatches, costs, **options)  # the order an even run uses today
    placement = plain.placement
    S = placement.num_stages
    even_split(model.num_layers, placement, name, layers_flag)  # every middle stage needs a layer

    def with_costs(schedule: Schedule, layout: Layout) -> Schedule:
        """`schedule`'s order under this layout's estimated costs; a cap it was planned for held for
        its own costs, so it is dropped (the chosen budget is checked here instead)."""
        trial = copy.copy(schedule)
        trial.stage_costs = model.stage_costs(layout, pp)
        if trial.stage_costs != schedule.stage_costs:
            trial.memory_budget = None
        return trial

    def build(layout: Layout) -> Tuple[Schedule, SimResult]:
        """The faster of: the order planned for this layout's costs, and the plain order under them."""
        options_ = [with_costs(plain, layout)]
        try:
            options_.append(registry.build(name, pp, microbatches, costs, stage_costs=model.stage_costs(layout, pp),
                                           **options))
        except ConfigError:  # the generator cannot plan for these costs (e.g. over its own memory cap)
            pass
        return min(((sched, simulate(sched)) for sched in options_), key=lambda b: rank(b[1]))

    def fits(sim: SimResult) -> bool:
        return memory_budget is None or max(sim.peak_vs_1f1b) <= memory_budget + 1e-9

    def rank(sim: SimResult):
        return (not fits(sim), sim.makespan if fits(sim) else max(sim.peak_vs_1f1b))

    path = _towards_even_ranks(model, placement)
    picks = sorted({round(i * (len(path) - 1) / (REBUILDS - 1)) for i in range(REBUILDS)}) if len(path) > 1 else [0]
    built = {path[i]: build(path[i]) for i in picks}
    kept = path[0] if incumbent is None else tuple(incumbent)
    if kept not in built:
        built[kept] = build(kept)
    best = min(built, key=lambda lay: (rank(built[lay][1]), lay != kept))
    # Refine: one layer at a time off the busiest ranks' stages, scored on the best order as built.
    seen: Dict[Layout, SimResult] = {}
    base = built[best][0]

    def score(layout: Layout) -> SimResult:
        if layout not in seen:
            seen[layout] = simulate(with_costs(base, layout))
        return seen[layout]

    current, improved = best, True
    while improved and len(seen) < MAX_EVALUATIONS:
        improved = False
        busy = score(current).busy
        for src in (s for r in sorted(range(pp), key=lambda r: -busy[r])[:2] for s in placement.stages_of(r)):
            for dst in range(S):
                trial = list(current)
                trial[src] -= 1
                trial[dst] += 1
                trial = tuple(trial)
                if dst != src and _valid(trial) and trial not in seen and rank(score(trial)) < rank(score(current)):
                    current, improved = trial, True
                    break
            if improved or len(seen) >= MAX_EVALUATIONS:
                break
    if current != best:  # rebuilt for its own costs, or the best order kept: whichever simulates faster
        built[current] = min(build(current), (with_costs(base, current), score(current)), key=lambda b: rank(b[1]))
    best = min(built, key=lambda lay: (rank(built[lay][1]), lay != kept))
    # Judged against the kept layout built as every candidate is (the faster of its plan for these costs
    # and the plain order under them), so a layout reported as a change is MIN_GAIN faster under the
    # figures printed beside it, and never slower than the even split planned for the same costs.
    kept_schedule, kept_sim = built[kept]
    schedule, sim = built[best]
    if fits(kept_sim) and sim.makespan > kept_sim.makespan * (1 - MIN_GAIN):  # not worth changing anything for
        best, schedule, sim = kept, kept_schedule, kept_sim
    # Shown beside it: the even split in the order an even run uses (its speed-up then includes the order
    # planned for the costs, never less than the layout's), an incumbent as built.
    shown = simulate(with_costs(plain, kept)) if incumbent is None else kept_sim
    if not fits(sim):
        raise ConfigError(f"no layout of {model.num_layers} layers fits {flag} {memory_budget:g} with {name} at pp={pp}: "
                          f"the least peak found is {max(sim.peak_vs_1f1b):.3g} of 1F1B's (layout "
                          f"{','.join(map(str, best))}); raise {flag} or pick a schedule with less memory (v-min)")
    return Balanced(best, schedule, sim, kept, shown, len(seen) + len(built), memory_budget)


def compare_balanced(shape: ModelShape, pp: int, microbatches: int, costs: Optional[Costs] = None,
                     memory_budget: Optional[float] = None, names: Optional[Sequence[str]] = None,
                     layers_flag: str = "--num-layers") -> List[dict]:
    """For every schedule: the even split against the balanced layout, simulated under the estimate;
    a schedule that cannot serve the sizes gives its reason."""
    rows = []
    for name in names or registry.names():
        if registry.plans_under_budget(name) and memory_budget is None:  # planned at a budget: only when one is given
            continue
        try:
            b = balance(shape, name, pp, microbatches, costs, memory_budget, flag="--memory-budget",
                        layers_flag=layers_flag)
        except ConfigError as exc:
            rows.append({"schedule": name, "error": str(exc).splitlines()[0]})
            continue
        rows.append({"schedule": name, "even_layout": list(b.even_layout), "layout": list(b.layout),
                     "even": _figures(b.even_sim), "balanced": _figures(b.sim)})
    return rows


def _figures(sim: SimResult) -> dict:
    return {"makespan": sim.makespan, "bubble_rate": sim.bubble_rate, "peak_vs_1f1b": max(sim.peak_vs_1f1b)}


def row_cells(row: dict, base: Optional[float]) -> List[str]:
    """A compare_balanced row as table cells: even (bubble, peak, time vs `base`), balanced layout
    (bubble, peak, time vs `base`), speed-up.  '(even)' when the layout is the even split (the order
    may still be planned for the estimated costs, which the speed-up then shows)."""
    e, b = row["even"], row["balanced"]
    vs = (lambda t: f"{t / base:.3f}") if base else (lambda t: "-")  # noqa: E731
    layout = ",".join(map(str, row["layout"])) if row["layout"] != row["even_layout"] else "(even)"
    return [f"{e['bubble_rate']:.2%}", f"{e['peak_vs_1f1b']:.3g}", vs(e["makespan"]), layout,
            f"{b['bubble_rate']:.2%}", f"{b['peak_vs_1f1b']:.3g}", vs(b["makespan"]),
            f"{e['makespan'] / b['makespan'] - 1:+.1%}"]
