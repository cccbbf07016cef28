"""The op model: ops, placements, costs and schedules. Pure Python, no torch.

Costs and memory, the API every generator, the simulator, the search and the solver share:
  * `Costs(F, B, W, C)`: equal stages.  Generators take them per rank (as users give them)
    and store them per stage on the Schedule (`costs.per_stage(chunks)`).
  * `StageCost(F, B, W, size)`: one stage's op times as simulated, and its activation size
    relative to a plain layer stage.  `stage_table(costs, S, stage_costs)` gives all S of
    them (equal stages when `stage_costs` is None); `stage_costs.load/parse/fit` read the
    `--stage-costs` file and fit it to a schedule's stage count.
  * `Schedule.duration(kind, stage)`, `Schedule.size(stage)`, `Schedule.stage_table()`:
    the one way to ask what an op costs and how big a stage's activation is.
  * `Schedule.memory_budget`: the peak_vs_1f1b cap it was made under (verify checks it);
    `simulate.peak_activations` weighs stages by size; `peak_vs_1f1b` keeps 1F1B's rank 0
    with plain stages as 1.0.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from .errors import ConfigError

F, B, W, BW = "F", "B", "W", "BW"
OP_KINDS = (F, B, W, BW)
BACKWARD_KINDS = (B, BW)  # ops that produce the input gradient for the previous stage
RELEASE_KINDS = (W, BW)  # ops whose end frees a stage-activation

_OP_RE = re.compile(r"^(BW|F|B|W)(\d+)@(\d+)$")


@dataclass(frozen=True, order=True)
class Op:
    """One unit of compute: `kind` of `microbatch` on global `stage`. Text form `F3@5`."""

    kind: str
    microbatch: int
    stage: int

    def __post_init__(self):
        if self.kind not in OP_KINDS:
            raise ConfigError(f"unknown op kind {self.kind!r}; use one of {OP_KINDS}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"

    @staticmethod
    def parse(text: str) -> "Op":
        m = _OP_RE.match(text.strip())
        if not m:
            raise ConfigError(f"cannot parse op {text!r}; expected e.g. F3@5 (kind, microbatch, @stage)")
        return Op(m.group(1), int(m.group(2)), int(m.group(3)))

    def to_dict(self) -> dict:
        return {"op": self.kind, "stage": self.stage, "microbatch": self.microbatch}


PLACEMENTS = ("single", "loop", "v")


@dataclass(frozen=True)
class Placement:
    """Which rank holds which stage.

    single: rank r holds stage r.  loop: rank r holds r, r+p, r+2p, ... (Megatron's
    interleaving).  v: rank r holds r and 2p-1-r (two chunks only).
    """

    kind: str
    pp: int
    chunks: int = 1

    def __post_init__(self):
        if self.kind not in PLACEMENTS:
            raise ConfigError(f"unknown placement {self.kind!r}; use one of {PLACEMENTS}")
        if self.pp < 1:
            raise ConfigError(f"pp={self.pp} must be >= 1")
        if self.kind == "single" and self.chunks != 1:
            raise ConfigError("placement 'single' has exactly one chunk per rank")
        if self.kind == "v" and self.chunks != 2:
            raise ConfigError("placement 'v' has exactly two chunks per rank")
        if self.chunks < 1:
            raise ConfigError(f"chunks={self.chunks} must be >= 1")

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    @cached_property
    def _rank_table(self) -> Tuple[int, ...]:
        # Looked up for every op by the verifier and simulator: computed once per placement.
        return tuple(2 * self.pp - 1 - s if self.kind == "v" and s >= self.pp else s % self.pp for s in range(self.num_stages))

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            self._check_stage(stage)
        return self._rank_table[stage]

    def chunk_of(self, stage: int) -> int:
        self._check_stage(stage)
        return stage // self.pp

    def stages_of(self, rank: int) -> List[int]:
        """Global stages held by `rank`, indexed by chunk."""
        if self.kind == "v":
            return [rank, 2 * self.pp - 1 - rank]
        return [rank + c * self.pp for c in range(self.chunks)]

    def stage_of(self, rank: int, chunk: int) -> int:
        return self.stages_of(rank)[chunk]

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range 0..{self.num_stages - 1}")


@dataclass(frozen=True)
class Costs:
    """Time of one op for one microbatch (F, B, W) and of one point-to-point hop (C)."""

    F: float = 1.0
    B: float = 1.0
    W: float = 1.0
    C: float = 0.0

    def __post_init__(self):
        for name in ("F", "B", "W", "C"):
            value = getattr(self, name)
            if not math.isfinite(value):  # nan or inf would turn every simulated figure into nan
                raise ConfigError(f"cost {name}={value} must be a finite number")
        for name in ("F", "B", "W"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"cost {name}={getattr(self, name)} must be > 0")
        if self.C < 0:
            raise ConfigError(f"cost C={self.C} must be >= 0")

    @staticmethod
    def parse(text: str) -> "Costs":
        """Parse `F,B,W[,C]` as a user writes it on the command line."""
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            raise ConfigError(f"--costs {text!r}: expected numbers F,B,W[,C], e.g. 1,1,1,0") from None
        if len(values) not in (3, 4):
            raise ConfigError(f"--costs {text!r}: expected 3 or 4 numbers F,B,W[,C], e.g. 2,2.2,1.6,0.05")
        return Costs(*values)

    def per_stage(self, chunks: int) -> "Costs":
        """Users give costs for one rank's share of the model; a stage of `chunks` costs 1/chunks."""
        return Costs(self.F / chunks, self.B / chunks, self.W / chunks, self.C)

    def of(self, kind: str) -> float:
        return self.B + self.W if kind == BW else getattr(self, kind)

    def to_dict(self) -> dict:
        return {"F": self.F, "B": self.B, "W": self.W, "C": self.C}


@dataclass(frozen=True)
class StageCost:
    """One stage's op times for one microbatch, as simulated (not per rank), and the size of
    its activation relative to a plain layer stage of the same schedule (1.0: as many layers
    as the other stages, nothing extra; the embedding or the output layer with the loss can
    make it larger)."""

    F: float
    B: float
    W: float
    size: float = 1.0

    def __post_init__(self):
        for name in ("F", "B", "W", "size"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"stage cost {name}={value!r} must be a finite number >= 0")

    def of(self, kind: str) -> float:
        return self.B + self.W if kind == BW else getattr(self, kind)

    def to_dict(self) -> dict:
        return {"F": self.F, "B": self.B, "W": self.W, "size": self.size}


def stage_table(costs: Costs, num_stages: int, stage_costs: Optional[Sequence[StageCost]] = None) -> Tuple[StageCost, ...]:
    """Every stage's StageCost: `stage_costs` when given, else `costs` (per stage) with size 1.
    The one place that decides what an op on a stage costs; simulator, generators and the
    search all read durations and sizes through it (or Schedule.stage_cost, which uses it)."""
    if stage_costs is None:
        return (StageCost(costs.F, costs.B, costs.W, 1.0),) * num_stages
    if len(stage_costs) != num_stages:
        raise ConfigError(f"{len(stage_costs)} stage costs for {num_stages} stages; give one entry per stage")
    return tuple(stage_costs)


@dataclass
class Schedule:
    """Per-rank op lists in execution order (compute ops only; communication is derived).

    `costs` are per stage, as simulated (the user's per-rank costs divided by chunks); C is
    the hop latency.  `stage_costs`, when set, overrides F, B, W per stage and gives each
    stage's activation size (unequal stages); `costs` then stays the equal-stage value.
    `memory_budget`, when set, is the peak_vs_1f1b cap the schedule was made under; the
    verifier checks that no rank exceeds it.  Read op times and sizes through
    `duration(kind, stage)` and `size(stage)` (or `stage_table()` for all stages at once).
    """

    name: str
    placement: Placement
    microbatches: int
    costs: Costs
    ranks: List[List[Op]]
    meta: Dict[str, object] = field(default_factory=dict)
    stage_costs: Optional[Tuple[StageCost, ...]] = None
    memory_budget: Optional[float] = None

    def __post_init__(self):
        if self.stage_costs is not None:
            self.stage_costs = stage_table(self.costs, self.placement.num_stages, tuple(self.stage_costs))

    def stage_table(self) -> Tuple[StageCost, ...]:
        return stage_table(self.costs, self.placement.num_stages, self.stage_costs)

    def stage_cost(self, stage: int) -> StageCost:
        return self.stage_table()[stage]

    def duration(self, kind: str, stage: int) -> float:
        """Time of one op of `kind` on `stage` for one microbatch."""
        return self.costs.of(kind) if self.stage_costs is None else self.stage_costs[stage].of(kind)

    def size(self, stage: int) -> float:
        """Activation size of `stage` relative to a plain layer stage (1 when stages are equal)."""
        return 1 if self.stage_costs is None else self.stage_costs[stage].size

    @property
    def pp(self) -> int:
        return self.placement.pp

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def split_backward(self) -> bool:
        """True when backward is split into B and W (zero-bubble style)."""
        return any(op.kind == B for ops in self.ranks for op in ops)

    def ops(self) -> Iterator[Tuple[int, Op]]:
        for rank, ops in enumerate(self.ranks):
            for op in ops:
                yield rank, op

    def text(self) -> str:
        """Compact text form: one line per rank, ops separated by spaces."""
        return "\n".join(f"rank {r}: " + " ".join(str(op) for op in ops) for r, ops in enumerate(self.ranks))


def check_sizes(name: str, pp: int, microbatches: int, *, min_pp: int = 2, min_microbatches: int = 1) -> None:
    """Validate the sizes every generator shares; the error names the minimum."""
    if pp < min_pp:
        raise ConfigError(f"{name}: pp={pp} is too small; this schedule needs pp >= {min_pp}")
    if microbatches < min_microbatches:
        raise ConfigError(
            f"{name}: microbatches={microbatches} is too few for pp={pp}; "
            f"this schedule needs microbatches >= {min_microbatches}"
        )


def check_no_options(name: str, options: Dict[str, object]) -> None:
    """Generators take **options so that every one can name an option it does not know."""
    if options:
        raise ConfigError(f"{name}: unknown option(s) {', '.join(sorted(options))}; this schedule takes none")
