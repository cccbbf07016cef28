"""What the papers predict for each schedule, to print next to the simulated figures.

Closed forms hold only under their stated conditions (C=0, and for some F=B=W); outside
them a prediction is None rather than a wrong number.  Memory is peak_vs_1f1b, max over ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .ops import Costs


@dataclass
class Prediction:
    bubble_rate: Optional[float] = None
    bubble_formula: str = ""
    peak_vs_1f1b: Optional[float] = None
    memory_formula: str = ""
    memory_is_bound: bool = False  # the V-shapes and ZB-H2 promise "at most", not "exactly"

    def text(self) -> str:
        parts = []
        if self.bubble_rate is not None:
            parts.append(f"bubble {self.bubble_formula} = {self.bubble_rate:.2%}")
        if self.peak_vs_1f1b is not None:
            formula = f"{self.memory_formula} = " if self.memory_formula else ""
            parts.append(f"mem {'<= ' if self.memory_is_bound else ''}{formula}{self.peak_vs_1f1b:.3g}")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {
            "bubble_rate": self.bubble_rate,
            "bubble_formula": self.bubble_formula or None,
            "peak_vs_1f1b": self.peak_vs_1f1b,
            "memory_formula": self.memory_formula or None,
            "memory_is_bound": self.memory_is_bound,
        }


def predict(name: str, pp: int, microbatches: int, costs: Costs = Costs(), chunks: int = 2, group: int = 0) -> Prediction:
    """The paper's figures for schedule `name` (an empty Prediction when it states none)."""
    p, m = pp, microbatches
    no_hop = costs.C == 0
    unit = no_hop and costs.F == costs.B == costs.W
    if name == "1f1b":
        # Makespan (m+p-1)(F+B+W) whatever F, B, W are, as long as hops are free.
        return Prediction((p - 1) / (m + p - 1) if no_hop else None, "(p-1)/(m+p-1)", 1.0)
    if name == "1f1b-interleaved":
        g = group or p
        warm = min(m * chunks, 2 * (p - 1) + (chunks - 1) * g)
        mem = (warm + 1 if warm < m * chunks else warm) / (chunks * min(p, m))
        return Prediction(
            (p - 1) / (chunks * m + p - 1) if no_hop else None, "(p-1)/(vm+p-1)", mem, "(2(p-1)+(v-1)g+1)/(vp)"
        )
    if name == "zb-h1":
        ok = unit and m >= p
        return Prediction((p - 1) / (3 * m + p - 1) if ok else None, "(p-1)/(3m+p-1)", 1.0)
    if name == "zb-h2":
        return Prediction(None, "", 2.0, "", True)
    if name == "v-zb":
        # Per-stage costs are half the user's; the start-up of one synchronous iteration.
        # With m < p there are too few microbatches to fill the V, and more bubble than that.
        f, b, w = costs.F / 2, costs.B / 2, costs.W / 2
        bubble = (p - 1) * f / ((p - 1) * f + 2 * m * (f + b + w)) if unit and m >= p else None
        return Prediction(bubble, "(p-1)F/((p-1)F+2m(F+B+W))", 1.0, "", True)
    if name == "v-half":
        return Prediction(None, "", ((p + 2) // 2) / p, "((p+2)//2)/p", True)
    if name == "v-min":
        return Prediction(None, "", ((p + 4) // 3) / p, "((p+4)//3)/p", True)
    return Prediction()
