"""What the uplink monitor makes of a direction's byte-counter samples (shardflow.emulation.monitor.link_use), without
building a network: busy intervals, the rate over the inner ones, a window another process stamped, and each link read
at its own resolution."""

from __future__ import annotations

import pytest

from shardflow.emulation.monitor import MAX_PACKET_BYTES, link_use, resolution_s

RATE = 1e7  # bytes per second: resolution_s 13 ms, so every DT interval is read
DT = 0.025


def samples(moved: list[float], t0: float = 100.0, dt: float = DT) -> list[tuple[float, int]]:
    """Samples every `dt` seconds from t0, the counter growing by `moved[i]` over interval i."""
    out, counter = [(t0, 0)], 0
    for i, m in enumerate(moved):
        counter += round(m)
        out.append((t0 + (i + 1) * dt, counter))
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


def test_the_gaps_between_a_steps_rounds_are_idle_on_a_link_fast_enough_to_show_them():
    """Two rounds 10 ms apart on a link read every 5 ms: busy at its rate, the gap idle. Read every 25 ms, the
    intervals the gap falls in count as busy and pull the rate down."""
    fast = 2 * MAX_PACKET_BYTES / 0.0049  # resolution_s just under the 5-ms samples
    full = fast * 0.005
    moved = [0.0] * 2 + [full] * 8 + [0.0] * 2 + [full] * 8 + [0.0] * 2
    use = link_use(samples(moved, dt=0.005), fast)
    assert use.bytes == pytest.approx(16 * full, abs=16) and use.busy_s == pytest.approx(16 * 0.005)
    assert use.busy_bytes_per_s == pytest.approx(fast)
    coarse = link_use(samples(moved, dt=0.005), fast, interval_s=0.025)
    assert coarse.bytes == use.bytes and coarse.busy_bytes_per_s < 0.9 * fast


def test_a_slow_link_sampled_every_few_milliseconds_is_read_over_two_of_its_packets():
    """Whole packets every 66 ms (1 MB/s) sampled every 5 ms: most samples see none, so read at 5 ms the link
    would look idle; read over resolution_s (131 ms) it is busy at its rate."""
    slow = 1e6
    gap = MAX_PACKET_BYTES / slow
    moved = [MAX_PACKET_BYTES if int(i * 0.005 / gap) != int((i + 1) * 0.005 / gap) else 0 for i in range(600)]
    assert sum(m > 0 for m in moved) < 0.1 * len(moved)
    fine = link_use(samples(moved, dt=0.005), slow, interval_s=0.005)
    assert fine.inner_s < 0.1 * fine.busy_s
    use = link_use(samples(moved, dt=0.005), slow)
    assert resolution_s(slow) == pytest.approx(2 * gap)
    assert use.busy_s == pytest.approx(3.0, abs=2 * resolution_s(slow))
    assert 0.9 * slow < use.busy_bytes_per_s < 1.1 * slow
