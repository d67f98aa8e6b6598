"""Measured against modeled: each strategy's training step on an emulated cluster whose links really differ.

    python bench/emulated_cluster.py [--rounds 3] [--steps 16] [--time-scale auto|N]
        [--topologies 2x2-equal,2x2-one-5x-slower,4x2-one-slow] [--data bundled,zipf]
        [--strategies row-wise-mod,row-wise-block,table-wise,flexshard] [--dedups device,node]
        [--transport auto|actor|collective]

Needs root, `ip` and `tc` (shardflow.emulation); says so in one line otherwise. Ctrl-C or SIGTERM
stops it within seconds, its cluster's processes, namespaces and scratch folder removed. For each
topology it builds the emulated cluster once (one namespace per node, uplinks shaped both
ways to the topology's rate / --time-scale, loopback inside a node to the intra-node rate /
--time-scale) and, round after round, runs `shardflow train --scheduler` in its hub for
every dataset × dedup × strategy in turn (batch 4096, --steps steps, 200 held-out users, the mean
encoder: TRAIN_MODEL), its step messages carried by --transport (auto, a run's default, is
collective here: no TLS files, no early answers; collective: a gloo group over the namespaces'
addresses, shardflow.training.collective; actor: Dask actor calls).
With --time-scale auto (the default) each topology's factor is measured before its cluster is
built (shardflow.emulation.calibration: 500 times this host's reference step in one process
per device over the reference host's), so that a slower or busier host gets slower links.
Plans are made on this host with `shardflow plan` (memory slack 0.1); table-wise is left
out where it does not fit the budget.

Per cell, min/median/max over the rounds of:
  step      measured seconds per steady-state step (the global batch over the engine's examples/s);
  compute   the slowest device's forward and backward (median);
  comm      the part of it spent on the wire: the step minus the slowest device's batch
            building and compute (so it includes each round's serialisation and waits);
  model     the cost model's communication time per step (`shardflow plan`'s
            comm_time_s_per_step) times --time-scale;
  ratio     comm / model (median);
and, from the uplinks' own byte counters over the steady steps (from the first one's start to the
last one's end, as `shardflow train` stamps them; shardflow.emulation.monitor reads each link over
intervals of two of its largest packets), the fullest uplink's (most bytes for its rate, its fuller
direction) MB per step, the rate it carried them at while it was busy (inner intervals of its busy
runs) and the rate its bytes per step make over the step's comm time (below the busy rate where
the link waits while a round runs elsewhere), against its shaped rate. The last lines also give
the busy rate over the whole command (start-up and evaluation too), which the grids before
2026-11-28's evening reported, and over the steady steps read every 25 ms on every link, as the
grids before 2026-11-29 did.
The speed-up columns are row-wise-mod's over each strategy's, measured (step) and modeled, in
the same topology, data and dedup.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import nnls

from shardflow.emulation.calibration import parse_time_scale, resolve_time_scale
from shardflow.emulation.cluster import EmulatedCluster
from shardflow.emulation.monitor import UplinkMonitor
from shardflow.emulation.network import cannot_emulate, remove_on_stop_signals
from shardflow.errors import InputError
from shardflow.planner.topology import Node, Topology, uniform
from shardflow.training.engine import WARMUP_STEPS

HERE = Path(__file__).resolve().parent
BUNDLED = HERE.parent / "data" / "amazon-video" / "Video.txt"
SHARDFLOW = [sys.executable, "-m", "cli.main"]
TOPOLOGIES = {
    "2x2-equal": uniform(2, 2, 12.5),
    "2x2-one-5x-slower": Topology((Node("a", 2, 25.0), Node("b", 2, 5.0)), 600.0),
    "4x2-one-slow": Topology(tuple(Node(n, 2, 12.5) for n in "abc") + (Node("d", 2, 2.5),), 600.0),
}
BATCH = 4096
ZIPF_TABLE, ZIPF_INTERACTIONS, ZIPF_SEED = "item:100000:1.2", 300_000, 7  # --data zipf (train_throughput.py's too)
FIT_TOPOLOGIES = ("2x2-equal", "2x2-one-5x-slower")  # links even and uneven
FIT_BATCHES = (512, 2048, 8192)  # payloads 16x apart: separates the per-byte from the per-round cost
EVAL_USERS = 200
# The model the grid measures, pinned (the run's defaults are the self-attention recipe since 2026-12-05): the mean
# encoder under BCE, 20 items of history, 4 negatives, row-wise Adagrad, no validation split, a step mostly its
# messages. The self-attention defaults computed 1.2-1.3 s of a 2.0 s step on 2 x 2 equal at /669 (one round).
PLAN_MODEL = ("--history", "20", "--negatives", "4", "--row-optimizer", "adagrad")
TRAIN_MODEL = ("--encoder", "mean", "--loss", "bce", "--row-optimizer", "adagrad", "--patience", "0")
EARLIER_INTERVAL_S = 0.025  # the monitor's one interval for every link until 2026-11-29


def shardflow(*args: str) -> dict:
    done = subprocess.run([*SHARDFLOW, *args, "--json"], capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode != 0:
        raise RuntimeError(f"shardflow {' '.join(args)}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def datasets(scratch: Path, names: list[str]) -> dict[str, Path]:
    out = {}
    for name in names:
        store = scratch / name
        if name == "bundled":
            shardflow("import", "--format", "sasrec", str(BUNDLED), str(store))
        elif name == "zipf":
            shardflow("synth", str(store), "--tables", ZIPF_TABLE, "--interactions", str(ZIPF_INTERACTIONS),
                      "--seed", str(ZIPF_SEED))
        else:
            raise SystemExit(f"--data {name!r}; accepted: bundled, zipf")
        shardflow("profile", str(store), "--workers", "2")
        out[name] = store
    return out


def plans(scratch: Path, topo_name: str, topology: Topology, stores: dict, strategies: list, dedups: list,
          batches: tuple[int, ...] = (BATCH,)) -> dict:
    """(data, dedup, strategy, batch) -> (plan store, `shardflow plan`'s summary)."""
    path = scratch / f"{topo_name}.yaml"
    path.write_text(yaml.safe_dump(topology.to_dict()))
    out = {}
    for data, store in stores.items():
        for batch in batches:
            for dedup in dedups:
                for strategy in strategies:
                    dest = scratch / f"plan-{topo_name}-{data}-{dedup}-{strategy}-{batch}"
                    try:
                        summary = shardflow("plan", f"{store}.profile", "--topology", str(path), "--strategy",
                                            strategy, "--batch-size", str(batch), "--dedup", dedup, "--out",
                                            str(dest), *PLAN_MODEL)
                    except RuntimeError as e:
                        why = str(e).rpartition("error: ")[2].split(";")[0]
                        print(f"  {topo_name} {data} {dedup} {strategy}: no plan ({why})", flush=True)
                        continue
                    out[(data, dedup, strategy, batch)] = (dest, summary)
    return out


def shaped_uplinks(cluster: EmulatedCluster) -> dict[str, float]:
    """Node name -> its uplink's shaped rate, bytes per second."""
    return {node.name: node.uplink_bytes_per_s for node in cluster.network.nodes}


def run_rounds(cluster: EmulatedCluster, cells: dict, stores: dict, rounds: int, steps: int, label: str,
               transport: str = "auto") -> dict:
    """Every cell once per round, in the same order each round; per cell its measurements."""
    shaped = shaped_uplinks(cluster)
    runs: dict = {key: [] for key in cells}
    for r in range(rounds):
        started = time.monotonic()
        for key, (plan, _) in cells.items():
            runs[key].append(measure(*train(cluster, stores[key[0]], plan, steps, transport), shaped))
        print(f"  {label} round {r + 1}: {time.monotonic() - started:.0f} s, load {os.getloadavg()[0]:.1f}",
              flush=True)
    return runs


def train(cluster: EmulatedCluster, store: Path, plan: Path, steps: int,
          transport: str = "auto") -> tuple[dict, dict, dict, dict]:
    """`shardflow train`'s summary; the uplinks' use over its steady steps, over the whole command, and over the
    steady steps in EARLIER_INTERVAL_S intervals."""
    with UplinkMonitor(cluster.network) as watch:
        proc = cluster.command([*SHARDFLOW, "train", str(store), "--plan", str(plan), "--max-steps", str(steps),
                                "--eval-users", str(EVAL_USERS), "--json", "--scheduler", cluster.scheduler_address,
                                "--transport", transport, *TRAIN_MODEL],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent)
        out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"shardflow train --plan {plan.name}: {err.strip().splitlines()[-3:]}")
    summary = json.loads(out.strip().splitlines()[-1])
    steady = tuple(summary["steady_monotonic_s"])
    return summary, watch.use(steady), watch.use(), watch.use(steady, EARLIER_INTERVAL_S)


def measure(summary: dict, use: dict, whole: dict, earlier: dict, shaped: dict) -> dict:
    step_s = summary["batch_size"] / summary["examples_per_s"]
    parts = summary["seconds_per_step"]
    comm_s = max(step_s - parts["batch"] - parts["compute"], 0.0)
    # the fullest uplink: the most bytes for its rate, either way; then its fuller direction
    node, both = max(use.items(), key=lambda item: max(u.bytes for u in item[1]) / shaped[item[0]])
    side = max((0, 1), key=lambda i: both[i].bytes)
    per_step = both[side].bytes / summary["steady_steps"]
    return {"step_s": step_s, "comm_s": comm_s, "compute_s": parts["compute"], "link": node, "link_bytes": per_step,
            "link_busy_rate": both[side].busy_bytes_per_s, "whole_busy_rate": whole[node][side].busy_bytes_per_s,
            "earlier_busy_rate": earlier[node][side].busy_bytes_per_s,
            "link_comm_rate": per_step / comm_s if comm_s > 0 else float("nan")}


def spread(values: list[float]) -> str:
    v = sorted(values)
    return "/".join(f"{x:.2f}" for x in (v[0], statistics.median(v), v[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--time-scale", default="auto", help="auto (measured per topology) or a number >= 1")
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
    ap.add_argument("--data", default="bundled,zipf")
    ap.add_argument("--strategies", default="row-wise-mod,row-wise-block,table-wise,flexshard")
    ap.add_argument("--dedups", default="device,node")
    ap.add_argument("--transport", choices=["auto", "actor", "collective"], default="auto")
    ap.add_argument("--fit", action="store_true",
                    help=f"fit the cost model's wire (bytes factor, round cost) on {' and '.join(FIT_TOPOLOGIES)} "
                         "instead")
    args = ap.parse_args()
    reason = cannot_emulate()
    if reason:
        print(f"bench/emulated_cluster.py: {reason}", file=sys.stderr)
        return 2
    remove_on_stop_signals()  # the cluster closed and the scratch folder removed on Ctrl-C or SIGTERM
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"--steps {args.steps}; accepted: more than the engine's {WARMUP_STEPS} warm-up steps")
    topologies = {name: TOPOLOGIES[name] for name in args.topologies.split(",")}
    strategies, dedups = args.strategies.split(","), args.dedups.split(",")
    try:
        args.time_scale = parse_time_scale(args.time_scale)
    except InputError as e:
        raise SystemExit(f"--time-scale {e}") from None
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; time scale {args.time_scale};"
          f" {args.steps} steps of {BATCH}; {args.rounds} rounds", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-emulated-") as tmp:
        scratch = Path(tmp)
        stores = datasets(scratch, args.data.split(","))
        if args.fit:  # both fit topologies have 4 devices: one factor for both
            args.time_scale = time_scale(args.time_scale, TOPOLOGIES[FIT_TOPOLOGIES[0]])
            return fit(scratch, stores, args)
        for topo_name, topology in topologies.items():
            cells = plans(scratch, topo_name, topology, stores, strategies, dedups)
            scale = time_scale(args.time_scale, topology)
            with EmulatedCluster(topology, scale, scratch / f"logs-{topo_name}") as cluster:
                shaped = shaped_uplinks(cluster)
                runs = run_rounds(cluster, cells, stores, args.rounds, args.steps, topo_name, args.transport)
            print_table(topo_name, topology, scale, cells, runs, shaped)
    return 0


def time_scale(chosen: float | str, topology: Topology) -> float:
    scale, said = resolve_time_scale(chosen, topology.devices)
    if said:
        print(f"  {said}; load {os.getloadavg()[0]:.1f}", flush=True)
    return scale


def fit(scratch: Path, stores: dict, args) -> int:
    """The wire's two constants, non-negative least squares over cells whose payload and rounds differ:
    measured comm = bytes_factor × Σ rounds' payload seconds × scale + round cost × rounds."""
    cells, runs = {}, {}
    for name in FIT_TOPOLOGIES:
        made = plans(scratch, name, TOPOLOGIES[name], stores, ["row-wise-mod", "flexshard"], ["device", "node"],
                     FIT_BATCHES)
        with EmulatedCluster(TOPOLOGIES[name], args.time_scale, scratch / f"logs-fit-{name}") as cluster:
            measured = run_rounds(cluster, made, stores, args.rounds, args.steps, f"fit on {name}")
        cells.update({(name, *k): v for k, v in made.items()})
        runs.update({(name, *k): v for k, v in measured.items()})
    keys = list(cells)
    payload = np.array([sum(cells[k][1]["round_payload_s_per_step"].values()) * args.time_scale for k in keys])
    rounds = np.array([len(cells[k][1]["round_payload_s_per_step"]) for k in keys], dtype=float)
    comm = np.array([statistics.median(m["comm_s"] for m in runs[k]) for k in keys])
    (factor, round_s), _ = nnls(np.stack([payload, rounds], axis=1), comm)  # neither cost can be negative
    print(f"\nfit on {' and '.join(FIT_TOPOLOGIES)} / {args.time_scale:g}, {args.rounds} rounds of {args.steps} steps")
    print(f"{'topology':18} {'data':8} {'dedup':6} {'strategy':13} {'batch':>6} {'rounds':>6} {'payload s':>9}"
          f" {'comm s':>17} {'fitted s':>8} {'ratio':>6}")
    for k, p, r, c in zip(keys, payload, rounds, comm, strict=True):
        predicted = factor * p + round_s * r
        print(f"{k[0]:18} {k[1]:8} {k[2]:6} {k[3]:13} {k[4]:6} {r:6.0f} {p:9.3f}"
              f" {spread([m['comm_s'] for m in runs[k]]):>17} {predicted:8.3f} {c / predicted:6.2f}")
    in_topology_s = round_s / args.time_scale
    print(f"bytes_factor {factor:.3f}; round cost {round_s * 1e3:.1f} ms here = {in_topology_s * 1e6:.1f} µs in the"
          f" topology's time: Wire(bytes_factor={factor:.3f}, round_s={in_topology_s:.3g})")
    return 0


def print_table(topo_name: str, topology: Topology, scale: float, cells: dict, runs: dict, shaped: dict) -> None:
    nodes = ", ".join(f"{n.name} {n.devices}×{n.uplink_gbytes_per_s:g} GB/s" for n in topology.nodes)
    print(f"\n{topo_name} ({nodes}; emulated / {scale:g}) — min/median/max over rounds")
    print(f"{'data':8} {'dedup':6} {'strategy':15} {'step s':>17} {'compute s':>9} {'comm s':>17} {'model s':>8}"
          f" {'ratio':>6}"
          f" {'speed-up: step':>14} {'comm':>6} {'model':>6}"
          f"  fullest uplink: MB/step, Mbit/s while busy, over comm / shaped")
    step = {key: statistics.median(m["step_s"] for m in ms) for key, ms in runs.items()}
    comm = {key: statistics.median(m["comm_s"] for m in ms) for key, ms in runs.items()}
    model = {key: cells[key][1]["comm_time_s_per_step"] * scale for key in runs}
    for key, ms in runs.items():
        data, dedup, strategy, batch = key
        base = (data, dedup, "row-wise-mod", batch)
        ups = [f"{d[base] / d[key]:.2f}×" if base in d and d[key] > 0 else "-" for d in (step, comm, model)]
        link = ms[-1]["link"]
        print(f"{data:8} {dedup:6} {strategy:15} {spread([m['step_s'] for m in ms]):>17}"
              f" {statistics.median(m['compute_s'] for m in ms):9.3f} {spread([m['comm_s'] for m in ms]):>17}"
              f" {model[key]:8.2f} {comm[key] / model[key]:6.2f}"
              f" {ups[0]:>14} {ups[1]:>6} {ups[2]:>6}  {link}:"
              f" {statistics.median(m['link_bytes'] for m in ms) / 1e6:.2f},"
              f" {statistics.median(m['link_busy_rate'] for m in ms) * 8 / 1e6:.0f},"
              f" {statistics.median(m['link_comm_rate'] for m in ms) * 8 / 1e6:.0f} / {shaped[link] * 8 / 1e6:.0f}")
    ratios = [comm[key] / model[key] for key in runs]
    print(f"measured / modeled comm: {min(ratios):.2f}–{max(ratios):.2f}; "
          f"{sum(abs(r - 1) <= 0.2 for r in ratios)} of {len(ratios)} cells within ±20%")
    disagree = [f"{a[0]} {a[1]}: {a[2]} vs {b[2]}" for a in runs for b in runs
                if a[:2] == b[:2] and a[2] < b[2] and abs(model[a] - model[b]) > 0.1 * min(model[a], model[b])
                and (model[a] < model[b]) != (step[a] < step[b])]
    print(f"ranking by measured step time where the modeled times differ by over 10%: "
          f"{'as modeled' if not disagree else 'differs in ' + '; '.join(disagree)}")
    for over, key in (("the steady steps", "link_busy_rate"), ("the whole command", "whole_busy_rate"),
                      (f"the steady steps read every {EARLIER_INTERVAL_S * 1e3:.0f} ms", "earlier_busy_rate")):
        busy = [statistics.median(m[key] for m in ms) / shaped[ms[-1]["link"]] for ms in runs.values()]
        print(f"the fullest uplink while busy over {over}: {min(busy):.0%}–{max(busy):.0%} of its shaped rate; "
              f"{sum(b >= 0.8 for b in busy)} of {len(busy)} cells at 80% or more")

if __name__ == "__main__":
    sys.exit(main())
