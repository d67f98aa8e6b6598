"""The refine pass's search prices only the moves and swaps that lower the busiest link: it must choose what
pricing every move and swap on every link chooses, step for step, ties included."""

from __future__ import annotations

import numpy as np
import pytest

from shardflow.planner import refine
from shardflow.planner.costmodel import CostModel, StepShape
from shardflow.planner.memory import budget_bytes_per_device
from shardflow.planner.strategies import propose
from shardflow.planner.topology import Node, Topology
from support import zipf_access


def every_move_and_swap_priced(vec: np.ndarray, home: np.ndarray, seconds: np.ndarray,
                               room: np.ndarray) -> np.ndarray:
    """The search written plainly: every move and every swap priced on every link, each step."""
    K = home.size
    own = vec[np.arange(K), home]
    S = min(refine.SWAP_ROWS, K)
    for _ in range(refine.REFINE_STEPS):
        now = seconds.max()
        moved = (seconds[None, None, :] + vec - own[:, None, :]).max(axis=2)
        moved[:, room <= 0] = np.inf
        moved[np.arange(K), home] = np.inf
        k, e = np.unravel_index(np.argmin(moved), moved.shape)
        best, kind = moved[k, e], ("move", int(k), int(e))
        at_other = vec[:S][:, home[:S], :]
        change = at_other - own[:S, None, :] + at_other.transpose(1, 0, 2) - own[None, :S, :]
        swapped = (seconds[None, None, :] + change).max(axis=2)
        swapped[home[:S, None] == home[None, :S]] = np.inf
        k2, j2 = np.unravel_index(np.argmin(swapped), swapped.shape)
        if swapped[k2, j2] < best:
            best, kind = swapped[k2, j2], ("swap", int(k2), int(j2))
        if best >= now * (1 - 1e-9):
            break
        if kind[0] == "move":
            _, k, e = kind
            seconds = seconds + vec[k, e] - own[k]
            room[home[k]] += 1
            room[e] -= 1
            home[k], own[k] = e, vec[k, e]
        else:
            _, k, j = kind
            seconds = seconds + vec[k, home[j]] - own[k] + vec[j, home[k]] - own[j]
            home[k], home[j] = home[j], home[k]
            own[k], own[j] = vec[k, home[k]], vec[j, home[j]]
    return seconds


@pytest.mark.parametrize("seed", range(40))
def test_the_search_chooses_what_pricing_every_move_and_swap_chooses(seed):
    rng = np.random.default_rng(seed)
    rows, devices, links = [(256, 4, 12), (100, 8, 20), (30, 3, 8), (2, 2, 6)][seed % 4]
    if seed % 2:  # small whole numbers: many ties, which both must break the same way
        vec = rng.integers(0, 4, (rows, devices, links)).astype(np.float64)
        seconds = rng.integers(0, 40, links).astype(np.float64)
    else:
        vec = rng.random((rows, devices, links)) * rng.random((rows, 1, 1)) ** 3
        seconds = rng.random(links) * rows / 10
    home = rng.integers(0, devices, rows)
    room = rng.integers(0, 3, devices) if seed % 3 else np.full(devices, rows)
    want_home, want_room = home.copy(), room.copy()
    want = every_move_and_swap_priced(vec, want_home, seconds.copy(), want_room)
    got = refine._moves_and_swaps(vec, home, seconds.copy(), room)
    assert np.array_equal(home, want_home) and np.array_equal(room, want_room)
    assert np.array_equal(got, want)
    assert got.max() <= seconds.max()


def flexshard(tables, topo, slack, dedup):
    accesses = [zipf_access(f"t{i}", rows, alpha, lookups=8.0, seed=i) for i, (rows, alpha) in enumerate(tables)]
    model = CostModel(topo, StepShape(512, 8, dedup))
    plan = propose("flexshard", accesses, topo, budget_bytes_per_device(accesses, topo, 8, slack), model)
    return [(t.tier.tobytes(), t.home.tobytes(), t.partial_ids.tobytes(), t.partial_nodes.tobytes())
            for t in plan.tables]


@pytest.mark.parametrize("case", range(6))
def test_flexshard_plans_are_those_of_a_search_that_prices_every_move_and_swap(case, monkeypatch):
    rng = np.random.default_rng(case)
    sizes = rng.integers(1, 5, rng.integers(2, 5))
    topo = Topology(tuple(Node(f"n{i}", int(s), float(rng.choice([1.0, 3.0, 12.5]))) for i, s in enumerate(sizes)),
                    600.0)
    tables = [(int(rng.integers(20, 400)), float(rng.uniform(0.6, 1.5))) for _ in range(rng.integers(1, 3))]
    slack, dedup = float(rng.choice([0.0, 0.1, 0.5, 2.0])), str(rng.choice(["none", "device", "node"]))
    got = flexshard(tables, topo, slack, dedup)
    monkeypatch.setattr(refine, "_moves_and_swaps", every_move_and_swap_priced)
    assert flexshard(tables, topo, slack, dedup) == got
