"""A run_dir on a file system that fills up or turns read-only: one line, nothing stored lost, a rerun resumes.

Each test mounts a small tmpfs of its own (root only; skipped where mounting is not allowed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from runs import BIN, SMALL, TOPOLOGY, stderr_of
from shardflow.data.synthetic import SynthTable, synth_dataset
from support import snapshot

pytestmark = pytest.mark.fault  # the tier: killed, interrupted or starved processes


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def write_config(tmp_path: Path, run_dir: Path, items: int = 400, **config) -> Path:
    # 10,000 events: epochs of about 65 steps (5 s beside a CI run on 2 cores), the run still training after
    # its first checkpoint, when the fault comes
    synth_dataset(tmp_path / "ds", [SynthTable("item", items, 1.1)], interactions=10_000, seed=3, mean_length=12)
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        **{k: list(v) if isinstance(v, tuple) else v for k, v in SMALL.items()}, "epochs": 3,
        "dataset": str(tmp_path / "ds"), "run_dir": str(run_dir), "topology": str(tmp_path / "topo.yaml"), **config,
    }))
    return tmp_path / "run.yaml"


def test_a_full_disk_stops_the_run_in_one_line_and_the_rerun_resumes(prefect_api, small_fs, tmp_path):
    config = write_config(tmp_path, small_fs / "run")
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    proc = subprocess.Popen([str(BIN / "shardflow"), "run", "--config", str(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = small_fs / "run" / "versions" / "0001" / "checkpoints" / "epoch-000001"
    deadline = time.monotonic() + 300
    while not (first / "manifest.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, stderr_of(proc)
        time.sleep(0.02)
    filler = small_fs / "filler"
    with open(filler, "wb") as f:  # every byte left, as another program filling the disk would
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    kept = snapshot(first)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 4, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("shardflow run:")]
    assert "No space left on device" in line and "kept" in line, line
    assert snapshot(first) == kept  # the complete checkpoint is untouched

    filler.unlink()
    rerun = subprocess.run([str(BIN / "shardflow"), "run", "--config", str(config), "--json"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout)
    assert summary["resumed_from"] is not None and summary["promoted"]
    assert not [p for p in (small_fs / "run").rglob("*") if ".staging-" in p.name]


def test_a_read_only_run_dir_is_refused_before_anything_starts(small_fs, tmp_path):
    (small_fs / "run").mkdir()  # new and empty (a directory of other files is refused before the write check)
    config = write_config(tmp_path, small_fs / "run")
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    started = time.monotonic()
    done = subprocess.run([str(BIN / "shardflow"), "run", "--config", str(config)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and time.monotonic() - started < 30, done.stderr[-3000:]
    assert f"run_dir {small_fs / 'run'}: {small_fs / 'run'} cannot be written (a read-only file system" in done.stderr
    assert "Traceback" not in done.stderr
    assert not list((small_fs / "run").iterdir())
    assert shutil.disk_usage(small_fs).used < 1 << 20


def test_a_version_whose_checkpoints_cannot_fit_the_free_space_is_refused_before_its_profile(
        prefect_api, small_fs, tmp_path):
    # 6,000 rows × (1,024 + 1) floats and a small MLP: 24.9 MB a copy of the model; 3 at once (keep_checkpoints 2
    # and the one being written, then the export) do not fit 64 MiB, though the first checkpoints would have
    config = write_config(tmp_path, small_fs / "run", items=6000, dim=1024, encoder="mean", row_optimizer="adagrad")
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    done = subprocess.run([str(BIN / "shardflow"), "run", "--config", str(config)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    [line] = [x for x in done.stderr.splitlines() if x.startswith("shardflow run:")]
    assert re.search(r"this version writes at least 7\d\.\d MB \(3 copies of the model on disk at once, checkpoints "
                     r"and the export, each 2\d\.\d MB: 6,0\d\d rows × 4100 bytes, dim 1024 with its adagrad state, "
                     r"and 0\.\d MB of dense layers with their adam state\) and 6\d\.\d MB is free there", line), line
    assert line.endswith("or fewer checkpoints at once (train.keep_checkpoints)"), line
    version = small_fs / "run" / "versions" / "0001"
    assert sorted(p.name for p in version.iterdir()) == ["version.json"]  # no profile, plan or checkpoint
