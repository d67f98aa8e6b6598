"""Training throughput: the engine on 1 and 2 devices beside PyTorch and TorchRec peers.

    python bench/train_throughput.py [--rounds 3] [--steps 20] [--batch-size 4096]
                                     [--torchrec-python PYTHON] [--epoch-auc] [--encoder mean]
                                     [--device cpu|cuda] [--data bundled|zipf]

Imports data/amazon-video (--data bundled, the default) into a scratch directory, or
generates the emulated grid's Zipf log there (--data zipf: 100,000 items, alpha 1.2,
300,000 interactions in sequences of mean length 20, seed 7), plans it with FlexShard (10% memory
slack) for one node of 1 and of 2 devices, and measures, round after round in
alternation, on the same global batches (same example builder, order and negatives)
and the same model (dim 64, history 20, 4 negatives, row-wise Adagrad + Adam; --encoder mean: MLP
64-32 over the history's mean, or self-attention: SASRec's 2 blocks, 1 head, dropout 0.5; ModelConfig's
defaults):
  - engine:   the Dask engine, one worker process (one thread) per device; its figure is
              `shardflow train`'s steady-state examples/s (steps after the first 2), its step
              messages carried as a run carries them by default (transport auto: on 2 devices
              the devices' gloo group, shardflow.training.collective); on 2 devices also by Dask
              actor calls (transport actor), and by those with the next step's requests answered
              early (`early_answers`: rows sent while waiting, patched when the step begins), to
              show what each gains; with --device cuda also on 1 device with its batches built in turn
              (build_ahead off: the next batch is built on a thread of its own by default on a GPU);
  - pytorch:  shardflow's single-process reference trainer (PyTorch, whole tables,
              sparse embedding gradients) with 1 and with 2 threads, after 2 warm-up
              steps: no communication at all, the limit of this machine; and in 2 processes of one thread,
              data-parallel (bench/data_parallel_peer.py: one plain PyTorch process per device, as
              DistributedDataParallel; its parameters checked against the one process's; CPU only);
  - torchrec: TorchRec on 2 CPU ranks (bench/torchrec_peer.py, run by --torchrec-python,
              this interpreter by default), after 2 warm-up steps; skipped when torchrec
              is not importable there, and with --encoder self-attention (the peer is the mean model).
Every round runs each trainer once. The 1-minute load average is read before the first
round (a machine not quiet then, above half its cores, is reported: its figures are
worth less) and printed before every later one, where it includes the benchmark's own
previous round. The table gives min/median/max examples/s per trainer and of the ratios
the engine is judged by. With --epoch-auc the 2-device engine also trains one epoch
and reports leave-last-out AUC and HR@10. With --device cuda the engine computes on CUDA (one
worker per device, every worker on the machine's GPUs in turn) and the PyTorch peer holds its
tables and computes on the first GPU; its threads are then the host's, which build the examples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from data_parallel_peer import data_parallel_run, largest_difference  # this directory: one process per device
from emulated_cluster import ZIPF_INTERACTIONS, ZIPF_SEED, ZIPF_TABLE  # this directory: the grid's Zipf log

from shardflow.cluster import dask_client
from shardflow.data.batches import TrainData
from shardflow.data.synthetic import parse_synth_table, synth_dataset
from shardflow.errors import InputError
from shardflow.model.configs import ENCODERS, ModelConfig, OptimizerConfig
from shardflow.planner.access import TableAccess, sequence_lookups
from shardflow.planner.costmodel import CostModel, StepShape
from shardflow.planner.memory import budget_bytes_per_device
from shardflow.planner.strategies import propose
from shardflow.planner.topology import uniform
from shardflow.training.config import TrainConfig
from shardflow.training.device import DEVICES, torch_device
from shardflow.training.engine import Engine
from shardflow.training.reference import ReferenceTrainer
from storage.dataset import Dataset
from storage.importers import import_dataset

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "amazon-video" / "Video.txt"
MODEL = ModelConfig()
OPTIMIZER = OptimizerConfig()
WARMUP = 2


def plan_for(dataset: Path, devices: int, batch_size: int, model: ModelConfig = MODEL):
    """A FlexShard plan (10% memory slack) of the item table for one node of `devices` devices, and that node."""
    ds = Dataset.open(dataset)
    per_example, uniform_share = sequence_lookups(ds.offsets(), model.history, model.negatives)
    rows = ds.info.table("item").rows
    access = [TableAccess.from_counts("item", np.bincount(ds.ids("item"), minlength=rows), per_example, uniform_share)]
    topo = uniform(1, devices, 12.5)
    cost = CostModel(topo, StepShape(batch_size, model.dim))
    return propose("flexshard", access, topo, budget_bytes_per_device(access, topo, model.dim, 0.1), cost), topo


def pytorch_rate(data, model, batch_size: int, steps: int, threads: int, device: str = "cpu") -> float:
    """The PyTorch peer: shardflow's reference trainer of `model` with `threads` threads on `device`,
    examples/s after WARMUP steps."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref = ReferenceTrainer(data, model, OPTIMIZER, batch_size, seed=0, device=torch_device(device))
        per_epoch = data.steps_per_epoch(batch_size)  # the engine's epochs: (epoch, step in it) of step i
        for i in range(WARMUP):
            ref.step(*divmod(i, per_epoch))
        _synchronize(device)
        t = time.perf_counter()
        for i in range(WARMUP, WARMUP + steps):
            ref.step(*divmod(i, per_epoch))
        _synchronize(device)
        return steps * batch_size / (time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def torchrec_rate(python: str, dataset: Path, batch_size: int, steps: int) -> tuple[float | None, str]:
    done = subprocess.run([python, str(HERE / "torchrec_peer.py"), str(dataset), "--batch-size", str(batch_size),
                           "--steps", str(steps)], capture_output=True, text=True, timeout=900)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return None, f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    out = json.loads(lines[-1])
    return out.get("rate"), out.get("skipped", "")


def engine_rate(client, dataset: Path, plan, topo, batch_size: int, steps: int, model: ModelConfig = MODEL,
                early: bool = False, device: str = "cpu", transport: str = "auto",
                build_ahead: bool | None = None) -> dict:
    train = TrainConfig(batch_size=batch_size, max_steps=WARMUP + steps, eval_users=None, early_answers=early,
                        device=device, transport=transport, build_ahead=build_ahead)
    with Engine(client, str(dataset), plan, topo, model, OPTIMIZER, train) as engine:
        result = engine.fit()
        traffic = engine.traffic()
    return {"rate": result.examples_per_s, "timings": result.timings,
            "patch_share": float(traffic.patch.sum() / max(traffic.lookup.sum(), 1.0))}


def spread(values: list[float]) -> str:
    return f"{min(values):>9.2f} {float(np.median(values)):>7.2f} {max(values):>7.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--torchrec-python", default=sys.executable)
    parser.add_argument("--epoch-auc", action="store_true")
    parser.add_argument("--encoder", choices=ENCODERS, default="mean")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--data", choices=("bundled", "zipf"), default="bundled")
    args = parser.parse_args()
    try:
        torch_device(args.device)  # refused here, before any work, if no GPU is visible
    except InputError as e:
        sys.exit(f"train_throughput: {e}")
    cores = os.cpu_count() or 1
    model = replace(MODEL, encoder=args.encoder)
    B, n = args.batch_size, args.steps
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-") as scratch:
        if args.data == "zipf":
            dataset = Path(scratch) / "zipf"
            synth_dataset(dataset, [parse_synth_table(ZIPF_TABLE)], interactions=ZIPF_INTERACTIONS, seed=ZIPF_SEED)
        else:
            dataset = Path(scratch) / "amazon-video"
            import_dataset("sasrec", DATA, dataset)
        data = TrainData.load(dataset)
        plans = {d: plan_for(dataset, d, B, model) for d in (1, 2)}
        print(f"{dataset.name}: {data.targets:,} training examples, batch {B}, {n} steps after {WARMUP} warm-up, "
              f"{args.rounds} rounds, {cores} cores, torch {torch.__version__}, encoder {model.encoder}, "
              f"device {args.device}" + (f" ({torch.cuda.get_device_name(0)})" if args.device == "cuda" else ""))
        rates: dict[str, list[float]] = {}
        splits: dict[int | str, list[dict]] = {1: [], 2: []}
        loads = []
        patch_share = []  # bytes of patches over bytes of rows read, 2 devices
        skipped = ""
        idle = os.getloadavg()[0]
        print(f"load before the first round: {idle:.2f}"
              + (f"  (not quiet: above {cores / 2:.1f}; these figures are worth less)" if idle > cores / 2 else ""))
        gpus = args.device == "cuda"
        if not gpus:
            print(f"pytorch, 2 processes: its parameters after {WARMUP} steps differ from the reference "
                  f"trainer's by {largest_difference(dataset, model, OPTIMIZER, B, WARMUP):.1e} at most")
        with dask_client(workers=1) as one, dask_client(workers=2) as two:
            clients = {1: one, 2: two}
            for r in range(args.rounds):
                load = os.getloadavg()[0]
                loads.append(load)
                print(f"round {r + 1}: load {load:.2f}", flush=True)
                for devices in (1, 2):
                    e = engine_rate(clients[devices], dataset, *plans[devices], B, n, model, device=args.device)
                    rates.setdefault(f"engine, {devices} device(s)", []).append(e["rate"])
                    splits[devices].append(e["timings"])
                if gpus:  # a GPU device builds the next batch while the GPU computes (build_ahead): without it
                    e = engine_rate(clients[1], dataset, *plans[1], B, n, model, device=args.device,
                                    build_ahead=False)
                    rates.setdefault("engine, 1, built in turn", []).append(e["rate"])
                    splits.setdefault("1, built in turn", []).append(e["timings"])
                actor = engine_rate(clients[2], dataset, *plans[2], B, n, model, device=args.device,
                                    transport="actor")
                rates.setdefault("engine, 2, actor", []).append(actor["rate"])
                splits.setdefault("2, actor", []).append(actor["timings"])
                early = engine_rate(clients[2], dataset, *plans[2], B, n, model, early=True, device=args.device)
                rates.setdefault("engine, 2, early answers", []).append(early["rate"])
                patch_share.append(early["patch_share"])
                for threads in (1, 2):
                    rates.setdefault(f"pytorch, {threads} thread(s)", []).append(
                        pytorch_rate(data, model, B, n, threads, args.device)
                    )
                if not gpus:
                    rates.setdefault("pytorch, 2 processes", []).append(
                        data_parallel_run(dataset, model, OPTIMIZER, B, WARMUP, n)[0])
                if model.attention:
                    skipped = "the TorchRec peer trains the mean encoder's model only"
                if args.device == "cuda":
                    skipped = "the TorchRec peer runs on CPU ranks"
                if not skipped:
                    rate, skipped = torchrec_rate(args.torchrec_python, dataset, B, n)
                    if rate is not None:
                        rates.setdefault("torchrec, 2 ranks", []).append(rate)
            epoch = None
            if args.epoch_auc:
                full = TrainConfig(batch_size=B, eval_users=None, device=args.device)
                with Engine(two, str(dataset), *plans[2], model, OPTIMIZER, full) as engine:
                    fit = engine.fit()
                    held = engine.evaluate()
                    epoch = {
                        **held.values(),
                        "users": held.users,
                        "steps": fit.steps,
                        "seconds": fit.seconds,
                        "loss": fit.epoch_loss[-1],
                    }
        print(
            f"\nload average {idle:.2f} before, {min(loads):.2f}-{max(loads):.2f} at the rounds' starts, {cores} cores"
        )
        print(f"{'trainer':<24} {'examples/s: min':>15} {'median':>9} {'max':>9}")
        for name, v in rates.items():
            print(f"{name:<24} {min(v):>15,.0f} {float(np.median(v)):>9,.0f} {max(v):>9,.0f}")
        if skipped:
            print(f"torchrec, 2 ranks        skipped: {skipped}")
        print(f"\n{'ratio (per round)':<38} {'min':>9} {'median':>7} {'max':>7}")
        e1, e2 = rates["engine, 1 device(s)"], rates["engine, 2 device(s)"]
        p1, p2 = rates["pytorch, 1 thread(s)"], rates["pytorch, 2 thread(s)"]
        a2 = rates["engine, 2, actor"]
        ratios = {
            "engine 2 devices / pytorch 2 threads": [a / b for a, b in zip(e2, p2, strict=True)],
            "collective / actor, 2 devices": [a / b for a, b in zip(e2, a2, strict=True)],
            "engine 1 device / pytorch 1 thread": [a / b for a, b in zip(e1, p1, strict=True)],
            "engine 2 devices / engine 1 device": [a / b for a, b in zip(e2, e1, strict=True)],
            "early answers / actor, 2 devices": [a / b for a, b in zip(rates["engine, 2, early answers"], a2,
                                                                         strict=True)],
        }
        if "pytorch, 2 processes" in rates:
            dp = rates["pytorch, 2 processes"]
            ratios["engine 2 devices / pytorch 2 processes"] = [a / b for a, b in zip(e2, dp, strict=True)]
            ratios["pytorch 2 processes / 2 threads"] = [a / b for a, b in zip(dp, p2, strict=True)]
        if "engine, 1, built in turn" in rates:
            ratios["build ahead / in turn, 1 device"] = [a / b for a, b in zip(e1, rates["engine, 1, built in turn"],
                                                                                strict=True)]
        if "torchrec, 2 ranks" in rates:
            torchrec = rates["torchrec, 2 ranks"]
            ratios["engine 2 devices / torchrec 2 ranks"] = [a / b for a, b in zip(e2, torchrec, strict=True)]
        for name, v in ratios.items():
            print(f"{name:<38} {spread(v)}")
        print(f"early answers: patches sent {spread(patch_share).strip()} (min median max) of the bytes of rows read")
        for devices in splits:
            keys = list(splits[devices][0])
            mean = {k: float(np.median([s[k] for s in splits[devices]])) for k in keys}
            print(f"engine, {devices} device(s), ms per steady step (median of rounds): "
                  + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in mean.items()))
        if epoch:
            print(
                f"one epoch on 2 devices: {epoch['steps']} steps in "
                f"{epoch['seconds']:.1f} s, loss {epoch['loss']:.4f}, "
                f"AUC {epoch['auc']:.4f}, HR@10 {epoch['hr_at_10']:.4f}, NDCG@10 {epoch['ndcg_at_10']:.4f} "
                f"({epoch['users']:,} held-out users)"
            )


if __name__ == "__main__":
    main()
