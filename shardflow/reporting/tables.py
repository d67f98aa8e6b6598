"""The one number format of the run's table artifacts: text with thousands separators and a fixed number of
decimals per unit (the Prefect UI shows a table's numbers as given: 2k, 4880 and 5328.0 in one column before)."""

from __future__ import annotations


def number(value: float | None, decimals: int) -> str:
    """`value` with thousands separators and `decimals` decimals; "" for None (a figure not measured)."""
    return "" if value is None else f"{value:,.{decimals}f}"
