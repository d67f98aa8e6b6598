"""Multi-GPU on paper: expected examples/s of the bundled model on 8 GPUs over NVLink and on 2 nodes × 8 GPUs.

    python bench/multi_gpu_model.py [--nvlink-gbytes 450] [--nic-gbytes 50] [--round-us 20]
                                    [--node-round-us 40] [--batch-per-gpu 4096]

No GPU runs here: the table is the one real GPUs will be held to. Per step and GPU:
  compute  the forward and backward of --batch-per-gpu examples, as measured on one H200
           (docs/benchmarks.md, "on a GPU", 2026-12-04: 3.4 ms for the mean encoder's 4,096,
           9.3 ms for self-attention's), the same on every GPU (a sub-batch each);
  comm     the planner's cost model of the plan (shardflow.planner.costmodel) on a topology
           whose links are NCCL's: inside a node --nvlink-gbytes per GPU (450 GB/s: NVLink 4's
           900 GB/s both ways, the figure nccl-tests' all-reduce bus bandwidth reaches on
           8 × H100 SXM), between nodes a node's 8 NICs of --nic-gbytes each (400 Gbit/s =
           50 GB/s, a DGX H100's ConnectX-7 ports); every round of the step pays --round-us
           (a NCCL all-to-all's latency inside a node) or --node-round-us across nodes,
           and no byte more than its payload (no framing factor).
  step     compute + comm: the engine's rounds do not overlap its compute. Dense all-reduce:
           the MLP's 6,272 weights (25 KB), inside the rounds' latency.
Plans: row-wise-mod and FlexShard (10% memory slack) of the bundled amazon-video item table
(23,715 rows, dim 64, history 20, 4 negatives), made by the planner for each topology with the
global batch of every GPU's sub-batch; and of a catalog of --rows items whose accesses follow
Zipf(1.0) with the same lookups per example (the model's compute does not depend on the
catalog's size: a lookup is a row read). Assumes a device-resident transport (rows and gradients
stay on the GPU, as NCCL carries them); the engine of today serialises through the host and
reaches 0.70x one PyTorch process with the mean encoder on one H200 (the same page). TorchRec publishes no throughput
for this model; none is given beside it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from shardflow.model.configs import ModelConfig
from shardflow.planner.access import TableAccess, sequence_lookups
from shardflow.planner.costmodel import CostModel, StepShape, Wire
from shardflow.planner.memory import budget_bytes_per_device
from shardflow.planner.strategies import propose
from shardflow.planner.topology import Node, Topology
from storage.dataset import Dataset
from storage.importers import import_dataset

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "amazon-video" / "Video.txt"
COMPUTE_MS = {"mean": 3.4, "self-attention": 9.3}  # one H200, 4,096 examples, forward + backward (measured)
MEASURED_BATCH = 4096
GPUS_PER_NODE = 8


def topologies(nvlink: float, nic: float) -> dict[str, Topology]:
    return {
        "8 GPUs, NVLink": Topology((Node("a", GPUS_PER_NODE, nic * GPUS_PER_NODE),), nvlink),
        "2 nodes x 8 GPUs, 400 Gbit/s NICs": Topology(
            tuple(Node(n, GPUS_PER_NODE, nic * GPUS_PER_NODE) for n in "ab"), nvlink),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvlink-gbytes", type=float, default=450.0)
    p.add_argument("--nic-gbytes", type=float, default=50.0)
    p.add_argument("--round-us", type=float, default=20.0)
    p.add_argument("--node-round-us", type=float, default=40.0)
    p.add_argument("--batch-per-gpu", type=int, default=MEASURED_BATCH)
    p.add_argument("--rows", type=float, default=1e7, help="the Zipf catalog's items")
    args = p.parse_args()
    model = ModelConfig()
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-") as scratch:
        store = Path(scratch) / "amazon-video"
        import_dataset("sasrec", DATA, store)
        ds = Dataset.open(store)
        per_example, uniform_share = sequence_lookups(ds.offsets(), model.history, model.negatives)
        rows = ds.info.table("item").rows
        bundled = TableAccess.from_counts("item", np.bincount(ds.ids("item"), minlength=rows), per_example,
                                          uniform_share)
    n = int(args.rows)
    zipf = np.round(np.arange(1, n + 1, dtype=np.float64) ** -1.0 * 1e9 / np.log(n)).astype(np.int64)
    catalogs = {"amazon-video": [bundled],
                f"Zipf(1.0), {n:.0e} items": [TableAccess.from_counts("item", zipf, per_example, uniform_share)]}
    print(f"per GPU: {args.batch_per_gpu:,} examples a step; links {args.nvlink_gbytes:g} GB/s inside a node, "
          f"{args.nic_gbytes:g} GB/s a GPU's NIC; a round {args.round_us:g} us inside a node, "
          f"{args.node_round_us:g} us across nodes; compute measured on one H200 (2026-12-04)")
    print(f"{'catalog':<24} {'topology':<34} {'strategy':<13} {'MB/step':>8} {'comm ms':>8} "
          + " ".join(f"{e + ' ex/s':>22}" for e in COMPUTE_MS) + "  comm share (mean)")
    for (catalog, access), (name, topo) in ((c, t) for c in catalogs.items()
                                            for t in topologies(args.nvlink_gbytes, args.nic_gbytes).items()):
        shape = StepShape(args.batch_per_gpu * topo.devices, model.dim)
        round_s = (args.round_us if len(topo.nodes) == 1 else args.node_round_us) * 1e-6
        cost = CostModel(topo, shape, wire=Wire(bytes_factor=1.0, round_s=round_s))
        budget = budget_bytes_per_device(access, topo, model.dim, 0.1)
        for strategy in ("row-wise-mod", "flexshard"):
            plan = propose(strategy, access, topo, budget, cost)
            evaluated = cost.evaluate(plan, {a.name: a for a in access})
            comm = evaluated.comm_time_s_per_step
            mb = (evaluated.lookup_bytes_per_step + evaluated.sync_bytes_per_step) / 1e6
            rates = []
            for ms in COMPUTE_MS.values():
                compute = ms * 1e-3 * args.batch_per_gpu / MEASURED_BATCH
                rates.append(topo.devices * args.batch_per_gpu / (compute + comm))
            share = comm / (COMPUTE_MS["mean"] * 1e-3 * args.batch_per_gpu / MEASURED_BATCH + comm)
            print(f"{catalog:<24} {name:<34} {strategy:<13} {mb:>8.1f} {comm * 1e3:>8.3f} "
                  + " ".join(f"{r:>22,.0f}" for r in rates) + f"  {share:.1%}")
    one = {e: MEASURED_BATCH / (ms * 1e-3) for e, ms in COMPUTE_MS.items()}
    print("one H200's compute alone: " + ", ".join(f"{e} {r:,.0f} ex/s" for e, r in one.items())
          + " (x8 and x16: the ceiling of each row)")


if __name__ == "__main__":
    main()
