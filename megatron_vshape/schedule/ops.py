"""The op model: ops, placements, costs and schedules. Pure Python, no torch."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, Iterator, List, Tuple

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


@dataclass
class Schedule:
    """Per-rank op lists in execution order (compute ops only; communication is derived).

    `costs` are per stage, as simulated (the user's per-rank costs divided by chunks).
    """

    name: str
    placement: Placement
    microbatches: int
    costs: Costs
    ranks: List[List[Op]]
    meta: Dict[str, object] = field(default_factory=dict)

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
