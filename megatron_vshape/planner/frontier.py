"""The memory/time frontier on the V: for every budget from V-Min's to 2.0 of 1F1B's
activation memory, one stage-activation per step, the fastest v-auto schedule, with the
baselines as points beside it; as a table and as a picture (SVG by hand, PNG with
matplotlib when it is installed).

Each step's figure is the best schedule found at that budget or any smaller one (a
schedule that fits a smaller budget fits this one too), so the curve never rises; once it
reaches the problem's lower bound (search.lower_bound) the larger budgets are not planned.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..schedule import registry
from ..schedule.errors import ConfigError
from ..schedule.ops import Costs, StageCost
from ..schedule.simulate import simulate
from .search import budget_steps, lower_bound

BASELINES = ("1f1b", "1f1b-interleaved", "zb-h1", "zb-h2")


@dataclass
class Point:
    schedule: str
    memory_budget: Optional[float]  # None for a baseline
    peak_vs_1f1b: float
    makespan: float
    bubble_rate: float
    vs_1f1b: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def frontier(pp: int, microbatches: int, costs: Optional[Costs] = None,
             stage_costs: Optional[Sequence[StageCost]] = None) -> List[Point]:
    """The v-auto points (budget ascending) then the baselines that serve these sizes."""
    points: List[Point] = []
    best, bound = None, None
    for _, budget in budget_steps(pp, microbatches):
        if best is None or best.makespan > bound * (1 + 1e-9):  # once at the lower bound, nothing is shorter
            try:
                s = registry.build("v-auto", pp, microbatches, costs, stage_costs=stage_costs, memory_budget=budget)
            except ConfigError:
                continue
            sim = simulate(s)
            bound = lower_bound(s) if bound is None else bound  # the same at every budget
            if best is None or sim.makespan < best.makespan - 1e-9:
                best = Point("v-auto", budget, max(sim.peak_vs_1f1b), sim.makespan, sim.bubble_rate)
        points.append(Point("v-auto", budget, best.peak_vs_1f1b, best.makespan, best.bubble_rate))
    for name in BASELINES:
        try:
            s = registry.build(name, pp, microbatches, costs, stage_costs=stage_costs)
        except ConfigError:
            continue
        sim = simulate(s)
        points.append(Point(name, None, max(sim.peak_vs_1f1b), sim.makespan, sim.bubble_rate))
    base = next((p.makespan for p in points if p.schedule == "1f1b"), None)
    for p in points:
        p.vs_1f1b = p.makespan / base if base else 0.0
    if not any(p.schedule == "v-auto" for p in points):
        raise ConfigError(f"frontier: no V-shape schedule serves pp={pp}, microbatches={microbatches}; add microbatches")
    return points


COLOURS = {"v-auto": "#4272c4", "1f1b": "#444444", "1f1b-interleaved": "#9467bd", "zb-h1": "#ed7d31", "zb-h2": "#70ad47"}


def svg(points: Sequence[Point], title: str, width: int = 760, height: int = 460) -> str:
    """Memory (x, peak vs 1F1B) against makespan vs 1F1B (y)."""
    L, R, T, Bm = 70, 150, 40, 50
    xs = [p.peak_vs_1f1b for p in points] + [0.0]
    ys = [p.vs_1f1b for p in points]
    x1 = max(xs) * 1.05 or 1.0
    y0, y1 = min(ys) * 0.97, max(ys) * 1.03
    X = lambda v: L + (width - L - R) * v / x1  # noqa: E731
    Y = lambda v: T + (height - T - Bm) * (1 - (v - y0) / ((y1 - y0) or 1))  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{L}" y="22" font-size="13">{title}</text>',
           f'<line x1="{L}" y1="{height - Bm}" x2="{width - R}" y2="{height - Bm}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{height - Bm}" stroke="black"/>',
           f'<text x="{(L + width - R) / 2}" y="{height - 12}" text-anchor="middle">activation memory (peak, 1F1B = 1)</text>',
           f'<text x="16" y="{(T + height - Bm) / 2}" transform="rotate(-90 16 {(T + height - Bm) / 2})" '
           'text-anchor="middle">makespan vs 1F1B</text>']
    for k in range(6):
        xv, yv = x1 * k / 5, y0 + (y1 - y0) * k / 5
        out.append(f'<text x="{X(xv):.1f}" y="{height - Bm + 16}" text-anchor="middle">{xv:.2f}</text>')
        out.append(f'<text x="{L - 6}" y="{Y(yv) + 4:.1f}" text-anchor="end">{yv:.3f}</text>')
    auto = [p for p in points if p.schedule == "v-auto"]
    path = " ".join(f"{X(p.memory_budget):.1f},{Y(p.vs_1f1b):.1f}" for p in auto)
    out.append(f'<polyline points="{path}" fill="none" stroke="{COLOURS["v-auto"]}" stroke-width="2"/>')
    for p in auto:
        out.append(f'<circle cx="{X(p.memory_budget):.1f}" cy="{Y(p.vs_1f1b):.1f}" r="2.5" fill="{COLOURS["v-auto"]}"/>')
    legend = [("v-auto (budget on x)", COLOURS["v-auto"])]
    for p in points:
        if p.schedule != "v-auto":
            c = COLOURS.get(p.schedule, "black")
            out.append(f'<rect x="{X(p.peak_vs_1f1b) - 4:.1f}" y="{Y(p.vs_1f1b) - 4:.1f}" width="8" height="8" fill="{c}"/>')
            legend.append((p.schedule, c))
    for k, (name, c) in enumerate(legend):
        y = T + 10 + 20 * k
        out.append(f'<rect x="{width - R + 12}" y="{y - 8}" width="10" height="10" fill="{c}"/>')
        out.append(f'<text x="{width - R + 28}" y="{y + 1}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def png(points: Sequence[Point], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    auto = [p for p in points if p.schedule == "v-auto"]
    ax.plot([p.memory_budget for p in auto], [p.vs_1f1b for p in auto], "-o", ms=3, color=COLOURS["v-auto"],
            label="v-auto (budget on x)")
    for p in points:
        if p.schedule != "v-auto":
            ax.plot([p.peak_vs_1f1b], [p.vs_1f1b], "s", color=COLOURS.get(p.schedule, "black"), label=p.schedule)
    ax.set_xlabel("activation memory (peak, 1F1B = 1)")
    ax.set_ylabel("makespan vs 1F1B")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write(points: Sequence[Point], title: str, path: str) -> List[str]:
    """`path` as SVG (or PNG when it ends in .png), plus a PNG next to an SVG with matplotlib."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    root, ext = os.path.splitext(path)
    if ext.lower() == ".png":
        try:
            png(points, title, path)
        except ImportError:
            raise ConfigError(f"{path}: PNG pictures need matplotlib; pip install matplotlib, or name an .svg file") from None
        return [path]
    with open(path, "w") as f:
        f.write(svg(points, title))
    written = [path]
    try:
        png(points, title, root + ".png")
        written.append(root + ".png")
    except ImportError:
        pass
    return written
