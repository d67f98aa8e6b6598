"""Planning the bundled dataset end to end: profile -> plan store, through the command and the library."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import zarr

from shardflow.data.examples import PAD, build_examples
from shardflow.errors import InputError
from shardflow.planner.access import sequence_lookups
from shardflow.planner.costmodel import StepShape
from shardflow.planner.topology import uniform
from shardflow.profiling.profiles import profile_dataset
from shardflow.sharding.stage import make_plan, read_plan, read_plan_summary
from storage.dataset import Dataset
from storage.importers import import_dataset
from support import REAL, snapshot

pytestmark = pytest.mark.cluster  # the tier: commands that start a cluster

SHARDFLOW = str(Path(sys.executable).parent / "shardflow")
TOPOLOGY = ("intra_node_gbytes_per_s: 600\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 12.5}\n"
            "  - {name: b, devices: 2, uplink_gbytes_per_s: 3}\n")


@pytest.fixture(scope="module")
def profiled(client, tmp_path_factory):
    root = tmp_path_factory.mktemp("planned")
    import_dataset("sasrec", REAL["sasrec"], root / "ds")
    profile_dataset(root / "ds", root / "profile", client=client)
    (root / "topo.yaml").write_text(TOPOLOGY)
    return root


def test_lookups_per_example_are_those_of_the_example_builder(profiled):
    ds = Dataset.open(profiled / "ds")
    offsets = ds.offsets()
    ex = build_examples(offsets, ds.ids("item"), ds.info.table("item").rows, history=20, negatives=4, seed=0)
    per_example, uniform_share = sequence_lookups(offsets, 20, 4)
    measured = ((ex.history != PAD).sum() + len(ex) * (1 + 4)) / len(ex)
    assert per_example == pytest.approx(measured, rel=1e-12)
    assert uniform_share == pytest.approx(4 / measured)


def test_plan_command_prints_the_summary_and_writes_the_store(profiled):
    out = profiled / "plan"
    done = subprocess.run(
        [SHARDFLOW, "plan", str(profiled / "profile"), "--topology", str(profiled / "topo.yaml"), "--strategy",
         "flexshard", "--memory-slack", "0.1", "--dedup", "none", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    for key, kind in [("strategy", str), ("dedup", str), ("devices", int), ("budget_bytes_per_device", int),
                      ("memory_bytes_per_device", list), ("lookup_bytes_per_step", float),
                      ("sync_bytes_per_step", float), ("bytes_per_step", float), ("inter_node_bytes_per_step", float),
                      ("comm_time_s_per_step", float), ("lower_bound_comm_time_s_per_step", float),
                      ("gap_closed", float), ("tiers", dict), ("node_rows_on_some_nodes", int)]:
        assert isinstance(s[key], kind), key
    assert s["devices"] == 4 and s["dedup"] == "none" and sum(s["tiers"].values()) == 23715
    assert max(s["memory_bytes_per_device"]) <= s["budget_bytes_per_device"]
    assert s["lower_bound_comm_time_s_per_step"] <= s["comm_time_s_per_step"] <= s["row_wise_mod_comm_time_s_per_step"]
    assert s["bytes_per_step"] == pytest.approx(s["lookup_bytes_per_step"] + s["sync_bytes_per_step"])

    stored = read_plan(out)
    plan, topo, shape, manifest = stored.plan, stored.topology, stored.shape, stored.manifest
    assert topo.devices == 4 and shape == StepShape(4096, 64, "none", "adam")  # a sequence log's rows: Adam
    assert plan.tier_counts() == s["tiers"]
    assert json.loads((out / "summary.json").read_text())["comm_time_s_per_step"] == s["comm_time_s_per_step"]
    assert read_plan_summary(out).to_dict() == {k: v for k, v in s.items() if k != "plan"}

    assert (manifest.strategy, manifest.source.memory_slack, manifest.source.history) == ("flexshard", 0.1, 50)
    assert manifest.tables == {"item": plan.table("item").rows} and manifest.budget_bytes_per_device == s[
        "budget_bytes_per_device"]

    zarr.open_array(str(out / "tables" / "item" / "home"), mode="a")[7] = 4  # changed after it was written
    with pytest.raises(InputError, match=r"plan/tables/item/home: its content does not match the manifest's digest"):
        read_plan(out)
    edited = {**json.loads((out / "manifest.json").read_text()), "source": {"profile": str(out)}}
    (out / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(InputError, match=r"plan/manifest.json source: profile_checksum = missing; accepted: str$"):
        read_plan(out)


def test_bad_plan_inputs_are_refused_before_anything_is_written(profiled, tmp_path):
    topo = uniform(1, 4, 12.5)
    shape = StepShape(64, 8, "device")
    make_plan(profiled / "profile", tmp_path / "p", topo, strategy="row-wise-mod", shape=shape)
    before = snapshot(tmp_path / "p")
    with pytest.raises(InputError, match="already holds a store"):
        make_plan(profiled / "profile", tmp_path / "p", topo, strategy="row-wise-mod", shape=shape)
    with pytest.raises(InputError, match="table-wise: table 'item'"):
        make_plan(profiled / "profile", tmp_path / "p", topo, strategy="table-wise", shape=shape, overwrite=True)
    with pytest.raises(InputError, match="strategy 'hash'"):
        make_plan(profiled / "profile", tmp_path / "p", topo, strategy="hash", shape=shape, overwrite=True)
    with pytest.raises(InputError, match="format is 'shardflow.dataset'; accepted: 'shardflow.profile'"):
        make_plan(profiled / "ds", tmp_path / "p", topo, strategy="flexshard", shape=shape, overwrite=True)
    assert snapshot(tmp_path / "p") == before

    bad = subprocess.run(
        [SHARDFLOW, "plan", str(profiled / "profile"), "--topology", str(tmp_path / "none.yaml"), "--strategy",
         "flexshard"], capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and "no such topology file" in bad.stderr


def test_a_profile_of_a_changed_dataset_is_refused(profiled, tmp_path):
    shutil.copytree(profiled, tmp_path / "copy")
    m = json.loads((tmp_path / "copy" / "profile" / "manifest.json").read_text())
    m["dataset"]["checksum"] = "sha256:0"
    (tmp_path / "copy" / "profile" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(InputError, match="run 'shardflow profile' again"):
        make_plan(tmp_path / "copy" / "profile", tmp_path / "p", uniform(1, 2, 1.0), strategy="flexshard",
                  shape=StepShape(64, 8))
    assert not (tmp_path / "p").exists()


def test_a_plan_for_adam_rows_counts_their_moments_in_each_devices_memory(profiled, tmp_path):
    topo = uniform(1, 4, 12.5)
    made = {}
    for rows in ("adagrad", "adam"):
        make_plan(profiled / "profile", tmp_path / rows, topo, strategy="row-wise-mod",
                  shape=StepShape(64, 8, "device", rows))
        made[rows] = read_plan_summary(tmp_path / rows)
        assert read_plan(tmp_path / rows).shape.row_optimizer == rows
    per_row = {rows: max(s.memory_bytes_per_device) / 5929 for rows, s in made.items()}  # ceil(23,715 / 4) rows
    assert per_row == {"adagrad": 4 * (8 + 1), "adam": 4 * (8 + 17)}
    assert made["adam"].budget_bytes_per_device > made["adagrad"].budget_bytes_per_device
