"""The run's SVG charts as a person reads them: legends beside the data, several ticks, one axis per quantity."""

import math
import xml.etree.ElementTree as ET
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardflow.reporting.plots import LEFT, LEGEND, W, _Axis, bar_chart, line_chart, stacked_chart

SVG = "{http://www.w3.org/2000/svg}"


def texts(path):
    return [(float(t.get("x")), t.get("transform"), t.text) for t in ET.parse(path).iter(f"{SVG}text")]


def plot_right() -> float:
    return W - LEGEND


def test_the_legend_sits_beside_the_plot_and_axes_carry_several_ticks(tmp_path):
    counts = [10_000 / r**1.1 for r in range(1, 5001)]
    path = line_chart(
        tmp_path / "a.svg",
        {"item": (list(range(1, 5001)), counts), "genre": ([1, 10, 100], [900, 90, 9])},
        title="t",
        xlabel="row rank",
        ylabel="accesses",
        log=True,
        marks={"item: global | node": 40},
    )
    found = texts(path)
    legend = [x for x, _, text in found if text in ("item", "genre", "┆ item: global | node")]
    assert len(legend) == 3 and all(x > plot_right() for x in legend)
    y_ticks = [text for x, _, text in found if x == LEFT - 5]
    x_ticks = [text for x, _, text in found if LEFT <= x <= plot_right() and text not in ("t", "row rank")]
    assert len(y_ticks) >= 3 and len(x_ticks) >= 3
    assert {text for _, transform, text in found if transform} == {"accesses"}  # the y axis is labelled


def test_bars_start_at_zero_with_their_legend_outside(tmp_path):
    path = bar_chart(tmp_path / "b.svg", {"flexshard": [1.2, 0.8, 3.1, 2.0], "row-wise-mod": [2.5, 2.4, 2.6, 2.5]},
                     title="t", xlabel="device", ylabel="MB per step")
    found = texts(path)
    y_ticks = [float(text) for x, _, text in found if x == LEFT - 5]
    assert y_ticks[0] == 0 and len(y_ticks) >= 4 and max(y_ticks) <= 3.1
    assert all(x > plot_right() for x, _, text in found if text in ("flexshard", "row-wise-mod"))
    bars = [
        r for r in ET.parse(path).iter(f"{SVG}rect") if r.get("fill", "").startswith("#") and r.get("width") != "12"
    ]
    assert len(bars) == 8 and all(float(r.get("x")) + float(r.get("width")) <= plot_right() for r in bars)


def test_loss_and_auc_get_an_axis_each_over_whole_epochs(tmp_path):
    path = stacked_chart(tmp_path / "t.svg", [("training loss", {"loss": ([1, 2, 3], [0.55, 0.41, 0.38])}),
                                              ("held-out AUC", {"AUC": ([1, 2, 3], [0.78, 0.80, 0.81])})],
                         title="t", xlabel="epochs done", integer_x=True)
    found = texts(path)
    assert {text for _, transform, text in found if transform} == {"training loss", "held-out AUC"}
    bottom_ticks = [text for x, _, text in found if LEFT <= x <= plot_right() and text in ("1", "1.5", "2", "2.5", "3")]
    assert bottom_ticks == ["1", "2", "3"]


@given(st.floats(-1e6, 1e6), st.floats(1e-3, 1e6))
def test_linear_ticks_are_nice_and_inside_the_range(lo, span):
    axis = _Axis(lo, lo + span, False)
    ticks = axis.ticks()
    assert len(ticks) >= 2 and all(lo - 1e-9 * span <= t <= lo + span * (1 + 1e-9) for t in ticks)
    steps = [b - a for a, b in pairwise(ticks)]
    step = steps[0]
    assert all(x == pytest.approx(step, rel=1e-6) for x in steps)  # evenly spaced, up to float rounding
    mantissa = step / 10 ** math.floor(math.log10(step))  # a step of 10^k may measure as 9.99999... × 10^(k-1)
    assert any(mantissa == pytest.approx(m, rel=1e-6) for m in (1, 2, 5, 10))
