"""Small SVG charts for the run directory: lines (optionally log-log) and grouped bars.

Plain SVG text, no plotting library: a browser or the Prefect UI's markdown opens them.
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

W, H, LEFT, RIGHT, TOP, BOTTOM = 640, 360, 70, 20, 40, 50
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def _scale(lo: float, hi: float, log: bool):
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    span = (hi - lo) or 1.0
    return lambda v: ((math.log10(v) if log else v) - lo) / span


def _frame(title: str, xlabel: str, ylabel: str) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<text x="{W / 2}" y="{H - 10}" text-anchor="middle">{escape(xlabel)}</text>',
        f'<text x="15" y="{H / 2}" text-anchor="middle" transform="rotate(-90 15 {H / 2})">{escape(ylabel)}</text>',
        f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" fill="none" stroke="#444"/>',
    ]


def _xy(fx, fy, x: float, y: float) -> tuple[float, float]:
    return LEFT + fx(x) * (W - LEFT - RIGHT), H - BOTTOM - fy(y) * (H - TOP - BOTTOM)


def line_chart(path: str | Path, series: dict[str, tuple[list, list]], *, title: str, xlabel: str, ylabel: str,
               log: bool = False, marks: dict[str, float] | None = None) -> Path:
    """One line per series; `marks` draws labelled vertical lines (e.g. tier boundaries)."""
    xs = [x for sx, _ in series.values() for x in sx if not log or x > 0]
    ys = [y for _, sy in series.values() for y in sy if not log or y > 0]
    fx, fy = _scale(min(xs), max(xs), log), _scale(min(ys), max(ys), log)
    out = _frame(title, xlabel, ylabel)
    for label, v in (("min", min(ys)), ("max", max(ys))):
        _, y = _xy(fx, fy, min(xs), v)
        out.append(f'<text x="{LEFT - 5}" y="{y + 4}" text-anchor="end">{v:.3g}</text>')
    for v in (min(xs), max(xs)):
        x, _ = _xy(fx, fy, v, min(ys))
        out.append(f'<text x="{x}" y="{H - BOTTOM + 15}" text-anchor="middle">{v:.3g}</text>')
    for i, (name, (sx, sy)) in enumerate(series.items()):
        pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in (_xy(fx, fy, x, y) for x, y in zip(sx, sy)
                                                      if not log or (x > 0 and y > 0)))
        color = COLORS[i % len(COLORS)]
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{W - RIGHT - 5}" y="{TOP + 15 + 15 * i}" text-anchor="end" fill="{color}">{escape(name)}</text>')
    for name, at in (marks or {}).items():
        if min(xs) <= at <= max(xs):
            x, _ = _xy(fx, fy, at, min(ys))
            out.append(f'<line x1="{x}" y1="{TOP}" x2="{x}" y2="{H - BOTTOM}" stroke="#888" stroke-dasharray="4 3"/>')
            out.append(f'<text x="{x + 3}" y="{TOP + 12}" fill="#555">{escape(name)}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out))
    return Path(path)


def bar_chart(path: str | Path, groups: dict[str, list[float]], *, title: str, xlabel: str, ylabel: str) -> Path:
    """Grouped bars: one group per x position (e.g. device), one bar per series (e.g. strategy)."""
    n = max(len(v) for v in groups.values())
    top = max(max(v) for v in groups.values()) or 1.0
    out = _frame(title, xlabel, ylabel)
    slot = (W - LEFT - RIGHT) / n
    bar = slot * 0.8 / len(groups)
    for i, (name, values) in enumerate(groups.items()):
        color = COLORS[i % len(COLORS)]
        for d, v in enumerate(values):
            h = v / top * (H - TOP - BOTTOM)
            out.append(f'<rect x="{LEFT + d * slot + slot * 0.1 + i * bar:.1f}" y="{H - BOTTOM - h:.1f}" '
                       f'width="{bar:.1f}" height="{h:.1f}" fill="{color}"/>')
        out.append(f'<text x="{W - RIGHT - 5}" y="{TOP + 15 + 15 * i}" text-anchor="end" fill="{color}">{escape(name)}</text>')
    for d in range(n):
        out.append(f'<text x="{LEFT + (d + 0.5) * slot:.1f}" y="{H - BOTTOM + 15}" text-anchor="middle">{d}</text>')
    out.append(f'<text x="{LEFT - 5}" y="{TOP + 4}" text-anchor="end">{top:.3g}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out))
    return Path(path)
