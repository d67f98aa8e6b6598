"""Import throughput and memory: `shardflow import` against pyarrow's own read of the same log.

    python bench/import_throughput.py [--lines 3e7] [--users 1.5e6] [--items 3e5] [--rounds 3]

Generates a seeded sasrec log (user-grouped, Zipf(1.2) items) in a scratch directory,
then alternates, round by round, two commands in fresh processes:
  - the reader: pyarrow's streaming CSV reader converting the file to int64 columns
    (block by block, its threads on), nothing else;
  - `shardflow import --format sasrec LOG DEST`: parse, re-index, write the zarr store;
and then, in a fresh process, the hash of every array of the store just written
against its manifest's digests (`Dataset.verify`: what every retraining run pays
before it trains on a store, shardflow/importing.py: verify_dataset).
Each command's peak resident memory is sampled every 10 ms over its whole process tree.
Prints every round, min / median / max of import ÷ reader and verify ÷ reader, and the load average.

Then appends a 1% part (new events of earlier and of new users) to the imported store
with `--append`, and imports the same part alone into an empty store: the append should
cost about what the part costs, not what the store holds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.csv as pacsv

READER = """
import sys, pyarrow as pa, pyarrow.csv as csv
reader = csv.open_csv(sys.argv[1], read_options=csv.ReadOptions(column_names=["user", "item"]),
    parse_options=csv.ParseOptions(delimiter=" ", quote_char=False),
    convert_options=csv.ConvertOptions(column_types={"user": pa.int64(), "item": pa.int64()}))
rows = sum(batch.num_rows for batch in reader)
"""
VERIFY = """
import sys
from storage.dataset import Dataset
Dataset.open(sys.argv[1], hashed=False).verify()
"""


def write_log(path: Path, users: np.ndarray, items: np.ndarray) -> None:
    table = pa.table({"user": users, "item": items})
    pacsv.write_csv(
        table, path, write_options=pacsv.WriteOptions(include_header=False, delimiter=" ", quoting_style="none")
    )


def make_logs(work: Path, lines: int, users: int, items: int, seed: int) -> tuple[Path, Path]:
    """The main log (user-grouped, users in order) and a 1% part that follows it in time."""
    rng = np.random.default_rng(seed)
    lengths = rng.multinomial(lines - users, np.full(users, 1 / users)) + 1
    user = np.repeat(np.arange(1, users + 1, dtype=np.int64), lengths)
    item = (rng.zipf(1.2, lines) % items) + 1
    log = work / "log.txt"
    write_log(log, user, item)
    extra = max(1, lines // 100)
    # Half the part's users come back, half are new; items may be new too.
    part_users = np.sort(np.concatenate([rng.integers(1, users + 1, extra // 2),
                                         rng.integers(users + 1, users + users // 100 + 2, extra - extra // 2)]))
    part_items = (rng.zipf(1.2, extra) % (items + items // 100)) + 1
    (work / "parts").mkdir()
    os.link(log, work / "parts" / "day-1.txt")
    write_log(work / "day-2.txt", part_users, part_items)
    return log, work / "day-2.txt"


def measure(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak resident MB over the process tree) of one command."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.01)
    seconds = time.perf_counter() - started
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode()}")
    return seconds, peak / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=float, default=3e7)
    p.add_argument("--users", type=float, default=1.5e6)
    p.add_argument("--items", type=float, default=3e5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="scratch directory (default: a temporary one, removed afterwards)")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="shardflow-bench-"))
    shardflow = str(Path(sys.executable).parent / "shardflow")
    try:
        t = time.perf_counter()
        log, part = make_logs(work, int(args.lines), int(args.users), int(args.items), args.seed)
        print(
            f"log: {int(args.lines):,} lines, {log.stat().st_size / 1e6:.0f} "
            f"MB, written in {time.perf_counter() - t:.1f} s"
        )
        print(f"{'round':>5} {'reader s':>9} {'import s':>9} {'ratio':>6} {'reader MB':>10} {'import MB':>10} "
              f"{'verify s':>9} {'ratio':>6}")
        ratios, peaks, verifies = [], [], []
        for r in range(args.rounds):
            read_s, read_mb = measure([sys.executable, "-c", READER, str(log)])
            dest = work / f"ds-{r}"
            import_s, import_mb = measure([shardflow, "import", "--format", "sasrec", str(log), str(dest)])
            ratios.append(import_s / read_s)
            peaks.append(import_mb)
            verify_s, _ = measure([sys.executable, "-c", VERIFY, str(dest)])
            verifies.append(verify_s / read_s)
            print(f"{r + 1:>5} {read_s:>9.2f} {import_s:>9.2f} {ratios[-1]:>6.2f} {read_mb:>10.0f} {import_mb:>10.0f} "
                  f"{verify_s:>9.2f} {verifies[-1]:>6.2f}")
            if r:
                subprocess.run(["rm", "-rf", str(dest)], check=True)
        print(f"import / reader: min {min(ratios):.2f}  median {statistics.median(ratios):.2f}  max {max(ratios):.2f};"
              f"  import peak {max(peaks):.0f} MB (process tree);  load average {os.getloadavg()[0]:.2f}")
        print(f"verify / reader: min {min(verifies):.2f}  median {statistics.median(verifies):.2f}  "
              f"max {max(verifies):.2f}")

        store = work / "store"
        measure([shardflow, "import", "--format", "sasrec", str(work / "parts"), str(store)])
        os.link(part, work / "parts" / "day-2.txt")
        print(f"\nappend of a {int(args.lines) // 100:,}-line part to the {int(args.lines):,}-event store, "
              "against importing that part alone:")
        print(f"{'round':>5} {'append s':>9} {'alone s':>8} {'append MB':>10} {'alone MB':>9}")
        for r in range(args.rounds):
            trial = work / f"store-{r}"
            subprocess.run(["cp", "-r", str(store), str(trial)], check=True)
            append_s, append_mb = measure(
                [shardflow, "import", "--format", "sasrec", "--append", str(work / "parts"), str(trial)]
            )
            alone_s, alone_mb = measure(
                [shardflow, "import", "--format", "sasrec", str(part), str(work / f"alone-{r}")]
            )
            print(f"{r + 1:>5} {append_s:>9.2f} {alone_s:>8.2f} {append_mb:>10.0f} {alone_mb:>9.0f}")
            subprocess.run(["rm", "-rf", str(trial), str(work / f"alone-{r}")], check=True)
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        if not args.workdir:
            subprocess.run(["rm", "-rf", str(work)], check=True)


if __name__ == "__main__":
    main()
