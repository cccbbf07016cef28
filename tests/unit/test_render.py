"""Timeline pictures: SVG always, PNG when matplotlib is there, text for terminals."""
import importlib.util
import sys
import xml.etree.ElementTree as ET

import pytest

from megatron_vshape.schedule import registry, render
from megatron_vshape.schedule.errors import ConfigError
from megatron_vshape.schedule.simulate import simulate

SVG = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize("name", registry.names())
def test_svg_has_one_box_per_op_coloured_by_kind_and_chunk(name, tmp_path):
    s = registry.build(name, 4, 8)
    files = render.write_picture(s, str(tmp_path / "t.svg"))
    root = ET.parse(files[0]).getroot()
    boxes = [r for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert len(boxes) == sum(len(ops) for ops in s.ranks)
    fills = {(b.find(SVG + "title").text.split("@")[0].rstrip("0123456789"), b.get("fill")) for b in boxes}
    kinds = {op.kind for _, op in s.ops()}
    assert {k for k, _ in fills} == kinds
    # one colour per (kind, chunk) present
    chunks = {(op.kind, s.placement.chunk_of(op.stage)) for _, op in s.ops()}
    assert len({f for _, f in fills}) == len(chunks)
    labels = [t.text for t in root.iter(SVG + "text")]
    assert any(name in (t or "") for t in labels)  # title
    assert "0" in labels and "7" in labels  # microbatch numbers inside boxes
    assert "rank 3" in labels


def test_box_positions_follow_the_simulator(tmp_path):
    s = registry.build("1f1b", 2, 2)
    sim = simulate(s)
    root = ET.fromstring(render.svg(s, sim, width=1000))
    boxes = {b.find(SVG + "title").text.split()[0]: b for b in root.iter(SVG + "rect") if b.find(SVG + "title") is not None}
    scale = (1000 - render.LEFT - render.RIGHT) / sim.makespan
    for row in sim.timeline:
        for op, start, end in row:
            b = boxes[str(op)]
            assert float(b.get("x")) == pytest.approx(render.LEFT + start * scale, abs=0.01)
            assert float(b.get("width")) == pytest.approx((end - start) * scale, abs=0.01)


def test_png_next_to_svg_when_matplotlib_is_installed(tmp_path):
    files = render.write_picture(registry.build("zb-h1", 4, 8), str(tmp_path / "sub" / "zb.svg"))
    assert (tmp_path / "sub" / "zb.svg").stat().st_size > 0
    if importlib.util.find_spec("matplotlib") is None:
        assert files == [str(tmp_path / "sub" / "zb.svg")]
        return
    png = tmp_path / "sub" / "zb.png"
    assert files == [str(tmp_path / "sub" / "zb.svg"), str(png)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_png_without_matplotlib_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail, as when it is absent
    s = registry.build("1f1b", 2, 2)
    with pytest.raises(ConfigError, match="need matplotlib.*svg"):
        render.write_picture(s, str(tmp_path / "t.png"))
    assert render.write_picture(s, str(tmp_path / "t.svg")) == [str(tmp_path / "t.svg")]


def test_text_timeline():
    s = registry.build("1f1b", 3, 4)
    lines = render.text(s, columns=60, legend=False).splitlines()
    assert len(lines) == 3 and all(len(l) == len(lines[0]) for l in lines)
    assert lines[0].startswith("rank   0 |F0") and lines[2].startswith("rank   2 |.")  # rank 2 waits for F0
    wide = render.text(registry.build("v-zb", 2, 2), columns=200)
    assert "F0@0" in wide and "F0@3" in wide  # the two chunks of microbatch 0 on rank 0, told apart by stage


def test_svg_labels_every_box_two_digit_numbers_included():
    s = registry.build("v-half", 8, 24)  # microbatches 10-23 once had no number in their boxes
    elements = list(ET.fromstring(render.svg(s)))
    pairs = [(e, elements[i + 1]) for i, e in enumerate(elements) if e.find(SVG + "title") is not None]
    assert len(pairs) == sum(len(ops) for ops in s.ranks)
    for box, label in pairs:  # each box is followed by its number, which fits inside it
        op = box.find(SVG + "title").text.split()[0]
        assert label.tag == SVG + "text" and label.text == op.split("@")[0].lstrip("BFW")
        size = float(label.get("font-size"))
        assert size >= render.SVG_MIN_FONT
        assert size * render.DIGIT_EM * len(label.text) < float(box.get("width"))


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
@pytest.mark.parametrize("name, pp, m", [("v-half", 8, 24)])  # two-digit labels in 0.5-unit boxes
def test_png_labels_fit_their_boxes(name, pp, m):
    import matplotlib.pyplot as plt

    s = registry.build(name, pp, m)
    fig, ax = render.figure(s)
    try:
        renderer = fig.canvas.get_renderer()
        fig.canvas.draw()
        boxes = [(start, end) for row in simulate(s).timeline for _, start, end in row if end > start]
        labels = ax.texts
        assert sorted(int(t.get_text()) for t in labels) == sorted(op.microbatch for _, op in s.ops())
        x = lambda t: ax.transData.transform((t, 0))[0]  # noqa: E731  data time -> pixels
        for (start, end), label in zip(boxes, labels):  # one label per box, drawn in the same order
            assert label.get_fontsize() >= render.PNG_MIN_FONT
            assert label.get_position()[0] == pytest.approx((start + end) / 2)
            assert label.get_window_extent(renderer).width <= x(end) - x(start)
    finally:
        plt.close(fig)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_pdf_is_a_real_pdf_and_other_extensions_are_refused(tmp_path):
    s = registry.build("v-half", 4, 8)
    assert render.write_picture(s, str(tmp_path / "t.pdf")) == [str(tmp_path / "t.pdf")]
    assert (tmp_path / "t.pdf").read_bytes()[:5] == b"%PDF-"
    with pytest.raises(ConfigError, match="unsupported picture extension '.jpg'"):
        render.write_picture(s, str(tmp_path / "t.jpg"))
    assert not (tmp_path / "t.jpg").exists()


def test_text_legend_explains_every_character():
    for name, costs in (("v-min", None), ("v-half", "2,2.2,1.6,0.05"), ("1f1b", None)):
        from megatron_vshape.schedule.ops import Costs

        s = registry.build(name, 4, 8, Costs.parse(costs) if costs else None)
        out = render.text(s)
        rows = [l.split("|")[1] for l in out.splitlines() if l.startswith("rank")]
        legend = "\n".join(l for l in out.splitlines() if not l.startswith("rank"))
        used = set("".join(rows))
        assert " " not in used  # no unexplained blank
        kinds = {op.kind for _, op in s.ops()}
        for ch in used - set("0123456789@") - set("".join(kinds)):
            assert f"'{ch}'" in legend, ch
        for kind in kinds:
            assert f"{kind} " in legend
    equal = render.text(registry.build("v-min", 4, 8))
    assert "rounded" not in equal and "-" not in "".join(l.split("|")[1] for l in equal.splitlines() if l.startswith("rank"))


# ---- the frontier picture with a model shape: the even split against the balanced layout ----

def _frontier_pair(vocab):
    from megatron_vshape.planner import frontier
    from megatron_vshape.schedule.balance import ModelShape

    return frontier.balanced(ModelShape(8, 256, 128, vocab), 2, 4)


@pytest.fixture(scope="module")
def heavy_head():
    return _frontier_pair(8192)  # the output layer outweighs two layers: balancing moves layers off rank 0


def _series(root):
    """{legend label: (polyline, [circle])} of the picture's titled curve groups."""
    out = {}
    for g in root.iter(SVG + "g"):
        out[g.find(SVG + "title").text] = (g.find(SVG + "polyline"), g.findall(SVG + "circle"))
    return out


def test_frontier_picture_draws_both_series_labelled_in_the_legend(heavy_head, tmp_path):
    from megatron_vshape.planner import frontier

    even, balanced = heavy_head
    files = frontier.write(even, "t", str(tmp_path / "f.svg"), balanced)
    root = ET.parse(files[0]).getroot()
    series = _series(root)
    assert set(series) == {"v-auto, even split (budget on x)", "v-auto, balanced layout (budget on x)"}
    for label, points in (("even split", even), ("balanced layout", balanced)):
        line, dots = series[f"v-auto, {label} (budget on x)"]
        assert len(dots) == len(line.get("points").split()) == sum(p.schedule == "v-auto" for p in points)
    even_line, balanced_line = (series[f"v-auto, {k} (budget on x)"][0] for k in ("even split", "balanced layout"))
    assert even_line.get("stroke") != balanced_line.get("stroke")
    assert balanced_line.get("stroke-dasharray") and not even_line.get("stroke-dasharray")
    # the legend: each curve's label beside a line drawn as its curve is, and what hollow squares mean
    elements = list(root)
    texts = [e.text for e in elements if e.tag == SVG + "text"]
    for line in (even_line, balanced_line):
        label = next(k for k, (l, _) in series.items() if l is line)
        swatch = elements[[e.text for e in elements].index(label) - 1]
        assert swatch.tag == SVG + "line" and swatch.get("stroke") == line.get("stroke")
        assert swatch.get("stroke-dasharray") == line.get("stroke-dasharray")
    assert "filled: even split" in texts and "hollow: balanced layout (no budget)" in texts
    squares = [r for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    baselines = [p.schedule for p in even if p.schedule != "v-auto"]
    assert sorted(r.find(SVG + "title").text.split(",")[0] for r in squares) == sorted(baselines * 2)
    hollow = [r for r in squares if r.get("fill") == "white"]
    assert len(hollow) == len(baselines) and all("balanced layout (" in r.find(SVG + "title").text for r in hollow)


def test_frontier_picture_without_a_model_has_one_curve(tmp_path):
    from megatron_vshape.planner import frontier

    root = ET.fromstring(frontier.svg(frontier.frontier(3, 6), "t"))
    assert list(_series(root)) == ["v-auto (budget on x)"]
    assert not any((t.text or "").startswith(("filled", "hollow")) for t in root.iter(SVG + "text"))


@pytest.mark.parametrize("vocab", [2048, 8192])  # a head worth less than a layer, and worth two
def test_the_balanced_curve_is_never_above_the_even_one(vocab, heavy_head):
    # The balance search keeps the even split planned for its costs (the even curve's plan) unless a
    # layout simulates MIN_GAIN faster: so never above; each curve is the best at its budget or below.
    from megatron_vshape.schedule.balance import MIN_GAIN

    even, balanced = heavy_head if vocab == 8192 else _frontier_pair(vocab)
    pairs = [(e, b) for e in even for b in balanced if (e.schedule, e.memory_budget) == (b.schedule, b.memory_budget)]
    assert len(pairs) == len(even)  # every even point has its balanced one
    for e, b in pairs:
        assert b.makespan <= e.makespan + 1e-9, (e, b)
        assert b.vs_1f1b == pytest.approx(b.makespan / next(p.makespan for p in even if p.schedule == "1f1b"))
    if vocab == 8192:  # the picture shows a difference: faster at every budget, layers moved off rank 0
        assert all(b.makespan < e.makespan * (1 - MIN_GAIN) for e, b in pairs if e.schedule == "v-auto")
        assert all(b.layout[0] + b.layout[-1] < 4 for e, b in pairs if e.schedule == "v-auto")
