"""Small SVG charts for the run directory: lines (optionally log-log), stacked panels, grouped bars.

Plain SVG text, no plotting library: a browser or the Prefect UI's markdown shows them.
Every chart keeps its legend in a column of its own right of the plot (it never covers
data), labels both axes and puts several "nice" ticks on each (1, 2 or 5 times a power
of ten; decades on a log axis); quantities of different units get panels of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from pathlib import Path

W, LEFT, LEGEND, TOP, BOTTOM, PANEL_H, GAP = 760, 70, 190, 40, 50, 270, 30
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


@dataclass(frozen=True)
class _Axis:
    lo: float
    hi: float
    log: bool

    def fraction(self, v: float) -> float:
        lo, hi, v = (math.log10(self.lo), math.log10(self.hi), math.log10(v)) if self.log else (self.lo, self.hi, v)
        return (v - lo) / ((hi - lo) or 1.0)

    def ticks(self, count: int = 5) -> list[float]:
        if self.log:
            decades = [10.0**k for k in range(math.floor(math.log10(self.lo)), math.ceil(math.log10(self.hi)) + 1)]
            inside = [d for d in decades if self.lo <= d <= self.hi]
            return inside if len(inside) >= 2 else [self.lo, self.hi]
        raw = (self.hi - self.lo) / count or abs(self.hi) or 1.0
        power = 10.0 ** math.floor(math.log10(raw))
        step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
        first = math.ceil(self.lo / step - 1e-9) * step
        return [first + i * step for i in range(int((self.hi - first) / step + 1e-9) + 1)]


def _axis(values: list[float], log: bool, zero: bool = False) -> _Axis:
    values = [v for v in values if not log or v > 0]
    lo, hi = (0.0 if zero else min(values)), max(values) * (1.05 if zero else 1)  # bars: headroom
    if hi == lo:  # a single value: a small span around it
        lo, hi = (lo / 2, hi * 2) if log else (lo - (abs(lo) or 1) * 0.05, hi + (abs(hi) or 1) * 0.05)
    return _Axis(lo, hi, log)


def _label(v: float, log: bool) -> str:
    return f"1e{round(math.log10(v))}" if log and v >= 1e4 else f"{v:g}" if abs(v) < 1e4 else f"{v:.3g}"


class _Box:
    """One plot area: axes, ticks, labels, and data drawn into it."""

    def __init__(self, out: list[str], top: float, height: float, x: _Axis, y: _Axis, ylabel: str) -> None:
        self.out, self.top, self.height, self.x, self.y = out, top, height, x, y
        self.width = W - LEFT - LEGEND
        out.append(f'<rect x="{LEFT}" y="{top}" width="{self.width}" height="{height}" fill="none" stroke="#444"/>')
        for v in y.ticks():
            _, py = self.at(x.lo, v)
            out.append(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{LEFT + self.width}" y2="{py:.1f}" stroke="#e4e4e4"/>')
            out.append(f'<text x="{LEFT - 5}" y="{py + 4:.1f}" text-anchor="end">{_label(v, y.log)}</text>')
        mid = top + height / 2
        out.append(
            f'<text x="15" y="{mid}" text-anchor="middle" transform="rotate(-90 15 {mid})">{escape(ylabel)}</text>'
        )

    def at(self, x: float, y: float) -> tuple[float, float]:
        return LEFT + self.x.fraction(x) * self.width, self.top + self.height * (1 - self.y.fraction(y))

    def xticks(self, ticks: list[float] | None = None, labels: list[str] | None = None) -> None:
        ticks = self.x.ticks() if ticks is None else ticks
        for i, v in enumerate(ticks):
            px, _ = self.at(v, self.y.lo)
            text = labels[i] if labels else _label(v, self.x.log)
            self.out.append(f'<text x="{px:.1f}" y="{self.top + self.height + 15}" text-anchor="middle">{text}</text>')


def _legend(out: list[str], names: list[str], top: float, first_color: int = 0) -> None:
    x = W - LEGEND + 15
    for i, name in enumerate(names):
        y = top + 10 + 18 * i
        out.append(
            f'<rect x="{x}" y="{y - 9}" width="12" height="12" fill="{COLORS[(first_color + i) % len(COLORS)]}"/>'
        )
        out.append(f'<text x="{x + 18}" y="{y + 1}">{escape(name)}</text>')


def _open(height: float, title: str, xlabel: str) -> list[str]:
    plot_mid = LEFT + (W - LEFT - LEGEND) / 2
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" '
        f'height="{height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{height}" fill="white"/>',
        f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<text x="{plot_mid}" y="{height - 10}" text-anchor="middle">{escape(xlabel)}</text>',
    ]


def _write(path: str | Path, out: list[str]) -> Path:
    out.append("</svg>")
    Path(path).write_text("\n".join(out))
    return Path(path)


def _lines(box: _Box, series: dict[str, tuple[list[float], list[float]]], first_color: int = 0) -> None:
    for i, (_, (sx, sy)) in enumerate(series.items()):
        points = [box.at(x, y) for x, y in zip(sx, sy, strict=True)
                  if not (box.x.log or box.y.log) or (x > 0 and y > 0)]
        color = COLORS[(first_color + i) % len(COLORS)]
        box.out.append(f'<polyline points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in points)}" fill="none" '
                       f'stroke="{color}" stroke-width="2"/>')
        for a, b in points if len(points) < 30 else ():
            box.out.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>')


def line_chart(path: str | Path, series: dict[str, tuple[list[float], list[float]]], *, title: str, xlabel: str,
               ylabel: str, log: bool = False, marks: dict[str, float] | None = None) -> Path:
    """One line per series; `marks` draws labelled vertical lines (e.g. tier boundaries)."""
    x = _axis([v for sx, _ in series.values() for v in sx], log)
    y = _axis([v for _, sy in series.values() for v in sy], log)
    height = TOP + PANEL_H + BOTTOM
    out = _open(height, title, xlabel)
    box = _Box(out, TOP, PANEL_H, x, y, ylabel)
    box.xticks()
    _lines(box, series)
    _legend(out, list(series), TOP)
    shown = [(name, at) for name, at in (marks or {}).items() if x.lo <= at <= x.hi]
    for i, (name, at) in enumerate(shown):  # named in the legend column, never over the data
        px, _ = box.at(at, y.lo)
        out.append(f'<line x1="{px:.1f}" y1="{TOP}" x2="{px:.1f}" y2="{TOP + PANEL_H}" stroke="#888" '
                   'stroke-dasharray="4 3"/>')
        out.append(f'<text x="{W - LEGEND + 15}" y="{TOP + 11 + 18 * (len(series) + i)}" fill="#555">'
                   f'┆ {escape(name)}</text>')
    return _write(path, out)


def stacked_chart(path: str | Path, panels: list[tuple[str, dict[str, tuple[list[float], list[float]]]]], *, title: str,
                  xlabel: str, integer_x: bool = False) -> Path:
    """Panels over one x axis, one y axis (and quantity) each: (ylabel, series) per panel."""
    x = _axis([v for _, series in panels for sx, _ in series.values() for v in sx], False)
    panel_h = (PANEL_H - GAP * (len(panels) - 1)) / len(panels) + 40
    height = TOP + len(panels) * panel_h + (len(panels) - 1) * GAP + BOTTOM
    out = _open(height, title, xlabel)
    color = 0
    for p, (ylabel, series) in enumerate(panels):
        top = TOP + p * (panel_h + GAP)
        box = _Box(out, top, panel_h, x, _axis([v for _, sy in series.values() for v in sy], False), ylabel)
        if p == len(panels) - 1:
            ticks = [v for v in x.ticks() if not integer_x or float(v).is_integer()]
            box.xticks(ticks, [f"{v:g}" for v in ticks])
        _lines(box, series, color)
        _legend(out, list(series), top, color)
        color += len(series)
    return _write(path, out)


def bar_chart(path: str | Path, groups: dict[str, list[float]], *, title: str, xlabel: str, ylabel: str) -> Path:
    """Grouped bars: one group per x position (e.g. device), one bar per series (e.g. strategy)."""
    n = max(len(v) for v in groups.values())
    y = _axis([v for values in groups.values() for v in values], False, zero=True)
    height = TOP + PANEL_H + BOTTOM
    out = _open(height, title, xlabel)
    box = _Box(out, TOP, PANEL_H, _Axis(0, n, False), y, ylabel)
    slot = box.width / n
    bar = slot * 0.8 / len(groups)
    for i, values in enumerate(groups.values()):
        for d, v in enumerate(values):
            _, py = box.at(0, v)
            out.append(f'<rect x="{LEFT + d * slot + slot * 0.1 + i * bar:.1f}" y="{py:.1f}" width="{bar:.1f}" '
                       f'height="{TOP + PANEL_H - py:.1f}" fill="{COLORS[i % len(COLORS)]}"/>')
    box.xticks([d + 0.5 for d in range(n)], [str(d) for d in range(n)])
    _legend(out, list(groups), TOP)
    return _write(path, out)
