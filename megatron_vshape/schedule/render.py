"""Timeline pictures of a simulated schedule, like the paper's Figure 4.

One row per rank, one box per op at its simulated start and end, coloured by op kind and
shaded by chunk (chunk 0 full colour, later chunks lighter), microbatch number inside.
SVG is written by hand so pictures need no dependency; PNG needs matplotlib, imported only
when asked for.  `text` draws the same timeline for a terminal.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple
from xml.sax.saxutils import escape

from .errors import ConfigError
from .ops import B, BW, F, W, Schedule
from .simulate import SimResult, simulate

KIND_COLOUR = {F: (66, 114, 196), B: (237, 125, 49), W: (112, 173, 71), BW: (192, 80, 77)}
KIND_LABEL = {F: "F forward", B: "B input grad", W: "W weight grad", BW: "BW full backward"}

ROW_H, LEFT, TOP, BOTTOM, RIGHT = 26, 64, 46, 40, 16


def shade(kind: str, chunk: int, chunks: int) -> Tuple[int, int, int]:
    """Kind colour mixed with white: more white for later chunks."""
    mix = 0.0 if chunks <= 1 else 0.55 * chunk / (chunks - 1)
    return tuple(round(c + (255 - c) * mix) for c in KIND_COLOUR[kind])  # type: ignore[return-value]


def _kinds_present(schedule: Schedule) -> List[str]:
    """Op kinds the schedule uses, in legend order (a legend lists only these)."""
    used = {op.kind for ops in schedule.ranks for op in ops}
    return [k for k in (F, B, W, BW) if k in used]


def _hex(rgb: Tuple[int, int, int]) -> str:
    return "#%02x%02x%02x" % rgb


def _ticks(makespan: float, target: int = 10) -> List[float]:
    if makespan <= 0:
        return [0.0]
    raw = makespan / target
    mag = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 1.0
    while mag > raw:
        mag /= 10
    step = next(s * mag for s in (1, 2, 5, 10) if s * mag >= raw)
    out, t = [], 0.0
    while t <= makespan + 1e-9:
        out.append(round(t, 6))
        t += step
    return out


def title(schedule: Schedule, sim: SimResult) -> str:
    c = schedule.costs
    return (
        f"{schedule.name}  pp={schedule.pp}  microbatches={schedule.microbatches}  placement={schedule.placement.kind}  "
        f"per-stage costs F={c.F:g} B={c.B:g} W={c.W:g} C={c.C:g}  makespan={sim.makespan:g}  "
        f"bubble={sim.bubble_rate:.2%}  peak vs 1F1B={max(sim.peak_vs_1f1b):.3g}"
    )


def svg(schedule: Schedule, sim: Optional[SimResult] = None, width: int = 1600) -> str:
    sim = simulate(schedule) if sim is None else sim
    pl = schedule.placement
    span = sim.makespan or 1.0
    scale = (width - LEFT - RIGHT) / span
    height = TOP + ROW_H * schedule.pp + BOTTOM
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{LEFT}" y="16" font-size="13">{escape(title(schedule, sim))}</text>',
    ]
    # Legend: one swatch per kind present, per chunk.
    kinds = _kinds_present(schedule)
    x = LEFT
    for k in kinds:
        for c in range(pl.chunks):
            out.append(f'<rect x="{x}" y="24" width="14" height="12" fill="{_hex(shade(k, c, pl.chunks))}" stroke="#333" stroke-width="0.5"/>')
            x += 16
        label = KIND_LABEL[k] + (f" (chunk 0..{pl.chunks - 1})" if pl.chunks > 1 else "")
        out.append(f'<text x="{x + 2}" y="34" font-size="11">{escape(label)}</text>')
        x += 9 + 6 * len(label)
    for r, row in enumerate(sim.timeline):
        y = TOP + r * ROW_H
        out.append(f'<text x="{LEFT - 8}" y="{y + ROW_H / 2 + 4}" font-size="12" text-anchor="end">rank {r}</text>')
        out.append(f'<rect x="{LEFT}" y="{y + 1}" width="{span * scale:.2f}" height="{ROW_H - 2}" fill="#f2f2f2"/>')
        for op, start, end in row:
            bx, bw = LEFT + start * scale, (end - start) * scale
            fill = _hex(shade(op.kind, pl.chunk_of(op.stage), pl.chunks))
            out.append(
                f'<rect x="{bx:.2f}" y="{y + 1}" width="{bw:.2f}" height="{ROW_H - 2}" fill="{fill}" stroke="white" stroke-width="0.6">'
                f"<title>{op} [{start:g}, {end:g}]</title></rect>"
            )
            size = min(11.0, bw / (0.62 * len(str(op.microbatch)) + 0.1))
            if size >= 5:
                out.append(
                    f'<text x="{bx + bw / 2:.2f}" y="{y + ROW_H / 2 + size / 3:.2f}" font-size="{size:.1f}" '
                    f'text-anchor="middle" fill="black">{op.microbatch}</text>'
                )
    axis_y = TOP + ROW_H * schedule.pp + 4
    out.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{LEFT + span * scale:.2f}" y2="{axis_y}" stroke="#333"/>')
    for t in _ticks(span):
        tx = LEFT + t * scale
        out.append(f'<line x1="{tx:.2f}" y1="{axis_y}" x2="{tx:.2f}" y2="{axis_y + 5}" stroke="#333"/>')
        out.append(f'<text x="{tx:.2f}" y="{axis_y + 17}" font-size="11" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{LEFT + span * scale:.2f}" y="{axis_y + 32}" font-size="11" text-anchor="end">time (cost units)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def png(schedule: Schedule, path: str, sim: Optional[SimResult] = None) -> None:
    """The same picture through matplotlib (raises ImportError when it is not installed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sim = simulate(schedule) if sim is None else sim
    pl = schedule.placement
    fig, ax = plt.subplots(figsize=(16, 0.45 * schedule.pp + 1.6))
    for r, row in enumerate(sim.timeline):
        for op, start, end in row:
            colour = [c / 255 for c in shade(op.kind, pl.chunk_of(op.stage), pl.chunks)]
            ax.barh(r, end - start, left=start, height=0.9, color=colour, edgecolor="white", linewidth=0.5)
            if (end - start) / (sim.makespan or 1) * 1400 >= 7 * len(str(op.microbatch)):
                ax.text((start + end) / 2, r, str(op.microbatch), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(schedule.pp), [f"rank {r}" for r in range(schedule.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan or 1)
    ax.set_xlabel("time (cost units)")
    ax.set_title(title(schedule, sim), fontsize=8)
    kinds = _kinds_present(schedule)
    handles = [
        Patch(color=[v / 255 for v in shade(k, c, pl.chunks)], label=KIND_LABEL[k] + (f", chunk {c}" if pl.chunks > 1 else ""))
        for k in kinds
        for c in range(pl.chunks)
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=min(len(handles), 8), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write_picture(schedule: Schedule, path: str, sim: Optional[SimResult] = None) -> List[str]:
    """Write `path` as SVG (PNG if it ends in .png), plus a PNG next to an SVG when matplotlib
    is importable.  Returns the files written."""
    sim = simulate(schedule) if sim is None else sim
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    root, ext = os.path.splitext(path)
    if ext.lower() == ".png":
        try:
            png(schedule, path, sim)
        except ImportError:
            raise ConfigError(f"{path}: PNG pictures need matplotlib; pip install matplotlib, or name an .svg file") from None
        return [path]
    with open(path, "w") as f:
        f.write(svg(schedule, sim))
    written = [path]
    try:
        png(schedule, root + ".png", sim)
        written.append(root + ".png")
    except ImportError:
        pass
    return written


def text(schedule: Schedule, sim: Optional[SimResult] = None, columns: int = 120) -> str:
    """Terminal timeline: each op as `F3@5` over the columns it covers, shortened to `F3`
    (kind, microbatch) or to its kind letter when too narrow; '.' where the rank idles.
    Without colours the stage is the only way to tell chunks apart, so it is kept when it fits."""
    sim = simulate(schedule) if sim is None else sim
    span = sim.makespan or 1.0
    per_col = span / columns
    lines = []
    for r, row in enumerate(sim.timeline):
        cells = ["."] * columns
        for op, start, end in row:
            a = int(round(start / per_col))
            b = max(a + 1, int(round(end / per_col)))
            width = b - a
            label = next((t for t in (str(op), f"{op.kind}{op.microbatch}") if len(t) <= width), op.kind * width)
            body = label[:width].ljust(width)
            cells[a : min(b, columns)] = list(body[: max(0, min(b, columns) - a)])
        lines.append(f"rank {r:>3} |{''.join(cells)}|")
    return "\n".join(lines)
