"""Measured against modeled bytes per step, night after night: a chain of nightly versions on a real log.

    python bench/nightly_traffic.py [--splits 1 2 3] [--epochs 1]

Splits the bundled amazon-video log into five daily parts (60% then four of 10%; each
user's events cut in time order, a tenth of the users arriving only later; one split per
seed) and runs the retraining flow once a night on a growing parts directory: 2 devices,
2 devices, 3, 3, 2 (replan_margin 0.5, so a plan is kept unless the topology changed).
Every later night trains only its window (the new part, histories from before it). Prints,
per night, the plan's fate, the bytes per step the engine sent and those the cost model
predicted for the plan that trained, and their ratio; then min / median / max of the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOPOLOGIES = {
    2: "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 1, uplink_gbytes_per_s: 10}\n"
       "  - {name: b, devices: 1, uplink_gbytes_per_s: 5}\n",
    3: "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n"
       "  - {name: b, devices: 1, uplink_gbytes_per_s: 5}\n",
}
NIGHTS = (2, 2, 3, 3, 2)


def chain(root: Path, split: int, epochs: int, address: str) -> list[tuple]:
    from flows.retrain import retrain
    from shardflow.config import RetrainConfig

    sys.path.append(str(ROOT / "tests"))  # the tests' splitter of the bundled log (only here: Dask's spawned
    from support import REAL, split_into_days  # workers re-run this module's top, and tests/ holds a shardflow/)

    days = split_into_days(REAL["sasrec"], root / "days", (0.6, 0.1, 0.1, 0.1, 0.1), late_users=0.1, seed=split)
    for devices, text in TOPOLOGIES.items():
        (root / f"{devices}.yaml").write_text(text)
    (root / "parts").mkdir()
    rows = []
    for day, devices in zip(days, NIGHTS, strict=True):
        shutil.copy2(day, root / "parts")  # its day-old mtime: a finished part (part_settle_s)
        config = RetrainConfig.build({
            "dataset": str(root / "parts"), "run_dir": str(root / "run"), "topology": str(root / f"{devices}.yaml"),
            "scheduler_address": address, "epochs": epochs, "batch_size": 1024, "dim": 16, "eval_users": None,
            "replan_margin": 0.5})
        s = retrain(config)
        rows.append(
            (
                split,
                s["version"],
                devices,
                "kept" if not s["replanned"] else "made" if s["warm_start_from"] is None else "re-made",
                s["window"][0] + 1,
                s["bytes_per_step"] / 1e6,
                s["modeled_bytes_per_step"] / 1e6,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3], help="seeds of the day split")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    from shardflow.cluster import dask_client

    rows = []
    with prefect_test_harness(server_startup_timeout=600), dask_client(workers=3) as client:
        for split in args.splits:
            with tempfile.TemporaryDirectory() as tmp:
                rows += chain(Path(tmp), split, args.epochs, client.scheduler.address)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} (2 cores)")
    print(f"{'split':>5} {'night':>5} {'devices':>7} {'plan':>8} {'trains parts':>12} {'measured MB':>11} "
          f"{'modeled MB':>10} {'ratio':>6}")
    for split, night, devices, plan, first, measured, modeled in rows:
        print(f"{split:>5} {night:>5} {devices:>7} {plan:>8} {f'{first}..{night}':>12} {measured:>11.3f} "
              f"{modeled:>10.3f} {measured / modeled:>6.3f}")
    ratios = [m / p for *_, m, p in rows]
    print(f"measured / modeled over {len(ratios)} nights: min {min(ratios):.3f}, median "
          f"{statistics.median(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
