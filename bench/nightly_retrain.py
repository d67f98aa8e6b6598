"""A nightly run with a small new part against a cold retrain on everything: wall time of `shardflow run`.

    python bench/nightly_retrain.py [--new-share 0.05] [--rounds 3] [--epochs 2]

Splits the bundled amazon-video log into two daily parts (each user's events cut in time
order: the first 1 - new_share of every sequence, then the rest) and makes, once, a
run_dir whose version 1 was trained on the first part. Then alternates, round by round:
  - nightly: a copy of that run_dir, given the directory with both parts: it appends the
    new part, profiles, keeps or re-makes the plan, warm-starts version 2 from version 1,
    trains the new part's window, downloads, evaluates both versions and promotes;
  - cold: an empty run_dir given both parts: import, profile, plan, train on everything.
Both are the whole `shardflow run` command with the README's configuration (the demo
topology, its epochs and batch), embedded Prefect server and local Dask cluster
included. Prints each round, min / median / max of nightly ÷ cold, the AUC each reached
on its own held-out items and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import shardflow  # noqa: F401  (imported before tests/ joins the path: tests/shardflow would shadow it)

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tests"))
from support import REAL, split_into_days  # noqa: E402  (the tests' splitter of the bundled log)

SHARDFLOW = str(Path(sys.executable).parent / "shardflow")


def run(run_dir: Path, parts: Path, epochs: int) -> tuple[float, dict]:
    """(wall seconds, the --json summary) of one `shardflow run`."""
    started = time.perf_counter()
    done = subprocess.run([SHARDFLOW, "run", "--json", "--set", f"run_dir={run_dir}", "--set", f"dataset={parts}",
                           "--set", f"epochs={epochs}"], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"shardflow run failed:\n{done.stderr[-3000:]}")
    return seconds, json.loads(done.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new-share", type=float, default=0.05, help="the new part's share of every user's events")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardflow-nightly-") as tmp:
        work = Path(tmp)
        days = split_into_days(REAL["sasrec"], work / "days", (1 - args.new_share, args.new_share), late_users=0.0)
        events = [sum(1 for _ in open(d)) for d in days]
        print(f"amazon-video split: {events[0]:,} events, then a new part of {events[1]:,} "
              f"({events[1] / sum(events):.1%}); epochs {args.epochs}")
        first, both = work / "first", work / "both"
        first.mkdir()
        both.mkdir()
        shutil.copy2(days[0], first / days[0].name)
        for d in days:
            shutil.copy2(d, both / d.name)
        seconds, _ = run(work / "night-1", first, args.epochs)
        print(f"setup: version 1 on the first part in {seconds:.1f} s (not timed below)")
        # The run_dir remembers its source's path: the nightly copy reads `first`, grown by the new part.
        ratios = []
        for r in range(args.rounds):
            night = work / f"nightly-{r}"
            shutil.copytree(work / "night-1", night, symlinks=True)
            (night / "run.lock").unlink(missing_ok=True)
            shutil.copy2(days[1], first / days[1].name)
            nightly_s, nightly = run(night, first, args.epochs)
            (first / days[1].name).unlink()
            cold_s, cold = run(work / f"cold-{r}", both, args.epochs)
            assert nightly["version"] == 2 and nightly["warm_start_from"] == 1 and cold["version"] == 1
            ratios.append(nightly_s / cold_s)
            print(
                f"round {r + 1}: nightly {nightly_s:6.1f} s (AUC {nightly['auc']:.4f}, "
                f"{'promoted' if nightly['promoted'] else 'not promoted'}, "
                f"{'re-planned' if nightly['replanned'] else 'plan kept'}) "
                f"  cold {cold_s:6.1f} s (AUC {cold['auc']:.4f})   "
                f"ratio {nightly_s / cold_s:.2f}"
            )
            shutil.rmtree(night)
            shutil.rmtree(work / f"cold-{r}")
        print(f"nightly ÷ cold wall time: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, "
              f"max {max(ratios):.2f};  load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
