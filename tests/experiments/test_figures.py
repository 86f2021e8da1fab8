"""Every figure, drawn from the reference set, from a user's first runs (the report fixtures: what
`make run` leaves) and from no records at all, at the notebook's dpi: every bar, line, mark and label
lies inside its axes (no range is fixed in advance), and no title, legend or tick label overlaps another."""
from __future__ import annotations

import functools
import itertools
import warnings
from pathlib import Path

import pytest
from matplotlib.collections import LineCollection, PathCollection
from matplotlib.patches import Rectangle

from experiments.records import load_records
from experiments.reports import figures

REPO = Path(__file__).resolve().parents[2]
RECORD_SETS = {"reference": REPO / "results" / "reference" / "runs",
               "first runs": Path(__file__).parent / "fixtures" / "records", "no records": None}
NOTEBOOK_DPI = 90  # notebooks/figures.ipynb's show()


def _inside(value: float, limits: tuple[float, float], slack: float = 1e-9) -> bool:
    lo, hi = sorted(limits)
    return lo - slack * max(1.0, abs(lo)) <= value <= hi + slack * max(1.0, abs(hi))


def _overlap(a, b, px: float = 1.0) -> bool:
    """Two window extents overlapping by more than `px` in both directions (touching is fine)."""
    return a.x0 < b.x1 - px and b.x0 < a.x1 - px and a.y0 < b.y1 - px and b.y0 < a.y1 - px


def _outside_values(ax) -> list[str]:
    """Drawn data values outside the axes' limits: lines, bars (their value end), hlines, scatters."""
    xlim, ylim = ax.get_xlim(), ax.get_ylim()
    bad = []
    for line in ax.get_lines():
        transform = line.get_transform()
        check_x = transform in (ax.transData, ax.get_xaxis_transform())
        check_y = transform in (ax.transData, ax.get_yaxis_transform())
        for x, y in zip(line.get_xdata(), line.get_ydata()):
            if (check_x and not _inside(float(x), xlim)) or (check_y and not _inside(float(y), ylim)):
                bad.append(f"line {line.get_label()!r} at ({x:g}, {y:g})")
    for bar in (p for p in ax.patches if isinstance(p, Rectangle) and p.get_height()):
        end, centre = bar.get_y() + bar.get_height(), bar.get_x() + bar.get_width() / 2
        if not (_inside(end, ylim) and _inside(centre, xlim)):
            bad.append(f"bar at x {centre:g} ending at {end:g}")
    for collection in ax.collections:
        if isinstance(collection, LineCollection):
            points = [p for segment in collection.get_segments() for p in segment]
        elif isinstance(collection, PathCollection):
            points = list(collection.get_offsets())
        else:
            continue
        bad += [f"{type(collection).__name__} point ({x:g}, {y:g})" for x, y in points
                if not (_inside(float(x), xlim) and _inside(float(y), ylim))]
    return [f"{ax.get_title()!r}: {b} outside x {xlim}, y {ylim}" for b in bad]


def _tick_labels(axis, box) -> list:
    """The tick labels drawn on an axis (within the axes' span along it)."""
    renderer = axis.figure.canvas.get_renderer()
    horizontal = axis is axis.axes.xaxis
    drawn = []
    for label in axis.get_ticklabels(which="both"):
        if not (label.get_visible() and label.get_text()):
            continue
        extent = label.get_window_extent(renderer)
        centre = (extent.x0 + extent.x1) / 2 if horizontal else (extent.y0 + extent.y1) / 2
        span = (box.x0, box.x1) if horizontal else (box.y0, box.y1)
        if span[0] - 1 <= centre <= span[1] + 1:
            drawn.append((label.get_text(), extent))
    return drawn


def layout_problems(fig) -> list[str]:
    """What a reader would see clipped or overlapping in a drawn figure."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # constrained layout warns when it cannot fit the panels
        fig.set_dpi(NOTEBOOK_DPI)
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    problems, boxes = [], []
    if fig.get_suptitle():
        boxes.append(("suptitle", fig._suptitle.get_window_extent(renderer)))
    for ax in fig.axes:
        box = ax.get_window_extent(renderer)
        if ax.get_title():
            boxes.append((f"title {ax.get_title()!r}", ax.title.get_window_extent(renderer)))
        if ax.get_legend():
            boxes.append((f"legend of {ax.get_title()!r}", ax.get_legend().get_window_extent(renderer)))
        for text in ax.texts:
            extent = text.get_window_extent(renderer)
            if not (box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1 and box.y0 - 1 <= extent.y0
                    and extent.y1 <= box.y1 + 1):
                problems.append(f"{ax.get_title()!r}: text {text.get_text()!r} runs outside its axes")
        if not ax.axison:  # an empty panel: its title and its reason only
            continue
        problems += _outside_values(ax)
        for axis in (ax.xaxis, ax.yaxis):
            for (a, ea), (b, eb) in itertools.combinations(_tick_labels(axis, box), 2):
                if _overlap(ea, eb):
                    problems.append(f"{ax.get_title()!r}: tick labels {a!r} and {b!r} collide")
    for (a, ea), (b, eb) in itertools.combinations(boxes, 2):
        if _overlap(ea, eb):
            problems.append(f"{a} overlaps {b}")
    return problems


PREDICTED = {"fig2_predicted", "fig3_predicted", "fig4_predicted", "fig8_predicted"}  # the model's; records add marks


@functools.cache
def _records(label: str) -> list[dict]:
    return load_records(RECORD_SETS[label]) if RECORD_SETS[label] else []


@pytest.mark.parametrize("label,name", [(label, name) for label in RECORD_SETS for name in figures.FIGURES
                                        if not (label == "no records" and name in PREDICTED)])
def test_figure_shows_all_its_data_and_nothing_overlaps(label, name):
    fig = figures.FIGURES[name](_records(label))
    try:
        problems = layout_problems(fig)
    finally:
        figures.plt.close(fig)
    assert not problems, f"{name} from {label}:\n" + "\n".join(problems)


def test_the_checks_see_a_clipped_bar_and_colliding_ticks():
    """The checks above are only as good as what they catch: a bar over a fixed y range, a text
    past the axes, a suptitle drawn over a panel title, and crowded tick labels."""
    fig, ax = figures.plt.subplots(figsize=(3, 2))
    fig.suptitle("a figure title\nof two lines")
    ax.set_title("a panel title")
    ax.bar([0, 1], [20, 76])
    ax.set_ylim(0, 55)
    ax.annotate("label", (1, 54), xytext=(0, 30), textcoords="offset points")
    ax.set_xticks([0, 0.01], ["a long label", "another long label"])
    problems = layout_problems(fig)
    figures.plt.close(fig)
    assert any("bar at x 1 ending at 76" in p for p in problems)
    assert any("text 'label' runs outside" in p for p in problems)
    assert any("suptitle overlaps title 'a panel title'" in p for p in problems)
    assert any("tick labels 'a long label' and 'another long label' collide" in p for p in problems)
