"""Stage costs from the model's shape, and the layout that minimises the simulated iteration time.

The estimate (pure arithmetic, per token of one microbatch, divided by tensor parallelism tp):

* a transformer layer: its GEMMs cost G = 2(4h^2 + 2h*ffn) FLOPs forward (QKV and output
  projection, the two MLP matrices), attention's two batched matmuls A = 4sh.  F = G + A;
  B = G + 2A (input gradients of the GEMMs, and both operands of the attention matmuls: no
  weights there); W = G (weight gradients of the GEMMs only).  Activation: 34h bytes (16-bit
  training without recomputation, with flash attention: Korthikanti et al. 2022's count).
* the output layer: one GEMM of 2hV FLOPs in each of F, B and W.  The loss (softmax cross-entropy
  over V logits, memory-bound): counted as LOSS_FLOPS_PER_VOCAB * V FLOP-equivalents in F and
  in B.  Activation: the fp32 logits kept for the loss's backward, 4V bytes.
* the embedding: a lookup (F, 2h) and its weight gradient (W): a scatter-add (2h) into a dense
  V x h gradient that is cleared and accumulated once per microbatch, 2Vh / (s * micro batch) per
  token (small on GPUs' long sequences, visible on small CPU runs).  Its output is the first
  layer's input, already counted there.

Stage s of a layout holds n_s layers plus the embedding (stage 0) and the output layer with the
loss (last stage).  Times are in units of the F of one rank's share of plain layers (L/p, what
`--costs` means, so schedules compare) and sizes relative to a plain stage's activation (L/S
layers), as StageCost wants; only ratios matter.

The search (`balance`): the layouts on the way from the even split to the one that evens out
each rank's total work (one layer moved per step) are planned by the schedule's generator for
their stage costs and simulated (REBUILDS of them, the ends included); the best is refined by
moving one layer at a time off the busiest ranks' stages while the simulated makespan of its
order drops, and that refinement is kept only if it simulates faster (rebuilt, or in the same
order).  Within the memory budget (peak_vs_1f1b on every rank), the fastest wins; the even split
on ties.  What is printed is the chosen schedule's simulation, next to the even split's.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from . import registry
from .errors import ConfigError
from .layout import Layout, even
from .ops import Costs, Placement, Schedule, StageCost
from .simulate import SimResult, simulate

LOSS_FLOPS_PER_VOCAB = 10.0  # softmax, log and their gradient per logit: a rough memory-bound figure
LAYER_ACT_BYTES_PER_H = 34.0
MAX_EVALUATIONS = 300  # simulations the local refinement may spend
MIN_GAIN = 0.005  # a layout must simulate this much faster than the even split to be chosen
REBUILDS = 4  # layouts on the way to even ranks that are planned and simulated


@dataclass(frozen=True)
class ModelShape:
    """What the estimate reads: GPT sizes as Megatron names them."""

    num_layers: int
    hidden_size: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: Optional[int] = None
    tensor_model_parallel_size: int = 1
    micro_batch_size: int = 1

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "seq_length", "vocab_size", "tensor_model_parallel_size",
                     "micro_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')}={value!r} must be a whole number >= 1 for the "
                                  "stage-cost estimate")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def layer(self) -> Tuple[float, float, float, float]:
        """(F, B, W, activation bytes) of one transformer layer, per token."""
        h, tp = self.hidden_size, self.tensor_model_parallel_size
        gemm = 2.0 * (4 * h * h + 2 * h * self.ffn) / tp
        attn = 4.0 * self.seq_length * h / tp
        return gemm + attn, gemm + 2 * attn, gemm, LAYER_ACT_BYTES_PER_H * h / tp

    def head(self) -> Tuple[float, float, float, float]:
        """(F, B, W, activation bytes) of the output layer and the loss, per token."""
        v, tp = self.vocab_size, self.tensor_model_parallel_size
        gemm, loss = 2.0 * self.hidden_size * v / tp, LOSS_FLOPS_PER_VOCAB * v / tp
        return gemm + loss, gemm + loss, gemm, 4.0 * v / tp

    def embedding(self) -> Tuple[float, float, float, float]:
        h, tokens = self.hidden_size, self.seq_length * self.micro_batch_size
        dense_grad = 2.0 * self.vocab_size * h / tokens / self.tensor_model_parallel_size
        return 2.0 * h, 0.0, 2.0 * h + dense_grad, 0.0

    def parts(self) -> "PartCosts":
        """The estimate as the costs of the model's parts (per token: only ratios matter)."""
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
    (a least-squares fit: their total over their layers); the embedding and the head are what
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

    def summary(self, labels: Tuple[str, str] = ("even", "balanced")) -> str:
        """One line per layout (the kept one first): layers per stage, makespan, bubble, peak per rank."""
        def line(what, layout, sim):
            peaks = " ".join(f"{p:.2f}" for p in sim.peak_vs_1f1b)
            return (f"{what:>8} {','.join(map(str, layout))}: iteration {sim.makespan:.4g} (units of one rank's F), "
                    f"bubble {sim.bubble_rate:.1%}, peak vs 1F1B per rank {peaks}")
        gain = self.even_sim.makespan / self.sim.makespan - 1 if self.sim.makespan else 0.0
        return "\n".join([line(labels[0], self.even_layout, self.even_sim),
                          line(labels[1], self.layout, self.sim) + f" ({gain:+.1%} speed)"])


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
            incumbent: Optional[Layout] = None, **options) -> Balanced:
    """The layout of `model.num_layers` layers for schedule `name` that minimises the simulated
    iteration time within `memory_budget` (peak_vs_1f1b on every rank); ConfigError when none fits.
    `model`: a ModelShape (the estimate) or PartCosts (e.g. measured_parts).  `incumbent`: the layout
    kept unless another simulates MIN_GAIN faster (default the even split), itself in the order
    planned for these costs; `even_layout`/`even_sim` then report it.  v-auto is planned at that
    budget (its generator's default without one): callers pass it once."""
    if name == "v-auto":
        options = {**options, "memory_budget": memory_budget}
    plain = registry.build(name, pp, microbatches, costs, **options)  # the order an even run uses today
    placement = plain.placement
    S = placement.num_stages
    if model.num_layers < S - 2:
        raise ConfigError(f"--num-layers={model.num_layers} is too few to give each of the {S - 2} middle stages of "
                          f"{name} at pp={pp} a layer; use at least {S - 2}")

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
    if incumbent is not None:
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
    # The even split in the order an even run uses; an incumbent in the order planned for these costs.
    kept_schedule, kept_sim = (with_costs(plain, kept), simulate(with_costs(plain, kept))) if incumbent is None \
        else built[kept]
    schedule, sim = built[best]
    if fits(kept_sim) and sim.makespan > kept_sim.makespan * (1 - MIN_GAIN):  # not worth changing anything for
        best, schedule, sim = kept, kept_schedule, kept_sim
    if not fits(sim):
        raise ConfigError(f"no layout of {model.num_layers} layers fits {flag} {memory_budget:g} with {name} at pp={pp}: "
                          f"the least peak found is {max(sim.peak_vs_1f1b):.3g} of 1F1B's (layout "
                          f"{','.join(map(str, best))}); raise {flag} or pick a schedule with less memory (v-min)")
    return Balanced(best, schedule, sim, kept, kept_sim, len(seen) + len(built))


def compare_balanced(shape: ModelShape, pp: int, microbatches: int, costs: Optional[Costs] = None,
                     memory_budget: Optional[float] = None, names: Optional[Sequence[str]] = None) -> List[dict]:
    """For every schedule: the even split against the balanced layout, simulated under the estimate;
    a schedule that cannot serve the sizes gives its reason."""
    rows = []
    for name in names or registry.names():
        if name == "v-auto" and memory_budget is None:  # planned at a budget: only when one is given
            continue
        try:
            b = balance(shape, name, pp, microbatches, costs, memory_budget, flag="--memory-budget")
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
