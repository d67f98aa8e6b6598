"""Sharding plans side by side: traffic and modeled communication time against row-wise-mod.

    python bench/plan_traffic.py [--rows 1e7] [--scale-rows 1e6 1e7 1e8] [--skip-scale]
    python bench/plan_traffic.py --uneven-only [--rows 1e6]
    python bench/plan_traffic.py --aggregation-only [--rows 1e6]
    python bench/plan_traffic.py --copies-only [--rows 1e6]
    python bench/plan_traffic.py --exact-only

Aggregation cells (--aggregation-only runs only these): scope node (a node fetches each row
once for all its devices) against row-wise-mod with per-device de-duplication, on the
paper's cell (8 × 8, 600 / 12.5 GB/s) and on 4 × 4 with one uplink 5× slower, 10% slack.

Copy cells (--copies-only runs only these): flexshard with and without rows copied onto
some nodes only, on 4 × 4 and 3 × 2 with one uplink 5× slower, 10% and 50% slack, every
scope, on the synthetic tables and on amazon-video.

Uneven cells (--uneven-only runs only these): 4 nodes × 4 devices, the last node's uplink
5× slower (2.5 GB/s against 12.5), the synthetic tables, 10% slack, both scopes.

Synthetic cells: one table of --rows rows with expected Zipf(α) counts (10^9 accesses, rows
in a seeded random order), α ∈ {0.8, 1.0, 1.2}; P = 8 (one node) and P = 64 (8 nodes × 8,
600 GB/s inside a node, 12.5 GB/s uplinks); memory slack ∈ {0, 10%, 25%}; de-duplication
scope none and device; global batch 65,536, dim 64, 32 lookups per example.
Real cells: the bundled amazon-video dataset (history 20, 4 negatives, batch 4,096).

Every figure of a strategy is relative to row-wise-mod in the same cell and scope:
bytes as a fraction of row-wise-mod's (sync bytes as a fraction of its lookup bytes, since
row-wise-mod has none), time as row-wise-mod's time over the strategy's (a speed-up);
`bound speed-up` is row-wise-mod's time over the lower bound; `gap closed` is
(mod - plan) / (mod - bound). A full table, then one summary line a cell.
Then planning time and peak memory of flexshard alone, one table, one process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from shardflow.errors import InputError
from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel, StepShape
from shardflow.planner.memory import budget_bytes_per_device
from shardflow.planner.report import bound_and_baseline, gap_closed
from shardflow.planner.strategies import FlexShard, propose
from shardflow.planner.topology import Node, Topology, uniform

STRATEGIES = ("row-wise-mod", "row-wise-block", "table-wise", "flexshard")
DIM = 64


def zipf_counts(rows: int, alpha: float, accesses: float = 1e9, seed: int = 0) -> np.ndarray:
    w = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    counts = np.round(w * (accesses / w.sum())).astype(np.int64)
    return np.random.default_rng(seed).permutation(counts)


def cell(accesses: list[TableAccess], topo, slack: float, dedup: str, batch: int) -> list[dict]:
    model = CostModel(topo, StepShape(batch, DIM, dedup))
    budget = budget_bytes_per_device(accesses, topo, DIM, slack)
    bound, mod = bound_and_baseline(accesses, topo, budget, model)
    by_name = {a.name: a for a in accesses}
    rows = []
    base = None
    for name in STRATEGIES:
        t = time.perf_counter()
        try:
            plan = propose(name, accesses, topo, budget, model)
        except InputError:
            rows.append({"strategy": name, "fits": False})
            continue
        seconds = time.perf_counter() - t
        c = model.evaluate(plan, by_name)
        figures = {
            "lookup": c.lookup_bytes_per_step,
            "sync": c.sync_bytes_per_step,
            "total": c.bytes_per_step,
            "inter": c.inter_node_bytes_per_step,
            "time": c.comm_time_s_per_step,
        }
        base = base or figures
        rows.append({"strategy": name, "fits": True, "seconds": seconds, **figures, "base": base,
                     "bound": bound, "gap": gap_closed(c.link_time_s_per_step, mod.link_time_s_per_step, bound),
                     "tiers": plan.tier_counts()})
    return rows


def ratio(x: float, base: float) -> str:
    return f"{x / base:.3f}" if base > 0 else ("0" if x == 0 else "inf")


def print_cells(title: str, cells: list[tuple[str, list[dict]]]) -> None:
    print(f"\n### {title}\n")
    print("| cell | strategy | lookup | sync | total | inter-node | speed-up | bound speed-up | gap closed | "
          "global / node rows |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, rows in cells:
        for r in rows:
            if not r["fits"]:
                print(f"| {label} | {r['strategy']} | does not fit the budget | | | | | | | |")
                continue
            b = r["base"]
            sync = ratio(r["sync"], b["lookup"])
            print(
                f"| {label} | {r['strategy']} | {ratio(r['lookup'], b['lookup'])} | {sync} | "
                f"{ratio(r['total'], b['total'])} | {ratio(r['inter'], b['inter']) if b['inter'] else '-'} | "
                f"{b['time'] / r['time']:.2f}× | {b['time'] / r['bound']:.2f}× | {r['gap']:.3f} | "
                f"{r['tiers']['global']:,} / {r['tiers']['node']:,} |"
            )


def print_summary(cells: list[tuple[str, list[dict]]]) -> None:
    """One line a cell: flexshard against row-wise-mod, and how row-wise-block and table-wise fared."""
    print("\n| cell | flexshard lookup | sync | inter-node | speed-up | bound speed-up | gap closed | "
          "global / node rows | row-wise-block speed-up | table-wise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, rows in cells:
        by = {r["strategy"]: r for r in rows}
        f, b, block, table = by["flexshard"], by["flexshard"]["base"], by["row-wise-block"], by["table-wise"]
        inter = ratio(f["inter"], b["inter"]) if b["inter"] else "-"
        table_cell = f"{b['time'] / table['time']:.2f}×" if table["fits"] else "does not fit"
        print(
            f"| {label} | {ratio(f['lookup'], b['lookup'])} | {ratio(f['sync'], b['lookup'])} | {inter} | "
            f"{b['time'] / f['time']:.2f}× | {b['time'] / f['bound']:.2f}× | {f['gap']:.3f} | "
            f"{f['tiers']['global']:,} / {f['tiers']['node']:,} | {b['time'] / block['time']:.2f}× | {table_cell} |"
        )


def synthetic(rows: int) -> None:
    cells = []
    for alpha in (0.8, 1.0, 1.2):
        access = TableAccess.from_counts("item", zipf_counts(rows, alpha), 32.0)
        for label, topo in (("P=8", uniform(1, 8, 12.5)), ("P=64", uniform(8, 8, 12.5))):
            for slack in (0.0, 0.1, 0.25):
                for dedup in ("none", "device"):
                    name = f"α={alpha} {label} slack={slack:.0%} {dedup}"
                    cells.append((name, cell([access], topo, slack, dedup, 65536)))
                    print(f"  done {name}", file=sys.stderr)
    print_cells(f"Synthetic Zipf, {rows:,} rows (bytes as a fraction of row-wise-mod's lookup bytes for sync)", cells)
    print_summary(cells)


def uneven(rows: int) -> None:
    slow = Topology(tuple(Node(f"n{i}", 4, 2.5 if i == 3 else 12.5) for i in range(4)), 600.0)
    cells = []
    for alpha in (0.8, 1.0, 1.2):
        access = TableAccess.from_counts("item", zipf_counts(rows, alpha), 32.0)
        for dedup in ("none", "device"):
            cells.append((f"α={alpha} 4×4 one uplink 5× slower, slack=10% {dedup}",
                          cell([access], slow, 0.1, dedup, 65536)))
    print_cells(f"Uneven links, synthetic Zipf, {rows:,} rows", cells)
    print_summary(cells)


def copies(rows: int) -> None:
    """Flexshard with and without the copy pass (a row copied onto some nodes only), on uneven uplinks."""
    print(f"\n### Rows copied onto some nodes only (speed-ups over row-wise-mod in the same scope; synthetic Zipf "
          f"of {rows:,} rows, and amazon-video)\n")
    print("| cell | slack | scope | flexshard, whole-node copies | flexshard | ratio | rows on some nodes |")
    print("|---|---|---|---|---|---|---|")
    topologies = (("4×4 one uplink 5× slower", Topology(tuple(Node(f"n{i}", 4, 2.5 if i == 3 else 12.5)
                                                                for i in range(4)), 600.0)),
                  ("3×2 one uplink 5× slower", Topology(tuple(Node(f"n{i}", 2, 2.5 if i == 2 else 12.5)
                                                                for i in range(3)), 600.0)))
    data = [(f"α={alpha}", [TableAccess.from_counts("item", zipf_counts(rows, alpha), 32.0)], 65536)
            for alpha in (0.8, 1.0, 1.2)]
    data.append(("amazon-video", video_accesses(), 4096))
    for name, accesses, batch in data:
        by_name = {a.name: a for a in accesses}
        for label, topo in topologies:
            for slack in (0.1, 0.5):
                budget = budget_bytes_per_device(accesses, topo, DIM, slack)
                for dedup in ("none", "device", "node"):
                    model = CostModel(topo, StepShape(batch, DIM, dedup))
                    mod = model.evaluate(propose("row-wise-mod", accesses, topo, budget, model), by_name)
                    whole = FlexShard(copies=False).plan(accesses, topo, budget, model)
                    plan = propose("flexshard", accesses, topo, budget, model)
                    t_whole, t = (model.evaluate(p, by_name).comm_time_s_per_step for p in (whole, plan))
                    some = sum(t.partial_ids.size for t in plan.tables)
                    print(f"| {name} {label} | {slack:.0%} | {dedup} | {mod.comm_time_s_per_step / t_whole:.3f}× | "
                          f"{mod.comm_time_s_per_step / t:.3f}× | {t_whole / t:.3f} | {some:,} |", flush=True)


def exact_gap() -> None:
    """Flexshard against the exact optimum (planner/exact.py) on the small cells of tests/shardflow/planner/
    test_exact.py, and the optimum with whole-node copies only (flexshard without the copy pass is within
    0.1% of it)."""
    from shardflow.planner.exact import exact_plan

    print("\n### Flexshard against the exact optimum, 24-row Zipf tables (16 lookups an example, batch 2,048, "
          "dim 16)\n")
    print("| topology | scope | slack | α | optimum (µs) | flexshard / optimum | whole-node copies / optimum | "
          "optimum's rows on some nodes |")
    print("|---|---|---|---|---|---|---|---|")
    topologies = (("2×2 even", uniform(2, 2, 12.5)),
                  ("3×2 one uplink 5× slower", Topology(tuple(Node(n, 2, 2.5 if n == "c" else 12.5) for n in "abc"),
                                                          600.0)),
                  ("4×2 one uplink 5× slower", Topology(tuple(Node(n, 2, 2.5 if n == "d" else 12.5) for n in "abcd"),
                                                          600.0)))
    ratios = []
    for label, topo in topologies:
        for dedup in ("none", "device", "node"):
            for slack in (0.1, 0.5):
                for alpha in (0.9, 1.2):
                    accesses = [TableAccess.from_counts("t", zipf_counts(24, alpha, accesses=1e7, seed=1), 16.0)]
                    model = CostModel(topo, StepShape(2048, 16, dedup))
                    budget = budget_bytes_per_device(accesses, topo, 16, slack)
                    plan, optimum = exact_plan(accesses, budget, model)
                    flex, whole = (model.evaluate(p.plan(accesses, topo, budget, model), {"t": accesses[0]})
                                   .comm_time_s_per_step for p in (FlexShard(), FlexShard(copies=False)))
                    ratios.append(flex / optimum)
                    print(f"| {label} | {dedup} | {slack:.0%} | {alpha} | {optimum * 1e6:.2f} | {flex / optimum:.3f} | "
                          f"{whole / optimum:.3f} | {plan.table('t').partial_ids.size} |", flush=True)
    print(f"\nflexshard / optimum: at most {max(ratios):.3f}; exact (within 0.01%) in "
          f"{sum(r <= 1.0001 for r in ratios)} of {len(ratios)} cells")


def video_accesses() -> list[TableAccess]:
    """The bundled amazon-video dataset's tables as the planner sees them (history 20, 4 negatives)."""
    from shardflow.cluster import dask_client
    from shardflow.profiling.profiles import profile_dataset
    from shardflow.sharding.stage import accesses_from_profile
    from storage.importers import import_dataset
    from storage.profile import Profile

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(__file__).resolve().parents[1] / "data" / "amazon-video" / "Video.txt"
        import_dataset("sasrec", data, Path(tmp) / "ds")
        with dask_client(workers=1) as client:
            profile_dataset(Path(tmp) / "ds", Path(tmp) / "profile", client=client)
        return accesses_from_profile(Profile.open(Path(tmp) / "profile"), 20, 4)


def aggregation(rows: int) -> None:
    print(f"\n### Node-level aggregation, synthetic Zipf, {rows:,} rows, 10% slack (speed-ups over row-wise-mod "
          "with scope device)\n")
    print("| cell | flexshard, device | row-wise-mod, node | flexshard, node | bound, node |")
    print("|---|---|---|---|---|")
    slow = Topology(tuple(Node(f"n{i}", 4, 2.5 if i == 3 else 12.5) for i in range(4)), 600.0)
    for label, topo in (("8×8", uniform(8, 8, 12.5)), ("4×4 one uplink 5× slower", slow)):
        for alpha in (0.8, 1.0, 1.2):
            access = TableAccess.from_counts("item", zipf_counts(rows, alpha), 32.0)
            budget = budget_bytes_per_device([access], topo, DIM, 0.1)
            times = {}
            for dedup in ("device", "node"):
                model = CostModel(topo, StepShape(65536, DIM, dedup))
                for name in ("row-wise-mod", "flexshard"):
                    plan = propose(name, [access], topo, budget, model)
                    times[name, dedup] = model.evaluate(plan, {"item": access}).comm_time_s_per_step
            bound, _ = bound_and_baseline([access], topo, budget, model)
            base = times["row-wise-mod", "device"]
            print(f"| α={alpha} {label} | {base / times['flexshard', 'device']:.2f}× | "
                  f"{base / times['row-wise-mod', 'node']:.2f}× | {base / times['flexshard', 'node']:.2f}× | "
                  f"{base / bound:.2f}× |", flush=True)


def real() -> None:
    accesses = video_accesses()
    cells = []
    for label, topo in (("P=8", uniform(1, 8, 12.5)), ("P=64", uniform(8, 8, 12.5))):
        for slack in (0.0, 0.1, 0.25):
            for dedup in ("none", "device"):
                cells.append(
                    (f"amazon-video {label} slack={slack:.0%} {dedup}", cell(accesses, topo, slack, dedup, 4096))
                )
    print_cells("Bundled amazon-video (23,715 items)", cells)
    print_summary(cells)


SCALE = """
import json, sys, time
import numpy as np
sys.path.insert(0, {root!r})
from bench.plan_traffic import zipf_counts
from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel, StepShape
from shardflow.planner.strategies import FlexShard, propose
from shardflow.planner.memory import budget_bytes_per_device
from shardflow.planner.topology import uniform
counts = zipf_counts({rows}, 1.2)
with open("/proc/self/clear_refs", "w") as f:  # peak memory from here on: planning, not generating
    f.write("5")
t = time.perf_counter()
access = TableAccess.from_counts("item", counts, 32.0)
del counts
topo = uniform(8, 8, 12.5)
model = CostModel(topo, StepShape(65536, 64, "none"))
plan = propose("flexshard", [access], topo, budget_bytes_per_device([access], topo, 64, 0.1), model)
seconds = time.perf_counter() - t
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({{"seconds": seconds, "peak_bytes": peak, "tiers": plan.tier_counts()}}))
"""


def scale(sizes: list[int]) -> None:
    print("\n### Planning time and peak memory (flexshard, α=1.2, P=64, 10% slack, scope none; one process;")
    print("from the profile's counts in memory to the chosen plan, its cost evaluated)\n")
    print("| rows | seconds | peak memory (GB) | global / node rows |")
    print("|---|---|---|---|")
    root = str(Path(__file__).resolve().parents[1])
    for rows in sizes:
        out = subprocess.run([sys.executable, "-c", SCALE.format(root=root, rows=rows)], capture_output=True, text=True,
                             env={"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        if out.returncode:
            print(f"| {rows:,} | failed: {out.stderr.strip().splitlines()[-1]} | | |")
            continue
        r = json.loads(out.stdout)
        print(f"| {rows:,} | {r['seconds']:.1f} | {r['peak_bytes'] / 1e9:.2f} | "
              f"{r['tiers']['global']:,} / {r['tiers']['node']:,} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=float, default=1e7)
    p.add_argument("--scale-rows", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    p.add_argument("--skip-scale", action="store_true")
    p.add_argument("--uneven-only", action="store_true")
    p.add_argument("--aggregation-only", action="store_true")
    p.add_argument("--copies-only", action="store_true")
    p.add_argument("--exact-only", action="store_true")
    args = p.parse_args()
    if args.uneven_only:
        return uneven(int(args.rows))
    if args.copies_only:
        return copies(int(args.rows))
    if args.exact_only:
        return exact_gap()
    if args.aggregation_only:
        return aggregation(int(args.rows))
    synthetic(int(args.rows))
    uneven(int(args.rows))
    aggregation(int(args.rows))
    real()
    if not args.skip_scale:
        scale([int(r) for r in args.scale_rows])


if __name__ == "__main__":
    main()
