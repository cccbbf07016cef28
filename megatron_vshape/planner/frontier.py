"""The memory/time frontier on the V: for every budget from V-Min's to 2.0 of 1F1B's
activation memory, one stage-activation per step, the fastest v-auto schedule, with the
baselines as points beside it; as a table and as a picture (SVG by hand, PNG with
matplotlib when it is installed).

Each step's figure is the best schedule found at that budget or any smaller one (a
schedule that fits a smaller budget fits this one too), so the curve never rises; once it
reaches the problem's lower bound the larger budgets are not planned (choose.v_auto_steps, which
`--pipeline-schedule auto` weighs too).

With the model's shape (`balanced`), a second series beside the even split's: at every budget the
layout and plan that the balance search of `--pipeline-balance auto` picks (schedule/balance.py),
and each baseline at its balanced layout; both relative to 1F1B's even split.  The balance search
keeps the even split planned for its costs (the even curve's plan) unless another layout simulates
balance.MIN_GAIN faster, so its curve is never above the even one.  The baselines are balanced
without a memory budget (they have none to meet): a balanced baseline may peak above its even
split, and the table and the picture show it at its own peak.
"""
from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple
from xml.sax.saxutils import escape

from ..schedule import registry
from ..schedule.balance import balance
from ..schedule.errors import ConfigError
from ..schedule.layout import even_split
from ..schedule.ops import Costs, Placement, StageCost
from ..schedule.simulate import simulate
from .choose import v_auto_steps
from .search import budget_steps

BASELINES = ("1f1b", "1f1b-interleaved", "zb-h1", "zb-h2")


@dataclass
class Point:
    schedule: str
    memory_budget: Optional[float]  # None for a baseline
    peak_vs_1f1b: float
    makespan: float
    bubble_rate: float
    vs_1f1b: float = 0.0
    layout: Optional[Tuple[int, ...]] = None  # the balanced series: layers per stage in model order

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def frontier(pp: int, microbatches: int, costs: Optional[Costs] = None,
             stage_costs: Optional[Sequence[StageCost]] = None) -> List[Point]:
    """The v-auto points (budget ascending) then the baselines that serve these sizes."""
    points = _points(pp, microbatches, costs, stage_costs)
    _relative(points, points)
    _check_served(pp, microbatches, points)
    return points


def _check_served(pp: int, microbatches: int, points: Sequence[Point]) -> None:
    if not any(p.schedule == "v-auto" for p in points):
        raise ConfigError(f"frontier: no V-shape schedule serves pp={pp}, microbatches={microbatches}; add microbatches")


def _points(pp: int, microbatches: int, costs: Optional[Costs], stage_costs: Optional[Sequence[StageCost]]) -> List[Point]:
    points = [Point("v-auto", budget, max(sim.peak_vs_1f1b), sim.makespan, sim.bubble_rate)
              for budget, _, sim in v_auto_steps(pp, microbatches, costs, stage_costs)]
    for name in BASELINES:
        try:
            s = registry.build(name, pp, microbatches, costs, stage_costs=stage_costs)
        except ConfigError:
            continue
        sim = simulate(s)
        points.append(Point(name, None, max(sim.peak_vs_1f1b), sim.makespan, sim.bubble_rate))
    return points


def _relative(points: Sequence[Point], reference: Sequence[Point]) -> None:
    """vs_1f1b of `points` against the 1F1B point of `reference`."""
    base = next((p.makespan for p in reference if p.schedule == "1f1b"), None)
    for p in points:
        p.vs_1f1b = p.makespan / base if base else 0.0


def balanced(shape, pp: int, microbatches: int, costs: Optional[Costs] = None,
             layers_flag: str = "--num-layers") -> Tuple[List[Point], List[Point]]:
    """(even, balanced) for a model shape (schedule/balance.py's ModelShape): frontier() of the even
    split's estimated stage costs, and at the same budgets the fastest layout the balance search
    finds within each (the best at that budget or below, as above), then the baselines balanced;
    both series relative to 1F1B's even split.  A budget no layout fits has no balanced point.
    ConfigError (naming `layers_flag`) when the V's even split would leave a middle stage empty."""
    even = even_split(shape.num_layers, Placement("v", pp, 2), "v-auto", layers_flag)
    points = _points(pp, microbatches, costs, shape.stage_costs(even, pp))
    out: List[Point] = []
    best, refused = None, None
    for _, budget in budget_steps(pp, microbatches):
        try:
            b = balance(shape, "v-auto", pp, microbatches, costs, budget, flag="--memory-budget", layers_flag=layers_flag)
        except ConfigError as exc:  # nothing fits this budget (or the shape cannot be split at all)
            b, refused = None, exc
        if b is not None and (best is None or b.sim.makespan < best.makespan - 1e-9):
            best = Point("v-auto", budget, max(b.sim.peak_vs_1f1b), b.sim.makespan, b.sim.bubble_rate,
                         layout=tuple(b.layout))
        if best is not None:
            out.append(Point("v-auto", budget, best.peak_vs_1f1b, best.makespan, best.bubble_rate, layout=best.layout))
    for name in (p.schedule for p in points if p.memory_budget is None):  # the baselines that serve these sizes
        try:
            b = balance(shape, name, pp, microbatches, costs, layers_flag=layers_flag)
        except ConfigError as exc:
            refused = exc
            continue
        out.append(Point(name, None, max(b.sim.peak_vs_1f1b), b.sim.makespan, b.sim.bubble_rate, layout=tuple(b.layout)))
    if not out and refused is not None:
        raise refused
    _relative(points, points)
    _relative(out, points)
    _check_served(pp, microbatches, points + out)
    return points, out


COLOURS = {"v-auto": "#4272c4", "1f1b": "#444444", "1f1b-interleaved": "#9467bd", "zb-h1": "#ed7d31", "zb-h2": "#70ad47"}
BALANCED_COLOUR = "#b2182b"  # the balanced V curve; the baselines keep their colours, drawn hollow
EVEN_LABEL, BALANCED_LABEL = "even split", "balanced layout"


def _series(points: Sequence[Point], balanced: Optional[Sequence[Point]]):
    """[(label, colour, dashed, v-auto points, baseline points, hollow)]: one entry without a balanced series."""
    auto = lambda ps: [p for p in ps if p.schedule == "v-auto"]  # noqa: E731
    base = lambda ps: [p for p in ps if p.schedule != "v-auto"]  # noqa: E731
    if balanced is None:
        return [("v-auto (budget on x)", COLOURS["v-auto"], False, auto(points), base(points), False)]
    return [(f"v-auto, {EVEN_LABEL} (budget on x)", COLOURS["v-auto"], False, auto(points), base(points), False),
            (f"v-auto, {BALANCED_LABEL} (budget on x)", BALANCED_COLOUR, True, auto(balanced), base(balanced), True)]


def _layout(p: Point) -> str:
    return f" ({','.join(map(str, p.layout))})" if p.layout else ""


def svg(points: Sequence[Point], title: str, width: int = 760, height: int = 460,
        balanced: Optional[Sequence[Point]] = None) -> str:
    """Memory (x: peak vs 1F1B; a v-auto point at its budget) against makespan vs 1F1B (y).  With
    `balanced`, its curve dashed in its own colour and its baselines hollow, each series a <g> titled
    with its legend label."""
    series = _series(points, balanced)
    everything = [p for *_, auto, base, _ in series for p in auto + base]
    heading = textwrap.wrap(title, 100)
    L, R, T, Bm = 70, (150 if balanced is None else 260), 24 + 16 * len(heading), 50
    width += 0 if balanced is None else R - 150
    xs = [p.peak_vs_1f1b for p in everything] + [p.memory_budget or 0.0 for p in everything]
    ys = [p.vs_1f1b for p in everything]
    x1 = max(xs) * 1.05 or 1.0
    y0, y1 = min(ys) * 0.97, max(ys) * 1.03
    X = lambda v: L + (width - L - R) * v / x1  # noqa: E731
    Y = lambda v: T + (height - T - Bm) * (1 - (v - y0) / ((y1 - y0) or 1))  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           *(f'<text x="{L}" y="{22 + 16 * k}" font-size="13">{escape(line)}</text>' for k, line in enumerate(heading)),
           f'<line x1="{L}" y1="{height - Bm}" x2="{width - R}" y2="{height - Bm}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{height - Bm}" stroke="black"/>',
           f'<text x="{(L + width - R) / 2}" y="{height - 12}" text-anchor="middle">activation memory (peak, 1F1B = 1)</text>',
           f'<text x="16" y="{(T + height - Bm) / 2}" transform="rotate(-90 16 {(T + height - Bm) / 2})" '
           'text-anchor="middle">makespan vs 1F1B</text>']
    for k in range(6):
        xv, yv = x1 * k / 5, y0 + (y1 - y0) * k / 5
        out.append(f'<text x="{X(xv):.1f}" y="{height - Bm + 16}" text-anchor="middle">{xv:.2f}</text>')
        out.append(f'<text x="{L - 6}" y="{Y(yv) + 4:.1f}" text-anchor="end">{yv:.3f}</text>')
    legend = []  # (label, draw the swatch at (x, y))
    for label, colour, dashed, auto, base, hollow in series:
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        path = " ".join(f"{X(p.memory_budget):.1f},{Y(p.vs_1f1b):.1f}" for p in auto)
        out.append(f"<g><title>{label}</title>")
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        out += [f'<circle cx="{X(p.memory_budget):.1f}" cy="{Y(p.vs_1f1b):.1f}" r="2.5" fill="{colour}"><title>budget '
                f"{p.memory_budget:.4g}{_layout(p)}: peak {p.peak_vs_1f1b:.3g}, {p.vs_1f1b:.3f} of 1F1B's time</title></circle>"
                for p in auto]
        out.append("</g>")
        legend.append((label, lambda x, y, c=colour, d=dash: f'<line x1="{x}" y1="{y}" x2="{x + 18}" y2="{y}" '
                                                             f'stroke="{c}" stroke-width="2"{d}/>'))
        for p in base:
            c = COLOURS.get(p.schedule, "black")
            fill = f'fill="white" stroke="{c}" stroke-width="2"' if hollow else f'fill="{c}"'
            what = f"{p.schedule}, {EVEN_LABEL if not hollow else BALANCED_LABEL}{_layout(p)}" if balanced else p.schedule
            out.append(f'<rect x="{X(p.peak_vs_1f1b) - 4:.1f}" y="{Y(p.vs_1f1b) - 4:.1f}" width="8" height="8" {fill}>'
                       f"<title>{what}: peak {p.peak_vs_1f1b:.3g}, {p.vs_1f1b:.3f} of 1F1B's time</title></rect>")
    for name in dict.fromkeys(p.schedule for *_, base, _ in series for p in base):
        legend.append((name, lambda x, y, c=COLOURS.get(name, "black"): f'<rect x="{x + 4}" y="{y - 5}" width="10" '
                                                                         f'height="10" fill="{c}"/>'))
    if balanced is not None:  # what the two square styles mean
        legend.append((f"filled: {EVEN_LABEL}", lambda x, y: f'<rect x="{x + 4}" y="{y - 5}" width="10" height="10" '
                                                             'fill="#888888"/>'))
        legend.append((f"hollow: {BALANCED_LABEL} (no budget)", lambda x, y: f'<rect x="{x + 4}" y="{y - 5}" width="10" '
                                                                 'height="10" fill="white" stroke="#888888" stroke-width="2"/>'))
    for k, (label, swatch) in enumerate(legend):
        y = T + 10 + 20 * k
        out.append(swatch(width - R + 12, y - 3))
        out.append(f'<text x="{width - R + 36}" y="{y + 1}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def png(points: Sequence[Point], title: str, path: str, balanced: Optional[Sequence[Point]] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5 if balanced is None else 9, 4.5))
    for label, colour, dashed, auto, base, hollow in _series(points, balanced):
        ax.plot([p.memory_budget for p in auto], [p.vs_1f1b for p in auto], "--o" if dashed else "-o", ms=3,
                color=colour, label=label)
        for p in base:
            c = COLOURS.get(p.schedule, "black")
            what = f"{p.schedule}, {BALANCED_LABEL + ' (no budget)' if hollow else EVEN_LABEL}" if balanced is not None \
                else p.schedule
            ax.plot([p.peak_vs_1f1b], [p.vs_1f1b], "s", color=c, markerfacecolor="white" if hollow else c, label=what)
    ax.set_xlabel("activation memory (peak, 1F1B = 1)")
    ax.set_ylabel("makespan vs 1F1B")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)
    if balanced is None:
        ax.legend(fontsize=8, loc="upper right")
    else:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write(points: Sequence[Point], title: str, path: str, balanced: Optional[Sequence[Point]] = None) -> List[str]:
    """`path` as SVG (or PNG when it ends in .png), plus a PNG next to an SVG with matplotlib."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    root, ext = os.path.splitext(path)
    if ext.lower() == ".png":
        try:
            png(points, title, path, balanced)
        except ImportError:
            raise ConfigError(f"{path}: PNG pictures need matplotlib; pip install matplotlib, or name an .svg file") from None
        return [path]
    with open(path, "w") as f:
        f.write(svg(points, title, balanced=balanced))
    written = [path]
    try:
        png(points, title, root + ".png", balanced)
        written.append(root + ".png")
    except ImportError:
        pass
    return written
