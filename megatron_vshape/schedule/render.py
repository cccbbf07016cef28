"""Timeline pictures of a simulated schedule, like the paper's Figure 4.

One row per rank, one box per op at its simulated start and end, coloured by op kind and
shaded by chunk (chunk 0 full colour, later chunks lighter), microbatch number inside: the
picture is made wide enough for the narrowest box to hold its number, and a number shrinks to
its box rather than being left out.  SVG is written by hand so pictures need no dependency;
PNG and PDF need matplotlib, imported only when asked for.  `text` draws the same timeline for
a terminal, with a legend for every character it uses.
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
PICTURE_EXTENSIONS = (".svg", ".png", ".pdf")
DIGIT_EM = 0.62  # width of a digit in ems (sans-serif), with a little margin
SVG_MIN_FONT, SVG_MAX_FONT, SVG_MAX_WIDTH = 6.0, 11.0, 50000  # px
PNG_MIN_FONT, PNG_MAX_FONT, PNG_MAX_INCHES = 4.0, 6.0, 400.0  # pt; 400 in at 150 dpi < matplotlib's 2**16 px


def _label_em(op) -> float:
    """Width of op's microbatch number in ems, with a gap to the next box's number."""
    return DIGIT_EM * len(str(op.microbatch)) + 0.45


def _units_per_box_em(sim: SimResult) -> float:
    """Largest (label width in ems) / (box length in time units) over the boxes: a picture
    needs this many length units per time unit and font unit for every number to fit."""
    return max((_label_em(op) / (end - start) for row in sim.timeline for op, start, end in row if end > start),
               default=0.0)


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
    """The picture as SVG text, `width` px wide or wider: as wide as the narrowest box needs
    to hold its number at SVG_MIN_FONT (up to SVG_MAX_WIDTH)."""
    sim = simulate(schedule) if sim is None else sim
    pl = schedule.placement
    span = sim.makespan or 1.0
    needed = LEFT + RIGHT + span * SVG_MIN_FONT * _units_per_box_em(sim)
    width = int(min(max(width, needed + 1), max(width, SVG_MAX_WIDTH)))
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
            size = min(SVG_MAX_FONT, bw / _label_em(op))  # shrinks to fit, never left out
            if bw > 0:
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


def figure(schedule: Schedule, sim: Optional[SimResult] = None):
    """The picture as a matplotlib (figure, axes) (raises ImportError when it is not installed).
    The figure is at least 16 in wide, wider when the narrowest box needs it to hold its number
    at PNG_MIN_FONT; each number's font is the largest (up to PNG_MAX_FONT) that fits its box."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sim = simulate(schedule) if sim is None else sim
    pl = schedule.placement
    span = sim.makespan or 1.0
    axes_share = 0.85  # of the figure's width, after tight_layout (checked below)
    inches = span * PNG_MIN_FONT * _units_per_box_em(sim) / 72 / axes_share
    fig, ax = plt.subplots(figsize=(min(max(16.0, inches), PNG_MAX_INCHES), 0.45 * schedule.pp + 1.6))
    for r, row in enumerate(sim.timeline):
        by_colour: dict = {}  # one collection per colour and rank: far faster than a patch per op
        for op, start, end in row:
            by_colour.setdefault(shade(op.kind, pl.chunk_of(op.stage), pl.chunks), []).append((start, end - start))
        for colour, spans in by_colour.items():
            ax.broken_barh(spans, (r - 0.45, 0.9), facecolors=[c / 255 for c in colour], edgecolor="white",
                           linewidth=0.5)
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
    points_per_unit = ax.get_position().width * fig.get_figwidth() * 72 / span  # the axes' final width
    for r, row in enumerate(sim.timeline):
        for op, start, end in row:
            if end > start:
                size = min(PNG_MAX_FONT, (end - start) * points_per_unit / _label_em(op))
                ax.text((start + end) / 2, r, str(op.microbatch), ha="center", va="center", fontsize=size)
    return fig, ax


def png(schedule: Schedule, path: str, sim: Optional[SimResult] = None) -> None:
    """Write the matplotlib picture to `path`, PNG or PDF by its extension (raises ImportError
    when matplotlib is not installed)."""
    import matplotlib.pyplot as plt

    fig, _ = figure(schedule, sim)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write_picture(schedule: Schedule, path: str, sim: Optional[SimResult] = None) -> List[str]:
    """Write `path` as SVG, PNG or PDF by its extension, plus a PNG next to an SVG when
    matplotlib is importable.  Returns the files written."""
    sim = simulate(schedule) if sim is None else sim
    root, ext = os.path.splitext(path)
    if ext.lower() not in PICTURE_EXTENSIONS:
        raise ConfigError(f"{path}: unsupported picture extension {ext or '(none)'!r}; name a file ending in "
                          f"{' or '.join(PICTURE_EXTENSIONS)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if ext.lower() != ".svg":
        try:
            png(schedule, path, sim)
        except ImportError:
            raise ConfigError(f"{path}: {ext.lower()[1:].upper()} pictures need matplotlib; pip install matplotlib, "
                              "or name an .svg file") from None
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


TEXT_KIND = {F: "forward", B: "input-grad backward", W: "weight-grad backward", BW: "full backward"}


def _column_time(sim: SimResult, columns: int) -> float:
    """Time per text column.  When every op starts and ends on a common grid (equal or
    commensurate costs) a column is that grid divided by the largest whole zoom that fits
    `columns`, so no op is rounded; otherwise makespan / columns."""
    span = sim.makespan or 1.0
    times = [t for row in sim.timeline for _, start, end in row for t in (start, end)]
    shortest = min((end - start for row in sim.timeline for _, start, end in row if end > start), default=span)
    for k in range(1, 9):
        grid = shortest / k
        if all(abs(t / grid - round(t / grid)) < 1e-6 for t in times):
            zoom = min(int(columns // round(span / grid)), max(1, 5 // k))  # 5 columns hold "F12@3"
            return grid / zoom if zoom >= 1 else span / columns
    return span / columns


def text(schedule: Schedule, sim: Optional[SimResult] = None, columns: int = 120, legend: bool = True) -> str:
    """Terminal timeline, at most `columns` wide: each op as `F3@5` (kind, microbatch, @stage)
    from its first column, shortened to `F3` or to its kind when too narrow, '-' over the rest
    of its columns; '.' where the rank idles.  Without colours the stage is the only way to
    tell chunks apart, so it is kept when it fits.  `legend` adds lines explaining every
    character used."""
    sim = simulate(schedule) if sim is None else sim
    span = sim.makespan or 1.0
    per_col = _column_time(sim, columns)
    columns = int(round(span / per_col))
    lines = []
    for r, row in enumerate(sim.timeline):
        cells = ["."] * columns
        for op, start, end in row:
            a = int(round(start / per_col))
            b = max(a + 1, int(round(end / per_col)))
            width = b - a
            label = next((t for t in (str(op), f"{op.kind}{op.microbatch}", op.kind) if len(t) <= width), op.kind)
            body = label[:width].ljust(width, "-")
            cells[a : min(b, columns)] = list(body[: max(0, min(b, columns) - a)])
        lines.append(f"rank {r:>3} |{''.join(cells)}|")
    if legend:
        kinds = ", ".join(f"{k} {TEXT_KIND[k]}" for k in _kinds_present(schedule))
        lines.append(f"legend: {kinds}; F3@5 = microbatch 3 at stage 5 (F3 or F when the op is narrower);")
        exact = all(abs(t / per_col - round(t / per_col)) < 1e-6 for row in sim.timeline for _, a, b in row for t in (a, b))
        lines.append(f"        '-' the op goes on, '.' idle; one column = {per_col:.3g} time units"
                     + ("" if exact else " (op ends rounded to the nearest column)"))
    return "\n".join(lines)
