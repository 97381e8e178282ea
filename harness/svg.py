"""The report's picture as an SVG file that a browser opens: small multiples, one panel per figure,
each run's series overlaid in a colour of its own (or a panel's own series, named in its legend);
for a single run, a few steps' timelines below them, rank by rank.

The text picture (summary.py) fits a terminal; this one shows the same bins with axes, round tick
values and units, for a reader who wants to see a trend rather than read it. Standard library only:
the XML is written as text (xml.sax.saxutils escapes it), so the project needs no plotting package.
report.py decides what to draw; this file only draws numbers, as polylines that carry `data-run`
(or `data-series`) and `data-figure` attributes, and timeline bars that carry `data-step`,
`data-rank` and `data-kind` (a test, or a reader of the file, can find each).

    python -m harness.report out              # writes out/report.svg beside out/metrics.jsonl
    python -m harness.report out out-frozen   # writes out/compare.svg

Test: python -m pytest tests/test_report.py
"""
import math
from xml.sax.saxutils import escape, quoteattr

COLOURS = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9")  # Okabe-Ito: colour-blind safe
DASHES = ("none", "8 4", "3 3", "12 3 3 3")  # run A solid, the others dashed: where runs agree, all show
PANEL_W, PANEL_H, COLUMNS = 440, 250, 2
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 34, 42  # a panel's margins: tick labels, its title, the x axis's label
HEAD = 64  # the title and the legend above the panels
GRID, TEXT = "#dddddd", "#333333"
KINDS = {"plain": COLOURS[0], "spec": COLOURS[1], "train": COLOURS[2], "wait": "#bbbbbb"}  # timeline segments


def tag(name, attrs, text=None):
    """One XML element as text, its attribute values and its text escaped."""
    attrs = "".join(f" {k}={quoteattr(str(v))}" for k, v in attrs.items())
    return f"<{name}{attrs}/>" if text is None else f"<{name}{attrs}>{escape(str(text))}</{name}>"


def ticks(lo, hi, n=4, least=0.0):
    """Round values (a step of 1, 2 or 5 times a power of ten, at least `least`) from at or below lo
    to at or above hi, about n steps apart, and their labels with as many decimals as the step needs."""
    if hi <= lo:  # a flat series: a band around it, so that it draws mid-panel
        pad = abs(lo) / 10 or 1.0
        lo, hi = lo - pad, hi + pad
    mag = 10 ** math.floor(math.log10((hi - lo) / n))
    step = max(least, next(m * mag for m in (1, 2, 5, 10) if m * mag >= (hi - lo) / n))
    first = math.floor(lo / step + 1e-9) * step
    values = [first + i * step for i in range(math.ceil((hi - first) / step - 1e-9) + 1)]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return values, [f"{v:.{decimals}f}" for v in values]


def legend(x, y, entries, stroke=3):
    """A legend from (x, y): each (name, (colour, dashes)) as a short line in its style, then its name."""
    out = []
    for name, (colour, dashes) in entries:
        out += [tag("line", {"x1": x, "x2": x + 16, "y1": y - 4, "y2": y - 4, "stroke": colour,
                             "stroke-width": stroke, "stroke-dasharray": dashes}),
                tag("text", {"x": x + 20, "y": y, "fill": TEXT}, name)]
        x += legend_width([name])
    return out


def legend_width(names):
    return sum(30 + 7 * len(name) for name in names)  # about 7 px a character at 12 px


def style(i):
    """The i-th series' colour and dashes: run A (or a panel's first series) solid, the others dashed."""
    return COLOURS[i % len(COLOURS)], DASHES[i % len(DASHES)]


def panel(x0, y0, figure, title, series, x_range, own=False):
    """One figure's panel with its top left corner at (x0, y0). series: [(name, (colour, dashes),
    [(x, y), ...])], each a run's or (own) one of the panel's own series, named in its legend;
    x_range: every panel's (so their step axes line up)."""
    out = [tag("text", {"x": x0 + LEFT, "y": y0 + 20, "font-weight": "bold", "fill": TEXT}, title)]
    if own:
        out += legend(x0 + PANEL_W - RIGHT - legend_width([n for n, _, _ in series]), y0 + 20,
                      [(name, how) for name, how, _ in series])
    ys = [y for _, _, points in series for _, y in points]
    if not ys:
        return out + [tag("text", {"x": x0 + PANEL_W / 2, "y": y0 + PANEL_H / 2, "text-anchor": "middle",
                                   "fill": TEXT}, "no figure in any bin")]
    (xt, x_labels), (yt, y_labels) = ticks(*x_range, n=5, least=1), ticks(min(ys), max(ys))
    w, h = PANEL_W - LEFT - RIGHT, PANEL_H - TOP - BOTTOM
    sx = lambda x: x0 + LEFT + w * (x - xt[0]) / (xt[-1] - xt[0])  # noqa: E731
    sy = lambda y: y0 + TOP + h * (yt[-1] - y) / (yt[-1] - yt[0])  # noqa: E731
    for v, label in zip(xt, x_labels):
        out += [tag("line", {"x1": sx(v), "x2": sx(v), "y1": y0 + TOP, "y2": y0 + TOP + h, "stroke": GRID}),
                tag("text", {"x": sx(v), "y": y0 + TOP + h + 16, "text-anchor": "middle", "fill": TEXT},
                    label)]
    for v, label in zip(yt, y_labels):
        out += [tag("line", {"x1": x0 + LEFT, "x2": x0 + LEFT + w, "y1": sy(v), "y2": sy(v), "stroke": GRID}),
                tag("text", {"x": x0 + LEFT - 6, "y": sy(v) + 4, "text-anchor": "end", "fill": TEXT}, label)]
    out += [tag("rect", {"x": x0 + LEFT, "y": y0 + TOP, "width": w, "height": h, "fill": "none",
                         "stroke": "#888"}),
            tag("text", {"x": x0 + LEFT + w / 2, "y": y0 + PANEL_H - 8, "text-anchor": "middle",
                         "fill": TEXT}, "RL step (middle of each bin)")]
    for name, (colour, dashes), points in series:
        out.append(tag("polyline", {"data-series" if own else "data-run": name, "data-figure": figure, "fill": "none",
                                    "stroke": colour, "stroke-width": 2, "stroke-dasharray": dashes,
                                    "stroke-linejoin": "round",
                                    "points": " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)}))
        # a dot per bin: the bins stand out, and a series of one bin still shows
        out += [tag("circle", {"cx": f"{sx(x):.1f}", "cy": f"{sy(y):.1f}", "r": 3, "fill": colour})
                for x, y in points]
    return out


def small_multiples(title, names, panels, timeline=None):
    """The SVG document: the title, a legend naming each run in its colour, then the panels two to a
    row, then (timeline not None) a full-width panel of a few steps' timelines. panels: [(figure key,
    panel title, [[(x, y), ...] for each series], the series' names or None: the runs in names' order)]."""
    rows = math.ceil(len(panels) / COLUMNS)
    width, height = COLUMNS * PANEL_W, HEAD + (rows + (timeline is not None)) * PANEL_H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           tag("rect", {"width": width, "height": height, "fill": "white"}),
           tag("text", {"x": LEFT, "y": 24, "font-size": 15, "font-weight": "bold", "fill": TEXT}, title)]
    out += legend(LEFT, 44, [(name, style(i)) for i, name in enumerate(names)])
    xs = [x for _, _, series, _ in panels for points in series for x, _ in points]
    x_range = (min(xs, default=0), max(xs, default=1))
    for i, (figure, panel_title, series, own) in enumerate(panels):
        x0, y0 = (i % COLUMNS) * PANEL_W, HEAD + (i // COLUMNS) * PANEL_H
        styled = [(name, style(j), points) for j, (name, points) in enumerate(zip(own or names, series))]
        out += panel(x0, y0, figure, panel_title, styled, x_range, own=bool(own))
    if timeline is not None:
        out += timelines(HEAD + rows * PANEL_H, timeline)
    return "\n".join(out + ["</svg>"]) + "\n"


def timelines(y0, steps):
    """A full-width panel from height y0 of a few steps' timelines on one time axis, so that the steps
    compare: per step a row naming it, then a bar per rank of its [kind, start, end] segments in
    KINDS' colours. steps: [(step, [each rank's segments])]; none: the panel says so."""
    right = COLUMNS * PANEL_W - RIGHT
    out = [tag("text", {"x": LEFT, "y": y0 + 20, "font-weight": "bold", "fill": TEXT},
               "a few steps' timelines, rank by rank"),
           *legend(right - legend_width(KINDS), y0 + 20, [(k, (c, "none")) for k, c in KINDS.items()], stroke=8)]
    if not steps:
        return out + [tag("text", {"x": LEFT, "y": y0 + PANEL_H / 2, "fill": TEXT},
                          "no timeline in any record (--timeline-every 0, or records written before they held one)")]
    xt, labels = ticks(0.0, max(b for _, ranks in steps for segs in ranks for *_, b in segs) or 1.0, n=8)
    w, h = right - LEFT, PANEL_H - TOP - BOTTOM
    row = h / sum(len(ranks) + 1 for _, ranks in steps)  # a row per rank and one naming the step
    sx = lambda x: LEFT + w * x / xt[-1]  # noqa: E731
    for v, label in zip(xt, labels):
        out += [tag("line", {"x1": sx(v), "x2": sx(v), "y1": y0 + TOP, "y2": y0 + TOP + h, "stroke": GRID}),
                tag("text", {"x": sx(v), "y": y0 + TOP + h + 16, "text-anchor": "middle", "fill": TEXT}, label)]
    out.append(tag("text", {"x": LEFT + w / 2, "y": y0 + PANEL_H - 8, "text-anchor": "middle", "fill": TEXT},
                   "seconds from the step's start"))
    y = y0 + TOP
    for step, ranks in steps:
        out.append(tag("text", {"x": LEFT, "y": f"{y + row - 2:.1f}", "fill": TEXT, "font-weight": "bold"},
                       f"step {step}"))
        for rank, segments in enumerate(ranks):
            y += row
            out.append(tag("text", {"x": LEFT - 6, "y": f"{y + row - 2:.1f}", "text-anchor": "end", "fill": TEXT,
                                    "font-size": min(12, int(row))}, f"rank {rank}"))
            out += [tag("rect", {"data-step": step, "data-rank": rank, "data-kind": kind, "x": f"{sx(a):.1f}",
                                 "y": f"{y + 1:.1f}", "width": f"{max(sx(b) - sx(a), 0.5):.1f}",
                                 "height": f"{max(row - 2, 1):.1f}", "fill": KINDS[kind]})
                    for kind, a, b in segments]
        y += row
    return out
