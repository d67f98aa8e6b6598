"""What the uplink monitor makes of a direction's byte-counter samples (shardflow.emulation.monitor.link_use), without
building a network: busy intervals, the rate over the inner ones, and a window another process stamped."""

from __future__ import annotations

import pytest

from shardflow.emulation.monitor import link_use

RATE = 1e6  # bytes per second
DT = 0.025


def samples(moved: list[float], t0: float = 100.0) -> list[tuple[float, int]]:
    """Samples every DT seconds from t0, the counter growing by `moved[i]` over interval i."""
    out, counter = [(t0, 0)], 0
    for i, m in enumerate(moved):
        counter += round(m)
        out.append((t0 + (i + 1) * DT, counter))
    return out


FULL, PACED, IDLE = RATE * DT, 0.3 * RATE * DT, 0.0


def test_a_run_at_the_shaped_rate_is_busy_at_it_and_idle_intervals_count_nothing():
    use = link_use(samples([IDLE, IDLE] + [FULL] * 6 + [IDLE, IDLE]), RATE)
    assert use.bytes == round(6 * FULL)
    assert use.busy_s == pytest.approx(6 * DT)
    assert use.inner_s == pytest.approx(4 * DT)  # the run's first and last interval are left out
    assert use.busy_bytes_per_s == pytest.approx(RATE)


def test_a_window_counts_only_its_part_and_a_cut_interval_by_its_share():
    moved = [FULL] * 6 + [PACED] * 6
    whole = link_use(samples(moved), RATE)
    assert 0.3 * RATE < whole.busy_bytes_per_s < RATE  # the paced part pulls the whole watch's rate down
    first = link_use(samples(moved), RATE, window=(100.0, 100.0 + 6 * DT))
    assert first.bytes == round(6 * FULL) and first.busy_bytes_per_s == pytest.approx(RATE)
    paced = link_use(samples(moved), RATE, window=(100.0 + 6 * DT, 200.0))
    assert paced.busy_bytes_per_s == pytest.approx(0.3 * RATE, rel=1e-3)
    half = link_use(samples(moved), RATE, window=(100.0 + 0.5 * DT, 100.0 + 2.5 * DT))  # half, whole, half
    assert half.bytes == round(2 * FULL) and half.busy_s == pytest.approx(2 * DT)


def test_a_window_outside_the_watch_counts_nothing():
    use = link_use(samples([FULL] * 4), RATE, window=(0.0, 50.0))
    assert (use.bytes, use.busy_s, use.inner_s) == (0, 0, 0)
