"""Training the bundled dataset: measured traffic against the cost model, and the `train` command."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardflow.data.synthetic import Repeats, SynthTable, synth_dataset
from shardflow.data.synthetic_clicks import synth_click_log
from shardflow.planner.costmodel import StepShape
from shardflow.planner.strategies import FlexShard
from shardflow.planner.topology import Node, Topology, load_topology
from shardflow.profiling.profiles import profile_dataset
from shardflow.sharding.stage import make_plan, plan_inputs, read_plan, store_plan
from shardflow.training.config import TrainConfig
from shardflow.training.run import in_process, prepare, train_job
from storage.importers import import_dataset
from support import REAL

pytestmark = pytest.mark.cluster  # the tier: commands that start a cluster

SHARDFLOW = str(Path(sys.executable).parent / "shardflow")
DEMO = Path(__file__).resolve().parents[2] / "topologies" / "demo-4.yaml"
# table-wise must fit the one 23,715-row table on one device: a budget 4× row-wise-mod's.
SLACK = {"table-wise": 3.0, "row-wise-mod": 0.1, "row-wise-block": 0.1, "flexshard": 0.1}
BATCH = 2048
UNEVEN = Topology((Node("a", 2, 12.5), Node("b", 1, 12.5), Node("c", 1, 2.5)), 600.0)


def plan_every_strategy(root, client) -> Path:
    profile_dataset(root / "ds", root / "profile", client=client)
    for strategy, slack in SLACK.items():
        make_plan(root / "profile", root / strategy, load_topology(DEMO), strategy=strategy,
                  shape=StepShape(BATCH, 32), memory_slack=slack)
    return root


@pytest.fixture(scope="module")
def planned(client, tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    import_dataset("sasrec", REAL["sasrec"], root / "ds")
    return plan_every_strategy(root, client)


@pytest.fixture(scope="module")
def sessions(client, tmp_path_factory):
    """Session data: 30% of events repeat one of the user's last 5 items, where independent draws over-count
    the distinct rows of a sub-batch by about 10% (docs/benchmarks.md)."""
    root = tmp_path_factory.mktemp("sessions")
    synth_dataset(root / "ds", [SynthTable("item", 20_000, 1.1)], interactions=300_000, seed=1, mean_length=30,
                  repeats=Repeats(0.3, 5))
    return plan_every_strategy(root, client)


@pytest.fixture(scope="module")
def clicks(client, tmp_path_factory):
    """A click log of 26 categorical tables (three of 20,000 values, ten of 1,000, thirteen of 50), hashed
    into 2^14 rows each: the DLRM reads one row of every table per example."""
    root = tmp_path_factory.mktemp("clicks")
    tables = [(20_000, 1.1)] * 3 + [(1_000, 0.8)] * 10 + [(50, 0.5)] * 13
    import_dataset("criteo", synth_click_log(root / "log.csv", 20_000, tables, seed=2), root / "ds", hash_rows=1 << 14)
    return plan_every_strategy(root, client)


@pytest.fixture(scope="module")
def uneven(planned):
    """Flexshard's tiered plan (its first candidate) of the bundled dataset on three nodes, the last one's
    uplink 5x slower: it copies hot rows onto the slow node and one other, not onto all three. (Flexshard
    itself picks the same placement without copies here: with the rounds priced one after another the
    copies' sync rounds cost what they save.)"""
    inputs = plan_inputs(planned / "profile", UNEVEN, StepShape(BATCH, 32), memory_slack=0.1)
    tiered = next(FlexShard().candidates(inputs.accesses, UNEVEN, inputs.budget_bytes, inputs.model))
    store_plan(planned / "flexshard-uneven", tiered, inputs)
    return planned / "flexshard-uneven"


def measured_and_predicted(dataset: Path, plan: Path, dedup: str, batch: int = BATCH,
                           devices: int = 4) -> tuple[float, float]:
    """Bytes per step over 6 steps of the in-process driver (the same devices and messages as on a cluster,
    in milliseconds per step), and the cost model's."""
    job = prepare(dataset, plan, TrainConfig(batch_size=batch, dedup=dedup), mlp=(16,))
    driver = in_process(job)
    for i in range(6):
        driver.step(0, i, i, 0)
    traffic = [d.traffic() for d in driver.devices]
    assert job.topology.devices == devices
    return sum(t.modeled_bytes for t in traffic) / 6, job.predicted_bytes_per_step


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
@pytest.mark.parametrize("strategy", sorted(SLACK))
@pytest.mark.parametrize("data", ["planned", "sessions", "clicks"])
def test_measured_bytes_agree_with_the_cost_model_within_5_percent(request, data, strategy, dedup):
    planned = request.getfixturevalue(data)
    measured, predicted = measured_and_predicted(planned / "ds", planned / strategy, dedup)
    assert measured > 0 and measured == pytest.approx(predicted, rel=0.05)


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
def test_rows_copied_onto_some_nodes_move_the_bytes_the_model_says(planned, uneven, dedup):
    item = read_plan(uneven).plan.table("item")
    slow = 1 << 2
    assert item.partial_ids.size > 50 and (item.partial_nodes & slow).all(), "the slow node holds every such row"
    measured, predicted = measured_and_predicted(planned / "ds", uneven, dedup)
    assert measured > 0 and measured == pytest.approx(predicted, rel=0.05)


@pytest.mark.parametrize("seed", range(8))
def test_measured_bytes_agree_with_the_cost_model_on_a_random_topology(planned, seed):
    """A topology none of the fixed ones is (1-3 nodes of 1-3 devices, uplinks 1-25 GB/s, nodes linked at 50 or
    300), a strategy, scope, batch and memory slack drawn at random: a user's cluster is not the demo's."""
    rng = np.random.default_rng(seed)
    topology = Topology(tuple(Node(f"n{i}", int(d), float(rng.choice([1.0, 2.5, 12.5, 25.0])))
                              for i, d in enumerate(rng.integers(1, 4, rng.integers(1, 4)))),
                        float(rng.choice([50.0, 300.0])))
    strategy = str(rng.choice(sorted(SLACK)))
    dedup, batch = str(rng.choice(["none", "device", "node"])), int(rng.choice([512, 2048, 4096]))
    slack = float(topology.devices) if strategy == "table-wise" else float(rng.choice([0.1, 0.5, 2.0]))
    out = planned / f"random-{seed}"
    make_plan(planned / "profile", out, topology, strategy=strategy, shape=StepShape(batch, 32, dedup),
              memory_slack=slack)
    measured, predicted = measured_and_predicted(planned / "ds", out, dedup, batch, topology.devices)
    assert (measured > 0) == (topology.devices > 1) and measured == pytest.approx(predicted, rel=0.05), (
        [n.devices for n in topology.nodes], strategy, dedup, batch)


def test_the_cluster_moves_exactly_the_bytes_of_the_in_process_driver(client, planned):
    train = TrainConfig(batch_size=BATCH, dedup="device", max_steps=4, eval_users=200)
    job = prepare(planned / "ds", planned / "flexshard", train, mlp=(16,))
    s = train_job(client, job)
    driver = in_process(job)
    for i in range(4):
        driver.step(0, i, i, 0)
    local = {k: sum(d.traffic().sums()[k] for d in driver.devices) / 4 for k in ("lookup", "sync", "dense")}
    assert s.progress.steps == 4 and s.job.devices == 4
    # Early answers are off by default: no row is sent twice.
    assert {k: v for k, v in s.per_step.bytes_per_step.items() if k != "patch"} == local
    assert s.per_step.bytes_per_step["patch"] == 0


def test_train_command_prints_the_summary_keys(planned):
    """With --early-answers: 4 steps are two warm-up calls and one of 2 steps, whose second step is patched; the
    model is the self-attention encoder's with 2 heads, its rows under Adam; with --patience the validation split
    is scored after the one (cut short) epoch."""
    began = time.monotonic()
    done = subprocess.run(
        [SHARDFLOW, "train", str(planned / "ds"), "--plan", str(planned / "flexshard"), "--max-steps", "4",
         "--batch-size", "512", "--dedup", "none", "--eval-users", "300", "--early-answers", "--encoder",
         "self-attention", "--attention-heads", "2", "--dropout", "0.1", "--item-dropout", "0.3",
         "--patience", "3", "--row-optimizer", "adam", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    for key, kind in [("steps", int), ("examples", int), ("examples_per_s", float), ("measured_bytes_per_step", float),
                      ("predicted_bytes_per_step", float), ("auc", float), ("hr_at_10", float), ("loss", float)]:
        assert isinstance(s[key], kind), key
    assert (s["steps"], s["examples"], s["dedup"], s["eval_users"]) == (4, 4 * 512, "none", 300)
    assert (s["model"]["encoder"], s["model"]["heads"], s["model"]["dropout"], s["model"]["item_dropout"]) \
        == ("self-attention", 2, 0.1, 0.3)
    assert s["row_optimizer"] == "adam" and s["bytes_per_step"]["patch"] > 0
    assert (s["epochs_trained"], s["best_epoch"], s["patience"]) == (1, 1, 3) and len(s["epoch_validation"]) == 1
    assert s["epoch_validation"][0]["val_ndcg_at_10"] == s["val_ndcg_at_10"] and 0 < s["val_hr_at_10"] <= 1
    # and ranked among the whole catalog where the rows live (--full-ranking's default: exclude-seen)
    # (4 steps: the model is next to untrained, its ranks among the whole catalog near chance)
    assert s["epoch_validation"][0]["val_full_ndcg_at_10"] == s["val_full_ndcg_at_10"]
    assert isinstance(s["val_full_hr_at_20"], float) and 0 <= s["val_full_hr_at_10"] <= s["val_full_hr_at_20"] <= 1
    assert 0 <= s["auc"] <= 1 and 0 <= s["hr_at_10"] <= 1 and 0 < s["loss"] < 1
    # the steady steps (after 2 warm-up steps) on this host's CLOCK_MONOTONIC, inside the command's own run
    first, last = s["steady_monotonic_s"]
    assert s["steady_steps"] == 2 and began < first < last < time.monotonic()


@pytest.mark.parametrize("flags, line", [
    (["--row-lr", "0"], "optimizer row_lr = 0.0; accepted: a finite number > 0"),
    # refused by the flag itself, with the config key's bounds
    (["--dropout", "1"], "argument --dropout: '1': Input should be less than 1; see 'shardflow train --help'"),
    (["--seed", str(2**64)], f"argument --seed: '{2**64}': Input should be less than or equal to {2**63 - 1}"),
    (["--server-memory", "4096"], "--server-memory 4096 without --estimate; accepted: --server-memory with "
     "--estimate"),
    (["--batch-size", "3"], "batch size 3 < 4 trainers; accepted: batch size >= 4, one example per trainer"),
    (["--batch-size", "10000000"], "batch size 10000000 > 194210 training examples; accepted: at most 194210"),
])
def test_a_bad_value_is_refused_before_the_scheduler_is_asked(planned, flags, line):
    """The scheduler named here does not exist: a refusal of the value, not of the scheduler, is made before
    the command reaches for a cluster."""
    done = subprocess.run(
        [SHARDFLOW, "train", str(planned / "ds"), "--plan", str(planned / "flexshard"), "--scheduler",
         "tcp://127.0.0.1:9", *flags], capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"shardflow train: error: {line}"), done.stderr


def test_a_plan_of_another_dataset_is_refused_before_the_scheduler_is_asked(planned, tmp_path):
    import_dataset("s3rec", REAL["s3rec"], tmp_path / "other")
    done = subprocess.run(
        [SHARDFLOW, "train", str(tmp_path / "other"), "--plan", str(planned / "flexshard"), "--scheduler",
         "tcp://127.0.0.1:9", "--max-steps", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2
    assert "was made from a profile of dataset" in done.stderr and "accepted: a plan of this dataset" in done.stderr
