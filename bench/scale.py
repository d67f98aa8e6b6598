"""How far one machine goes: grow the table and the log; per size, each stage's time and peak memory.

    python bench/scale.py --size 100000:1000000 --size 10000000:2000000 [--dim 64] [--epochs 1]
    python bench/scale.py --size 1000000:1000000000 --steps-per-epoch 300   # the whole flow, epochs cut short
    python bench/scale.py --size 1000000:1000000000 --steps 300     # the stages one by one through the CLI

Each --size is ROWS:EVENTS (a Zipf(1.1) item table of ROWS rows, a log of EVENTS events).
Per size: `shardflow synth`, then the whole flow (`shardflow run`, embedded Prefect API,
a LocalCluster of one worker per device on topologies/demo-4.yaml: 2 nodes x 2 devices).
The flow runs in a child process (as `shardflow run` does: the embedded API, a
LocalCluster); its stages are cut at the times its task runs finish, and a sampler
reads the resident memory (RSS, what Dask's memory limit compares) of every process of
its tree every 0.2 s. Printed per stage: seconds, the peak of the whole tree (the flow's
process, its API server, the workers) and of the largest worker; then the plan's memory
on the largest device (rows, Adagrad sums, versions) beside that worker's peak, and
what a process holds after importing what a worker imports (torch's CUDA build alone is
about 0.5 GB, counted in every worker's RSS), and the bound the engine checks against
each worker's memory limit before any shard starts (shardflow.planner.memory.worker_peak_bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from shardflow.data.batches import TrainData
from shardflow.model.configs import ModelConfig
from shardflow.planner.memory import WORKER_BYTES_PER_USER, WORKER_EXTRA_BYTES, WORKER_SCALE, worker_peak_bytes
from shardflow.sharding.stage import read_plan_summary
from storage.dataset import Dataset

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
MB = 1e6


class Sampler:
    """Peak resident memory of a process tree: all of it, and its largest worker process."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.root, self.every_s, self.samples = psutil.Process(pid), every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = worker = 0
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    cmd = " ".join(p.cmdline())
                    # a worker is spawned, or forked by the fork server (whose parent is the tree's root)
                    is_worker = "spawn_main" in cmd or ("forkserver" in cmd and p.ppid() != self.root.pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                total += rss
                worker = max(worker, rss if is_worker else 0)
            self.samples.append((time.time(), total, worker))
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self, start: float, stop: float) -> tuple[float, float]:
        # a stage shorter than a sample interval gets the samples on either side of it
        inside = [(t, w) for s, t, w in self.samples if start - self.every_s <= s <= stop + self.every_s] or [(0, 0)]
        return max(t for t, _ in inside) / MB, max(w for _, w in inside) / MB


def measured(cmd: list[str], env: dict, log: Path) -> tuple[int, Sampler, float, float]:
    start = time.time()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid)
        proc.wait()
    sampler.stop()
    return proc.returncode, sampler, start, time.time()


def imports_mb(env: dict) -> float:
    """Resident MB of a process that has imported what a worker imports (torch, the engine), nothing else."""
    code = ("import psutil, torch, shardflow.training.engine; "
            "print(psutil.Process().memory_info().rss / 1e6)")
    return float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.split()[-1])


def flow_child(config: str, out: str) -> None:
    """The flow in this process (embedded API, as `shardflow run` does), its task runs' end times recorded."""
    import logging

    from cli.embedded_api import embedded_api
    from flows.retrain import retrain
    from shardflow.config import RetrainConfig

    ended = []

    class Ends(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Finished in state"):
                ended.append((record.created, getattr(record, "task_run_name", "?"), record.getMessage()[18:]))

    logging.getLogger("prefect.task_runs").addHandler(Ends())
    result = {"ended": ended}
    try:
        with embedded_api():
            result["summary"] = retrain(RetrainConfig(**json.loads(config)))
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    Path(out).write_text(json.dumps(result, default=str))


def stages(ended: list, start: float, stop: float) -> list[tuple[str, float, float, str]]:
    """(task, began, ended, state): a task is cut from the end of the one before."""
    out, last = [], start
    for t, name, state in ended:
        out.append((name, last, t, state))
        last = t
    out.append(("(flow: gate, publish, close)", last, stop, ""))
    return out


def run_size(work: Path, rows: int, events: int, args, env: dict, imports: float) -> None:
    ds, run = work / f"ds-{rows}-{events}", work / f"run-{rows}-{events}"
    synth = [str(BIN / "shardflow"), "synth", str(ds), "--tables", f"item:{rows}:1.1", "--interactions", str(events),
             "--seed", "1", "--mean-length", "20", "--json"]
    code, sampler, t0, t1 = measured(synth, env, work / "synth.log")
    if code:
        sys.exit(f"synth failed: {(work / 'synth.log').read_text()[-2000:]}")
    tree, _ = sampler.peaks(t0, t1)
    users = Dataset.open(ds).info.users
    print(f"\n## item table {rows:,} rows x dim {args.dim}, log {events:,} events, {users:,} users")
    print(f"{'stage':<34} {'s':>8} {'tree MB':>9} {'worker MB':>10}")
    print(f"{'synth':<34} {t1 - t0:>8.1f} {tree:>9.0f} {'-':>10}")
    config = {"dataset": str(ds), "run_dir": str(run), "topology": str(ROOT / "topologies" / "demo-4.yaml"),
              "dim": args.dim, "encoder": args.encoder, "epochs": args.epochs, "batch_size": args.batch_size,
              "memory_slack": args.memory_slack, "eval_users": args.eval_users,
              "steps_per_epoch": args.steps_per_epoch}
    out = work / "flow.json"
    code, sampler, t0, t1 = measured([sys.executable, __file__, "--flow-child", json.dumps(config), str(out)], env,
                                     work / "flow.log")
    result = json.loads(out.read_text()) if out.exists() else {"ended": [], "error": f"exit {code}"}
    trained, lists = 0.0, 0.0  # the largest worker before the lists stage, and from it on
    for name, a, b, state in stages(result["ended"], t0, t1):
        tree, worker = sampler.peaks(a, b)
        print(f"{name:<34} {b - a:>8.1f} {tree:>9.0f} {worker:>10.0f} {'' if state.startswith('Completed') else state}")
        if name == "recommend" or lists:
            lists = max(lists, worker)
        else:
            trained = max(trained, worker)
    tree, worker = sampler.peaks(t0, t1)
    print(f"{'whole flow':<34} {t1 - t0:>8.1f} {tree:>9.0f} {worker:>10.0f}")
    if "summary" not in result:
        print(f"flow FAILED: {result.get('error')} (log: {work / 'flow.log'})")
    else:
        summary = result["summary"]
        plan = read_plan_summary(Path(summary["run_dir"]) / "versions" / "0001" / "plan")
        need = max(plan.memory_bytes_per_device) / MB
        held = TrainData.load(ds).held_bytes(plan.devices)
        step = ModelConfig(dim=args.dim, encoder=args.encoder).step_bytes(-(-args.batch_size // plan.devices))
        bound = worker_peak_bytes(need * MB, users, held, step) / MB
        print(f"plan: {need:,.0f} MB on the largest device; before the lists the largest worker peaked at "
              f"{trained:,.0f} MB = {trained / max(need, 1):.2f} x plan, {trained - need:,.0f} MB over it (a worker's "
              f"imports alone, torch's CUDA build included, take {imports:,.0f} MB); the bound the engine checks "
              f"before it starts ({WORKER_SCALE} x plan + {WORKER_EXTRA_BYTES / 1e9:.1f} GB + {WORKER_BYTES_PER_USER} "
              f"bytes x {users:,} users + {held / MB:,.0f} MB of examples held + {step / MB:,.0f} MB for a step) is "
              f"{bound:,.0f} MB: {'within' if trained <= bound else 'OVER'}; from the lists on (the shards closed) "
              f"{lists:,.0f} MB; AUC {summary['auc']:.4f}, {summary['epochs']} epoch(s); the item table whole is "
              f"{rows * args.dim * 4 / MB:,.0f} MB (float32)")
    shutil.rmtree(ds, ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)


def run_stages(work: Path, rows: int, events: int, args, env: dict) -> None:
    """The stages one at a time through the CLI (profile, plan, train for --steps steps): for a log whose
    epochs outlast the bench, the streaming path measured without training an epoch."""
    ds, sf = work / f"ds-{rows}-{events}", str(BIN / "shardflow")
    print(f"\n## item table {rows:,} rows x dim {args.dim}, log {events:,} events, {args.steps} training steps")
    print(f"{'stage':<34} {'s':>8} {'tree MB':>9} {'worker MB':>10}")
    commands = {
        "synth": [sf, "synth", str(ds), "--tables", f"item:{rows}:1.1", "--interactions", str(events), "--seed", "1",
                  "--mean-length", "20"],
        "profile": [sf, "profile", str(ds), "--workers", "4"],
        "plan": [sf, "plan", f"{ds}.profile", "--topology", str(ROOT / "topologies" / "demo-4.yaml"), "--strategy",
                 "flexshard", "--dim", str(args.dim), "--memory-slack", str(args.memory_slack), "--batch-size",
                 str(args.batch_size), "--out", str(work / "plan")],
        "train": [sf, "train", str(ds), "--plan", str(work / "plan"), "--max-steps", str(args.steps), "--batch-size",
                  str(args.batch_size), "--eval-users", str(args.eval_users), "--json"],
    }
    for name, cmd in commands.items():
        code, sampler, t0, t1 = measured(cmd, env, work / f"{name}.log")
        tree, worker = sampler.peaks(t0, t1)
        shown = f"{worker:>10.0f}" if name in ("profile", "train") else f"{'-':>10}"
        print(f"{name:<34} {t1 - t0:>8.1f} {tree:>9.0f} {shown}", flush=True)
        if code:
            sys.exit(f"{name} failed (exit {code}): {(work / f'{name}.log').read_text()[-2000:]}")
    out = json.loads([ln for ln in (work / "train.log").read_text().splitlines() if ln.startswith("{")][-1])
    targets = TrainData.load(ds).targets
    print(f"train: {out['examples_per_s']:,.0f} examples/s over the steady steps; an epoch of this log "
          f"({targets:,} targets) would take {targets / out['examples_per_s'] / 60:,.0f} min at that rate")
    shutil.rmtree(ds, ignore_errors=True)
    shutil.rmtree(f"{ds}.profile", ignore_errors=True)
    shutil.rmtree(work / "plan", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", action="append", default=[], help="ROWS:EVENTS (repeatable)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--encoder", choices=("mean", "self-attention"), default="mean",
                        help="the sequence encoder (self-attention scores the catalog as one matrix product, which "
                             "makes the night's top-K lists of 10^6 users x 10^6 items a matter of an hour)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--memory-slack", type=float, default=0.1)
    parser.add_argument("--eval-users", type=int, default=5000)
    parser.add_argument("--work", default=None, help="directory for the stores (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=None,
                        help="run the stages through the CLI and train only this many steps (for logs whose epochs "
                             "outlast the bench) instead of the whole flow")
    parser.add_argument(
        "--steps-per-epoch",
        type=int,
        default=None,
        help="the whole flow, each epoch cut to its first N steps (a log whose epoch outlasts the bench)",
    )
    parser.add_argument("--flow-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flow_child:
        return flow_child(*args.flow_child)
    sizes = []
    for s in args.size:
        rows, _, events = s.partition(":")
        sizes.append((int(float(rows)), int(float(events))))
    work = Path(args.work or tempfile.mkdtemp(prefix="shardflow-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "INFO"}
    mem = psutil.virtual_memory()
    print(f"# bench/scale.py: {os.cpu_count()} cores, {mem.total / 1e9:.1f} GB memory "
          f"({mem.available / 1e9:.1f} GB available), load {os.getloadavg()[0]:.2f}; stores in {work}")
    imports = imports_mb(env)
    for rows, events in sizes:
        if args.steps:
            run_stages(work, rows, events, args, env)
        else:
            run_size(work, rows, events, args, env, imports)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
