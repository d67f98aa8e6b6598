"""The bad-input matrix: each bad input is refused with a message naming the value and what is
accepted, and every store it could touch is byte-for-byte what it was before.

Each case returns (the stores to snapshot, the call that must be refused, the message pattern); one
that takes no `client` runs on stores made without a cluster, in the unit tier.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import shutil
import time
from pathlib import Path

import dask
import numpy as np
import pytest
import zarr

from shardflow.config import RetrainConfig
from shardflow.data.batches import TrainData
from shardflow.data.synthetic import SynthTable, synth_dataset
from shardflow.errors import InputError, TrainingError
from shardflow.model.configs import OptimizerConfig
from shardflow.planner.costmodel import StepShape
from shardflow.planner.sharding_plan import ShardingPlan, TablePlan
from shardflow.planner.topology import load_topology, parse_topology
from shardflow.profiling.profiles import profile_dataset
from shardflow.sharding.stage import make_plan, read_plan
from shardflow.training.config import TrainConfig
from shardflow.training.engine import Engine
from storage.checkpoint import checkpoint_dir
from storage.dataset import Dataset
from storage.importers import import_dataset
from storage.lock import run_lock
from storage.manifest import MANIFEST
from storage.profile import Profile
from support import MODEL, OPTIMIZER, TOPOLOGIES, random_plan, settled, snapshot, version_start

GOOD_SASREC = "".join(f"{u} {i}\n" for u in range(1, 30) for i in range(1, 8))
TOPOLOGY = "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Good stores made without a cluster: an imported dataset, a synthetic one, a topology."""
    root = tmp_path_factory.mktemp("bad-input")
    (root / "good.txt").write_text(GOOD_SASREC)
    import_dataset("sasrec", root / "good.txt", root / "imported")
    synth_dataset(root / "ds", [SynthTable("item", 300, 1.1), SynthTable("genre", 12, 0.7)], interactions=6000,
                  seed=4, mean_length=10)
    (root / "topo.yaml").write_text(TOPOLOGY)
    return root


@pytest.fixture(scope="module")
def world(stores, client):
    """Beside those stores, what a cluster makes: the synthetic dataset's profile, plan and checkpoint."""
    root = stores
    profile_dataset(root / "ds", root / "profile", client=client)
    make_plan(
        root / "profile",
        root / "plan",
        load_topology(root / "topo.yaml"),
        strategy="flexshard",
        shape=StepShape(96, MODEL.dim, "device"),
        memory_slack=0.5,
        history=MODEL.history,
        negatives=MODEL.negatives,
    )
    data = TrainData.load(str(root / "ds"), MODEL.features)
    with engine(client, root, random_plan(data, 2, 1)) as e:
        e.step(0, 0)
        e.checkpoint(checkpoint_dir(root / "run", 1), 1)
    return root


def engine(client, root: Path, plan, model=MODEL, optimizer=OPTIMIZER, batch_size: int = 96) -> Engine:
    return Engine(client, str(root / "ds"), plan, TOPOLOGIES[2], model, optimizer, TrainConfig(batch_size=batch_size))


def copy(world: Path, name: str, tmp_path: Path) -> Path:
    shutil.copytree(world / name, tmp_path / name)
    return tmp_path / name


def importing(world, tmp_path, text: str | bytes, fmt: str = "sasrec", **kw):
    src = tmp_path / "bad.txt"
    (src.write_bytes if isinstance(text, bytes) else src.write_text)(text)
    dest = copy(world, "imported", tmp_path)
    return [src, dest], lambda: import_dataset(fmt, src, dest, overwrite=True, **kw)


def appending(world, tmp_path, change):
    """A store grown from a directory of two parts, and an append after `change(src)` altered that directory."""
    src = tmp_path / "parts"
    src.mkdir()
    (src / "day-1.txt").write_text(GOOD_SASREC)
    (src / "day-2.txt").write_text("40 1\n40 2\n")
    dest = tmp_path / "grown"
    import_dataset("sasrec", src, dest)
    (src / "day-3.txt").write_text("41 3\n")
    change(src)
    return [dest], lambda: import_dataset("sasrec", src, dest, append=True)


def tampered_dataset(world, tmp_path, array: str, index: int, value: int):
    ds = copy(world, "ds", tmp_path)
    arr = zarr.open_array(str(ds / array), mode="r+")
    arr[index] = value
    return ds


def config(world, **kw):
    return lambda: RetrainConfig.build({"dataset": str(world / "ds"), "topology": str(world / "topo.yaml"), **kw})


def topology(text: str, tmp_path: Path):
    (tmp_path / "t.yaml").write_text(text)
    return lambda: load_topology(tmp_path / "t.yaml")


def case_import_garbage_token(world, tmp_path):
    return *importing(world, tmp_path, "1 2\n1 abc\n"), \
        r"bad.txt:2: item 'abc' is not accepted; accepted: an integer >= 0"


def case_import_negative_id(world, tmp_path):
    return *importing(world, tmp_path, "1 2\n1 -3\n"), \
        r"bad.txt:2: item '-3' is not accepted; accepted: an integer >= 0"


def case_import_truncated_line(world, tmp_path):
    return *importing(world, tmp_path, "1 2\n1 3\n7"), r"bad.txt:3: '7' has 1 fields; accepted: 'user item'"


def case_import_empty_file(world, tmp_path):
    return *importing(world, tmp_path, "\n  \n"), r"bad.txt: empty file; accepted: at least one interaction"


def case_import_not_text(world, tmp_path):
    return *importing(world, tmp_path, b"1 2\n\xff\xfe 3\n"), \
        r"bad.txt:2: not UTF-8 text \(byte 0 of the line\); accepted: a UTF-8 text file"


def case_import_recbole_bad_header(world, tmp_path):
    return *importing(world, tmp_path, "user_id:token\titem_id:tokens\n1\t2\n", "recbole"), \
        r"header field 'item_id:tokens'"


def case_import_criteo_bad_label(world, tmp_path):
    line = "\t".join(["2"] + ["1"] * 13 + ["a"] * 26)
    return *importing(world, tmp_path, line + "\n", "criteo"), r"label '2'; accepted: 0 or 1"


def case_import_criteo_nan_feature(world, tmp_path):
    line = "\t".join(["1", "nan"] + ["1"] * 12 + ["a"] * 26)
    return *importing(world, tmp_path, line + "\n", "criteo"), r"I1 = 'nan'; accepted: a finite number or empty"


def case_import_table_sizes_of_a_sequence_log(world, tmp_path):
    return *importing(world, tmp_path, GOOD_SASREC, table_rows={"item": 5}, hash_rows=1000), \
        r"--table-rows item=5 --hash-rows 1000 for format 'sasrec'; accepted: table sizes only for criteo"


def case_import_non_digit_id(world, tmp_path):
    return *importing(world, tmp_path, "1 2\n1 +5\n1 \uff17\n"), (
        r"bad.txt:2: item '\+5' is not accepted; accepted: an integer >= 0 \(ASCII digits, at most 18, no leading "
        r"zero\)")


def case_import_padded_id(world, tmp_path):
    """'007' would read as the row of '7': one spelling per id."""
    return *importing(world, tmp_path, "1 7\n1 007\n"), r"bad.txt:2: item '007' is not accepted; .*no leading zero"


def case_import_hex_id(world, tmp_path):
    return *importing(world, tmp_path, "1 2\n1 0x10\n"), \
        r"bad.txt:2: item '0x10' is not accepted; accepted: an integer >= 0 \(ASCII digits"


def case_import_hex_id_s3rec(world, tmp_path):
    return *importing(world, tmp_path, "1 2 3\n2 0X1F 4\n", "s3rec"), \
        r"bad.txt:2: item '0X1F' is not accepted; accepted: an integer >= 0 \(ASCII digits"


def case_import_id_too_long(world, tmp_path):
    return *importing(world, tmp_path, "1 2\n1 " + "3" * 5000 + "\n"), \
        r"bad.txt:2: item '3{60}…' \(5,000 characters\) is not accepted"


def case_import_truncated_gzip(world, tmp_path):
    import gzip

    src = tmp_path / "log.txt.gz"
    src.write_bytes(gzip.compress(GOOD_SASREC.encode() * 50)[:-30])
    dest = copy(world, "imported", tmp_path)
    return [src, dest], lambda: import_dataset("sasrec", src, dest, overwrite=True), \
        r"log.txt.gz: the gzip stream ends early"


def case_import_source_is_an_endless_device(world, tmp_path):
    (tmp_path / "log.txt").symlink_to("/dev/zero")
    dest = copy(world, "imported", tmp_path)
    return [dest], lambda: import_dataset("sasrec", tmp_path / "log.txt", dest, append=True), (
        r"log.txt: not a regular file or directory \(a device or a pipe\?\)")


def case_import_directory_without_parts(world, tmp_path):
    (tmp_path / "parts").mkdir()
    dest = copy(world, "imported", tmp_path)
    return [dest], lambda: import_dataset("sasrec", tmp_path / "parts", dest, overwrite=True), \
        r"parts: a directory with no parts"


def case_import_append_part_vanished(world, tmp_path):
    return *appending(world, tmp_path, lambda src: (src / "day-1.txt").unlink()), \
        r"part 'day-1.txt' of .* \(version 1\) is gone"


def case_import_append_part_changed(world, tmp_path):
    def change(src):
        (src / "day-2.txt").unlink()
        (src / "day-2.txt").write_text("40 1\n40 9\n")
    return *appending(world, tmp_path, change), r"day-2.txt: part 'day-2.txt' changed since version 1 imported it"


def case_profile_destination_being_written(world, client, tmp_path):
    from storage.lock import writer_lock

    out = copy(world, "profile", tmp_path)
    held = writer_lock(out)
    held.__enter__()  # another writer of that profile, still at work
    # `held` referenced from the call: collected, its generator would release the lock.
    return [out], lambda: (held, profile_dataset(world / "ds", out, client=client, overwrite=True)), (
        r"profile is held by another process \(host .*, pid \d+, since .*\); accepted: one writer of a store")


def case_profile_over_the_dataset_it_reads(world, tmp_path):
    ds = copy(world, "ds", tmp_path)  # refused before the cluster is asked for anything
    return [ds], lambda: profile_dataset(ds, ds, client=None, overwrite=True), (
        r"ds: the same path as .*ds, which this command reads; accepted: a path outside it")


def case_profile_inside_the_dataset_it_reads(world, tmp_path):
    ds = copy(world, "ds", tmp_path)
    return [ds], lambda: profile_dataset(ds, ds / "profile", client=None), (
        r"ds/profile: a path inside .*ds, which this command reads; accepted: a path outside it")


def case_plan_over_the_profile_it_reads(world, client, tmp_path):
    profile = copy(world, "profile", tmp_path)
    return [profile], lambda: make_plan(
        profile, profile, load_topology(world / "topo.yaml"), strategy="flexshard",
        shape=StepShape(96, MODEL.dim, "device"), memory_slack=0.5, overwrite=True,
    ), r"profile: the same path as .*profile, which this command reads; accepted: a path outside it"


def case_import_into_the_directory_of_its_parts(world, tmp_path):
    src = tmp_path / "parts"
    src.mkdir()
    (src / "day-1.txt").write_text(GOOD_SASREC)
    return [src], lambda: import_dataset("sasrec", src / "day-1.txt", src, overwrite=True), (
        r"parts: a directory holding .*day-1.txt, which this command reads; accepted: a path outside it")


def case_dataset_non_monotone_offsets(world, tmp_path):
    ds = tampered_dataset(world, tmp_path, "segments/0000/offsets", 3, 0)
    return [ds], lambda: Dataset.open(ds), r"offsets\[3\] = 0 is below offsets\[2\] = \d+; accepted: non-decreasing"


def case_dataset_id_out_of_range(world, client, tmp_path):
    ds = tampered_dataset(world, tmp_path, "segments/0000/tables/item", 17, 300)
    return [ds], lambda: profile_dataset(ds, tmp_path / "p", client=client), \
        r"\[17\] = 300 is outside the table; accepted: 0 <= id < 300"


def case_dataset_empty(world, tmp_path):
    ds = copy(world, "ds", tmp_path)
    m = json.loads((ds / MANIFEST).read_text())
    m["interactions"] = 0
    (ds / MANIFEST).write_text(json.dumps(m))
    return [ds], lambda: Dataset.open(ds), r"empty dataset \(\d+ users, 0 interactions\); accepted: at least one user"


def case_dataset_manifest_claims_more_rows(world, tmp_path):
    ds = copy(world, "ds", tmp_path)
    m = json.loads((ds / MANIFEST).read_text())
    m["tables"]["item"]["rows"] += 100
    (ds / MANIFEST).write_text(json.dumps(m))
    return [ds], lambda: Dataset.open(ds), \
        r"manifest.json: its checksum does not match what it declares \(an edited manifest\?\)"


def case_dataset_changed_since_written(world, tmp_path):
    ds = tampered_dataset(world, tmp_path, "segments/0000/tables/genre", 5, 1)
    (ds / "verified.json").unlink()  # the record that its writer hashed it: now it is hashed again
    return [ds], lambda: Dataset.open(ds), \
        r"segments/0000/tables/genre: its content does not match the manifest's digest"


def case_dataset_changed_in_place_after_it_was_verified(world, tmp_path):
    """verified.json still says the manifest's arrays were hashed: a run hashes them again anyway."""
    ds = tampered_dataset(world, tmp_path, "segments/0000/tables/item", 5, 1)
    assert (ds / "verified.json").is_file()
    return [ds], lambda: Dataset.open(ds, hashed=False).verify(), \
        r"segments/0000/tables/item: its content does not match the manifest's digest"


def flipped_byte(path: Path) -> None:
    """One byte of the first chunk file under `path` inverted (a compressed chunk: it no longer decodes)."""
    chunk = next(p for p in sorted(path.rglob("*")) if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))


def case_plan_values_changed_in_place(world, client, tmp_path):
    plan = copy(world, "plan", tmp_path)
    home = zarr.open_array(str(plan / "tables" / "item" / "home"), mode="r+")
    home[:] = 1 - home[:]
    return [plan], lambda: read_plan(plan), \
        r"plan/tables/item/home: its content does not match the manifest's digest .*\(plan again\)"


def case_plan_chunk_with_a_flipped_byte(world, client, tmp_path):
    plan = copy(world, "plan", tmp_path)
    flipped_byte(plan / "tables" / "item" / "home")
    return [plan], lambda: read_plan(plan), \
        r"plan/tables/item/home: (unreadable \(RuntimeError: .*\)|its content does not match)"


def case_profile_counts_changed_in_place(world, client, tmp_path):
    profile = copy(world, "profile", tmp_path)
    counts = zarr.open_array(str(profile / "counts" / "genre"), mode="r+")
    counts[0] += 1
    return [profile], lambda: Profile.open(profile), \
        r"profile/counts/genre: its content does not match the manifest's digest .*\(profile again\)"


def case_config_out_of_range(world, tmp_path):
    return [world / "ds"], config(world, epochs=0, batch_size=-1), \
        r"epochs = 0: .*greater than or equal to 1.*batch_size = -1"


def case_config_zero_steps_per_epoch(world, tmp_path):
    return [world / "ds"], config(world, steps_per_epoch=0), r"steps_per_epoch = 0: .*greater than or equal to 1"


def case_config_unknown_key(world, tmp_path):
    return [world / "ds"], config(world, epoch=3), \
        r"epoch = 3: Extra inputs are not permitted; did you mean epochs\? \(keys: dataset, "


def case_config_two_clusters(world, tmp_path):
    return [world / "ds"], config(world, scheduler_address="tcp://x:1", cluster_class="distributed.LocalCluster"), \
        r"accepted: at most one of them"


def case_config_negative_learning_rate(world, tmp_path):
    return [world / "ds"], config(world, row_lr=-0.1), r"row_lr = -0.1: Input should be greater than 0"


def case_config_negatives_without_bound(world, tmp_path):
    return [world / "ds"], config(world, negatives=10**9), \
        r"negatives = 1000000000: Input should be less than or equal to 4096"


def case_config_history_without_bound(world, tmp_path):
    return [world / "ds"], config(world, history=10**9), \
        r"history = 1000000000: Input should be less than or equal to 4096"


def case_config_seed_past_64_bits(world, tmp_path):
    return [world / "ds"], config(world, seed=2**63), \
        r"seed = 9223372036854775808: Input should be less than or equal to 9223372036854775807"


def case_config_mlp_too_wide(world, tmp_path):
    return [world / "ds"], config(world, mlp=[10**9]), \
        r"widths \[1000000000\]; accepted: integers >= 1 and <= 65,536, at most 64 of them"


def case_config_attention_heads_not_dividing_dim(world, tmp_path):
    return [world / "ds"], config(world, encoder="self-attention", dim=64, attention_heads=3), \
        r"attention_heads = 3 for dim 64; accepted: a divisor of dim"


def case_config_gbce_calibration_above_1(world, tmp_path):
    return [world / "ds"], config(world, loss="gbce", gbce_t=1.5), \
        r"gbce_t = 1.5: Input should be less than or equal to 1"


def case_config_unknown_encoder(world, tmp_path):
    return [world / "ds"], config(world, encoder="transformer"), \
        r"encoder = 'transformer': Input should be 'mean' or 'self-attention'"


def case_config_patience_of_zero_epochs(world, tmp_path):
    return [world / "ds"], config(world, patience=0), r"patience = 0: Input should be greater than or equal to 1"


def case_config_min_epochs_without_patience(world, tmp_path):
    return [world / "ds"], config(world, min_epochs=5, patience=None), \
        r"min_epochs = 5 without patience; accepted: min_epochs only with patience"


def case_config_self_attention_for_a_click_log(world, tmp_path):
    return [world / "ds"], config(world, encoder="self-attention", dataset_format="criteo"), \
        r"encoder = 'self-attention' for a criteo click log; accepted: mean"


def case_config_infinite_rates_and_slack(world, tmp_path):
    return (
        [world / "ds"],
        config(world, row_lr=float("inf"), dense_lr=float("nan"), memory_slack=float("inf")),
        r"memory_slack = inf: Input should be a finite number.*row_lr "
        r"= inf: Input should be a finite number.*dense_lr = nan",
    )


def case_config_part_settle_time_not_a_duration(world, tmp_path):
    return [world / "ds"], config(world, part_settle_s=-1), \
        r"part_settle_s = -1: Input should be greater than or equal to 0"


def case_import_replace_a_part_the_store_does_not_hold(world, tmp_path):
    src = tmp_path / "parts"
    src.mkdir()
    (src / "day-1.txt").write_text(GOOD_SASREC)
    dest = tmp_path / "grown"
    import_dataset("sasrec", src, dest)
    return [dest], lambda: import_dataset("sasrec", src, dest, replace_from="day-2.txt"), \
        r"--replace-from day-2.txt: not a part .*grown holds; accepted: one of day-1.txt"


def case_import_only_unfinished_parts(world, tmp_path):
    src = tmp_path / "parts"
    src.mkdir()
    (src / "day-1.txt").write_text(GOOD_SASREC.rstrip("\n"))  # its writer is not done
    dest = copy(world, "imported", tmp_path)
    return [dest], lambda: import_dataset("sasrec", src, dest, overwrite=True), \
        r"parts: no finished part yet \(day-1.txt \(does not end with a newline\)\)"


def case_config_step_past_the_machines_memory(world, tmp_path):
    return [world / "ds"], config(world, batch_size=10**8, negatives=4096, history=4096, dim=4096), \
        r"a training step needs about [\d,.]+ GB \(batch_size 100000000 over 2 devices .*this machine has [\d,.]+ GB"


def refused_without_running(cfg, marker: Path):
    """`cfg` built, and the marker file its command would write checked absent whatever happens."""
    def build():
        try:
            cfg()
        finally:
            time.sleep(0.5)  # a process it started would have written by now
            assert not marker.exists(), "the config ran a command"
    return build


def case_config_cluster_class_runs_a_command(world, tmp_path):
    marker = tmp_path / "ran"
    cfg = config(world, cluster_class="subprocess.Popen", cluster_kwargs={"args": ["touch", str(marker)]})
    return [world / "ds"], refused_without_running(cfg, marker), \
        r"cluster_class = 'subprocess.Popen': .*not an allowed cluster class; accepted: one of distributed.LocalCluster"


def case_config_cluster_class_not_a_cluster(world, tmp_path):
    return [world / "ds"], config(world, cluster_class="distributed.Client"), \
        r"cluster_class = 'distributed.Client': .*not an allowed cluster class"


# Every known way a cluster class's arguments name code: Python text or a module to preload, a
# worker or scheduler class, specs with a class, plugins, security objects, job-script lines.
CODE_IN_CLUSTER_KWARGS = {
    "preload_text": ("distributed.LocalCluster", lambda m: {"preload": [f"import os; os.system('touch {m}')"]},
                     "key 'preload'"),
    "worker_preload": ("distributed.LocalCluster", lambda m: {"worker_kwargs": {"preload": [f"open('{m}', 'w')"]}},
                       "key 'worker_kwargs'"),
    "scheduler_preload": ("distributed.LocalCluster",
                          lambda m: {"scheduler_kwargs": {"preload": [f"open('{m}', 'w')"]}}, "key 'scheduler_kwargs'"),
    "worker_class": ("distributed.LocalCluster", lambda m: {"worker_class": "subprocess.Popen"}, "key 'worker_class'"),
    "plugins": ("distributed.LocalCluster", lambda m: {"plugins": ["os.system"]}, "key 'plugins'"),
    "security": ("distributed.LocalCluster", lambda m: {"security": {"require_encryption": True}}, "key 'security'"),
    "spec_cluster": ("distributed.SpecCluster", lambda m: {"scheduler": {"cls": "subprocess.Popen", "options": {
        "args": ["sh", "-c", f"touch {m}"]}}}, "cluster_class 'distributed.SpecCluster': not an allowed"),
    "job_prologue": ("dask_jobqueue.SLURMCluster", lambda m: {"job_script_prologue": [f"touch {m}"]},
                     "key 'job_script_prologue'"),
    "line_in_a_value": ("dask_jobqueue.SLURMCluster", lambda m: {"walltime": f"01:00:00\ntouch {m}"},
                        "cluster_kwargs.walltime = "),
    "space_in_a_value": ("distributed.LocalCluster", lambda m: {"interface": f"lo; touch {m}"},
                         "cluster_kwargs.interface = "),
}


def _code_case(name: str):
    cls, kwargs, message = CODE_IN_CLUSTER_KWARGS[name]

    def case(world, tmp_path):
        marker = tmp_path / "ran"
        cfg = config(world, cluster_class=cls, cluster_kwargs=kwargs(marker))
        return [world / "ds"], refused_without_running(cfg, marker), re.escape(message)
    return case


for _name in CODE_IN_CLUSTER_KWARGS:
    globals()[f"case_config_cluster_kwargs_{_name}"] = _code_case(_name)


def case_config_cluster_kwargs_checked_again_where_the_cluster_starts(world, tmp_path):
    """A caller that skipped the config (the flows' shared run_cluster) is refused all the same."""
    from shardflow.cluster import run_cluster

    marker = tmp_path / "ran"

    def start():
        with run_cluster(None, "distributed.LocalCluster", {"preload": [f"open('{marker}', 'w')"]}, 1):
            pass
    return [world / "ds"], refused_without_running(start, marker), r"cluster_kwargs key 'preload' for distributed"


def case_config_cluster_kwargs_plain_values_pass(world, tmp_path):
    """Not vacuous: allowed keys with plain values build (the failure below is the next check's)."""
    return [world / "ds"], config(world, cluster_class="distributed.LocalCluster",
                                  cluster_kwargs={"n_workers": 2, "memory_limit": "2GB", "resources": {"GPU": 1}},
                                  epochs=0), r"epochs = 0: .*greater than or equal to 1"


def case_config_yaml_alias_bomb(world, tmp_path):
    from shardflow.safe_yaml import load_file

    levels = "\n".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 10))
    (tmp_path / "bomb.yaml").write_text("l0: &l0 [lol]\n" + levels + "\n")
    return [world / "ds"], lambda: load_file(tmp_path / "bomb.yaml", "config"), \
        r"bomb.yaml: line 1: an anchor \(&l0\); accepted: plain YAML without anchors and aliases"


def case_config_local_cluster_larger_than_the_machine(world, tmp_path):
    from shardflow.cluster import run_cluster

    return (
        [world / "ds"],
        lambda: run_cluster(None, None, {}, 100_000).__enter__(),
        (
            r"workers = 100,000: a local cluster of 100,000 processes "
            r"\(one per device\) on \d+ cores; accepted: at most \d+, or a Dask cluster of its own for more "
            r"\(--scheduler ADDRESS on the command line; scheduler_address or cluster_class in a run's config\)"
        ),
    )


def case_topology_too_many_devices(world, client, tmp_path):
    text = "intra_node_gbytes_per_s: 10\nnodes:\n  - {name: a, devices: 1000000, uplink_gbytes_per_s: 1}\n"
    return [world / "plan"], topology(text, tmp_path), r"1,000,000 devices; accepted: at most 4,096"


def case_topology_without_devices(world, client, tmp_path):
    return [world / "plan"], topology("intra_node_gbytes_per_s: 10\nnodes: []\n", tmp_path), \
        r"no nodes; accepted: a list of at least one node"


def case_topology_zero_devices(world, client, tmp_path):
    text = "intra_node_gbytes_per_s: 10\nnodes:\n  - {name: a, devices: 0, uplink_gbytes_per_s: 1}\n"
    return [world / "plan"], topology(text, tmp_path), r"node 'a' has devices = 0; accepted: an integer >= 1"


def case_topology_negative_bandwidth(world, client, tmp_path):
    text = "intra_node_gbytes_per_s: 10\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: -5}\n"
    return [world / "plan"], topology(text, tmp_path), r"uplink_gbytes_per_s = -5; accepted: a number > 0"


def case_topology_not_yaml(world, client, tmp_path):
    return [world / "plan"], topology("nodes: [a, {\n", tmp_path), (
        r"t.yaml: line 2: not valid YAML \(expected the node content, but found '<stream end>'\); accepted: plain "
        r"YAML \(a mapping")


def case_plan_budget_too_small(world, client, tmp_path):
    topo = parse_topology({"intra_node_gbytes_per_s": 10, "device_memory_bytes": 1000,
                           "nodes": [{"name": "a", "devices": 2, "uplink_gbytes_per_s": 1}]}, "tiny")
    plan = copy(world, "plan", tmp_path)
    return [world / "profile", plan], lambda: make_plan(
        world / "profile", plan, topo, strategy="flexshard", shape=StepShape(96, 8, "device"), overwrite=True,
    ), r"short by 9,232 bytes; accepted: a larger device_memory_bytes"


def case_plan_other_tables(world, client, tmp_path):
    plan = ShardingPlan("x", (TablePlan("items", np.zeros(300, np.int8), np.zeros(300, np.int32)),
                              TablePlan("genre", np.zeros(12, np.int8), np.zeros(12, np.int32))))
    return [world / "run"], lambda: engine(client, world, plan), r"the plan has no table 'item' \(it has items, genre\)"


def case_plan_home_beyond_devices(world, client, tmp_path):
    data = TrainData.load(str(world / "ds"), MODEL.features)
    plan = random_plan(data, 2, 0)
    home = plan.tables[0].home.copy()
    home[5] = 7
    plan = ShardingPlan("x", (TablePlan(plan.tables[0].name, plan.tables[0].tier, home), *plan.tables[1:]))
    return [world / "run"], lambda: engine(client, world, plan), \
        r"home 7 on a topology of 2 devices; accepted: homes 0 to 1"


def _restore(client, world, path, model=MODEL):
    data = TrainData.load(str(world / "ds"), model.features)
    with engine(client, world, random_plan(data, 2, 1), model=model) as e:
        e.restore(path)


def case_checkpoint_dimension_mismatch(world, client, tmp_path):
    from dataclasses import replace

    return [world / "run"], lambda: _restore(client, world, checkpoint_dir(world / "run", 1), replace(MODEL, dim=16)), (
        r"checkpoint of model \{'kind': 'sequence', 'dim': 8.*accepted: model \{'kind': 'sequence', 'dim': 16")


def case_checkpoint_altered_chunk(world, client, tmp_path):
    run = copy(world, "run", tmp_path)
    chunk = next(p for p in sorted(run.rglob("item/weights/c/*/*")))
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    return [run], lambda: _restore(client, world, checkpoint_dir(run, 1)), \
        r"item/weights: (content does not match its checksum|unreadable)"


def case_training_batch_larger_than_dataset(world, client, tmp_path):
    data = TrainData.load(str(world / "ds"), MODEL.features)
    return [world / "ds"], lambda: engine(client, world, random_plan(data, 2, 1), batch_size=10**6), (
        r"batch size 1000000 > \d+ training examples; accepted: at most \d+")


def case_run_batch_larger_than_the_versions_training_examples(world, tmp_path):
    from shardflow.preflight import check_training_examples

    cfg = config(world, batch_size=20_000, run_dir=str(tmp_path / "run"))  # the dataset: 6,000 events
    return [world / "ds"], lambda: check_training_examples(cfg(), str(world / "ds"), (0, 0)), (
        r"batch size 20000 > \d+ training examples; accepted: at most \d+")


def case_training_non_finite_gradients(world, client, tmp_path):
    data = TrainData.load(str(world / "ds"), MODEL.features)
    run = copy(world, "run", tmp_path)

    def train():
        with engine(client, world, random_plan(data, 2, 1), optimizer=OptimizerConfig(row_lr=1e30, dense_lr=1e30)) as e:
            e.restore(checkpoint_dir(run, 1))
            for i in range(5):
                e.step(0, 1 + i)
            e.checkpoint(checkpoint_dir(run, 2), 2)
    return [run], train, TrainingError, r"step \d+: (non-finite gradient in .* on device \d|the loss is (nan|inf))"


def _run_dir_trained_on(world, tmp_path, source: Path) -> Path:
    """A run_dir that imported `source` and holds a model version of it (its checkpoint the world's, copied)."""
    from shardflow.importing import bring_in
    from storage import versions
    from storage.dataset import Dataset

    run = tmp_path / "run"
    cfg = RetrainConfig.build({"dataset": str(source), "topology": str(world / "topo.yaml"), "run_dir": str(run)})
    dataset = bring_in(cfg, logging.getLogger(__name__)).path
    segments = [s.checksum for s in Dataset.open(dataset).segments]
    version = versions.start(run, version_start(1, dataset=dataset, segments=tuple(segments)))
    shutil.copytree(world / "run" / "checkpoints", version / "checkpoints")
    return run


def case_run_dir_trained_on_another_dataset(world, client, tmp_path):
    from shardflow.preflight import check_dataset

    run = _run_dir_trained_on(world, tmp_path, world / "good.txt")
    (tmp_path / "other.txt").write_text("1 2\n1 3\n2 4\n")
    cfg = config(world, dataset=str(tmp_path / "other.txt"), run_dir=str(run))
    return [run], lambda: check_dataset(cfg()), \
        r"run_dir .*run was trained on .*good.txt \(sasrec\); dataset .*other.txt \(sasrec\) is another one"


def case_run_dir_dataset_part_changed(world, client, tmp_path):
    from shardflow.preflight import check_dataset

    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "day-1.txt").write_text(GOOD_SASREC)
    settled(parts / "day-1.txt")
    run = _run_dir_trained_on(world, tmp_path, parts)
    (parts / "day-1.txt").unlink()
    (parts / "day-1.txt").write_text(GOOD_SASREC.replace("1 1", "1 9", 1))
    cfg = config(world, dataset=str(parts), run_dir=str(run))
    return [run], lambda: check_dataset(cfg()), r"part 'day-1.txt' changed since version 1 imported it"


def case_config_run_dir_empty(world, tmp_path):
    return [world / "ds"], config(world, run_dir=""), \
        r"run_dir = '': an empty path; accepted: a directory of its own"


def case_config_run_dir_root(world, tmp_path):
    return [world / "ds"], config(world, run_dir="/"), \
        r"run_dir = '/': / is a file system root or the home directory"


def case_config_run_dir_of_something_else(world, tmp_path):
    """A directory of other files (a project, /tmp) is no run's: the run's stores would sit among them."""
    mine = tmp_path / "project"
    (mine / "src").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine\n")
    return [mine], config(world, run_dir=str(mine)), \
        rf"{mine} holds 'notes.txt', 'src' and nothing of a run; accepted: a new or empty directory, or the " \
        r"run_dir of an earlier run"


def case_run_budget_cannot_fit_the_tables(world, client, tmp_path):
    from shardflow.preflight import check_run

    (tmp_path / "tiny.yaml").write_text(TOPOLOGY + "device_memory_bytes: 1000\n")
    cfg = config(world, topology=str(tmp_path / "tiny.yaml"), run_dir=str(tmp_path / "run"))
    return [world / "ds"], lambda: check_run(cfg()), (
        r"the tables of .*ds need 240,864 bytes at dim 64 \(312 rows with row_optimizer adam's moments\), but 2 "
        r"devices × 1,000 bytes of .*tiny.yaml hold 2,000: short by 238,864 bytes; accepted: a larger "
        r"device_memory_bytes, more devices, or a smaller dim or row_optimizer adagrad")


def case_config_batch_smaller_than_the_devices(world, tmp_path):
    return (
        [world / "ds"],
        config(world, batch_size=1),
        r"batch size 1 < 2 trainers; accepted: batch size >= 2, one "
        r"example per trainer \(a trainer per device of .*topo.yaml",
    )


def case_config_train_window_unknown(world, tmp_path):
    return (
        [world / "ds"],
        config(world, train_window="yesterday"),
        r"train_window = 'yesterday': 'yesterday'; accepted: "
        r"'new' \(the parts since the warm-start source\), 'all', or N >= 1",
    )


def case_config_replan_margin_out_of_range(world, tmp_path):
    return [world / "ds"], config(world, replan_margin=1.5), r"replan_margin = 1.5: Input should be less than 1"


def case_run_dir_dataset_holds_foreign_files(world, client, tmp_path):
    from shardflow.preflight import check_run

    (tmp_path / "run" / "dataset").mkdir(parents=True)
    (tmp_path / "run" / "dataset" / "notes.txt").write_text("mine")
    cfg = config(world, run_dir=str(tmp_path / "run"))
    return [tmp_path / "run"], lambda: check_run(cfg()), \
        r"run_dir .*run: .*dataset exists, is not empty and is not a shardflow store"


def case_run_dir_versions_holds_foreign_files(world, client, tmp_path):
    from shardflow.preflight import check_run

    (tmp_path / "run" / "versions" / "notes").mkdir(parents=True)
    (tmp_path / "run" / "versions" / "notes" / "todo.txt").write_text("mine")
    cfg = config(world, dataset=str(world / "ds"), run_dir=str(tmp_path / "run"))
    return [tmp_path / "run"], lambda: check_run(cfg()), (
        r"run_dir .*run: .*versions holds notes, not model versions; accepted: a versions directory shardflow made")


def case_run_scheduler_with_fewer_workers_than_devices(world, client, tmp_path):
    from shardflow.cluster import check_workers

    return (
        [world / "ds"],
        lambda: check_workers(client, 8, timeout_s=1),
        (
            r"the scheduler at tcp://.* has 4 workers; the topology "
            r"has 8 devices; accepted: at least one worker per device"
        ),
    )


def case_config_scheduler_address_malformed(world, tmp_path):
    return [world / "ds"], config(world, scheduler_address="notanaddress"), (
        r"scheduler_address = 'notanaddress': .*accepted: PROTOCOL://HOST:PORT, e.g. tcp://10.0.0.5:8786")


def case_run_scheduler_that_never_answers(world, tmp_path):
    from cli.embedded_api import free_port
    from shardflow.cluster import dask_client

    address = f"tcp://127.0.0.1:{free_port()}"  # a port nothing listens on

    def connect():
        with dask.config.set({"distributed.comm.timeouts.connect": "2s"}):
            dask_client(address).__enter__()
    return [world / "ds"], connect, (
        r"scheduler 'tcp://127.0.0.1:\d+' did not answer within 2 s \(\w+\); accepted: the address of a running")


def case_cluster_workers_with_a_scheduler(world, tmp_path):
    from shardflow.cluster import dask_client

    return [world / "ds"], lambda: dask_client("tcp://127.0.0.1:9", 3).__enter__(), (
        r"--workers 3 with --scheduler tcp://127.0.0.1:9; accepted: one of them \(--workers sizes a local cluster")


def case_run_dir_is_a_file(world, client, tmp_path):
    (tmp_path / "run").write_text("notes")
    return [tmp_path / "run"], lambda: run_lock(tmp_path / "run").__enter__(), \
        r"run_dir .* is a file; accepted: a directory"


CASES = {name.removeprefix("case_"): fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def test_the_matrix_covers_every_stage_with_at_least_twenty_cases():
    assert len(CASES) >= 20
    assert {n.split("_")[0] for n in CASES} >= {
        "import",
        "dataset",
        "config",
        "topology",
        "plan",
        "checkpoint",
        "training",
    }


# A case that takes no client needs no cluster: it runs in the unit tier (tests/conftest.py), on the stores alone.
NEEDS_CLUSTER = sorted(name for name, case in CASES.items() if "client" in inspect.signature(case).parameters)
NO_CLUSTER = sorted(set(CASES) - set(NEEDS_CLUSTER))


def refused_and_unchanged(case, tmp_path: Path) -> None:
    stores, call, *expect = case
    error, pattern = expect if len(expect) == 2 else (InputError, expect[0])
    before = {str(s): snapshot(s) if s.is_dir() else s.read_bytes() for s in stores}
    with pytest.raises(error, match=pattern):
        call()
    assert {str(s): snapshot(s) if s.is_dir() else s.read_bytes() for s in stores} == before
    assert all(before.values()), "a case must guard a store that holds something"
    assert not list(tmp_path.glob(".*.staging-*")), "a refused write left a staging directory"


@pytest.mark.parametrize("name", NO_CLUSTER)
def test_bad_input_is_refused_before_any_cluster_and_leaves_every_store_unchanged(name, stores, tmp_path):
    refused_and_unchanged(CASES[name](stores, tmp_path), tmp_path)


@pytest.mark.parametrize("name", NEEDS_CLUSTER)
def test_bad_input_is_refused_and_leaves_every_store_unchanged(name, world, client, tmp_path):
    refused_and_unchanged(CASES[name](world, client, tmp_path), tmp_path)
