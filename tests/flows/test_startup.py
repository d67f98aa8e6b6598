"""`shardflow run` with its embedded Prefect API, as a user starts it: on a machine whose every core is busy,
with an API that cannot start in time, and on a night with nothing new (no API, no cluster at all)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from runs import BIN, SMALL, TOPOLOGY
from shardflow.data.synthetic import SynthTable, synth_dataset
from storage import versions

pytestmark = pytest.mark.fault  # the tier: killed, interrupted or starved processes

HOG = "while True: pass"
RUN_S = 900  # a whole small run beside a busy loop on every core, on 2 cores (about 3x a quiet run's time)


def small_run(tmp_path: Path) -> Path:
    synth_dataset(tmp_path / "ds", [SynthTable("item", 400, 1.1)], interactions=20000, seed=3, mean_length=12)
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        **{k: list(v) if isinstance(v, tuple) else v for k, v in SMALL.items()}, "epochs": 1,
        "dataset": str(tmp_path / "ds"), "run_dir": str(tmp_path / "run"), "topology": str(tmp_path / "topo.yaml"),
    }))
    return tmp_path / "run.yaml"


def embedded(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return env | {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}


def shardflow_run(config: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "shardflow"), "run", "--config", str(config), "--json"], env=env,
                          capture_output=True, text=True, timeout=RUN_S)


def test_a_run_beside_a_busy_loop_on_every_core_completes_quietly_and_a_night_with_nothing_new_needs_no_api(
        tmp_path):
    config = small_run(tmp_path)
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 1)]
    try:
        done = shardflow_run(config, embedded(tmp_path))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["version"] == 1
    # A successful run's terminal: Prefect's own lines, none of Dask's, no traceback.
    assert "Traceback" not in done.stderr and " distributed." not in done.stderr, done.stderr[-3000:]

    # Nothing new: answered from the stores. The API it is pointed at does not exist: any call to it would
    # fail (after minutes of retries), and no Dask worker is ever started.
    again = shardflow_run(config, embedded(tmp_path, PREFECT_API_URL="http://127.0.0.1:9/api"))
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout)
    assert summary["trained"] is False and summary["current"] == 1 and summary["downloads"] == 0
    assert summary["message"] == "no new data since version 1: nothing trained"
    assert "Starting temporary server" not in again.stderr and "distributed" not in again.stderr


def test_an_api_that_cannot_start_in_time_ends_the_run_in_one_line_naming_the_setting(tmp_path):
    config = small_run(tmp_path)
    done = shardflow_run(config, embedded(tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1"))
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith("shardflow run:")]
    assert len(ours) == 1 and "did not answer within 1 s (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)" in ours[0]
    assert not (tmp_path / "run").exists()  # nothing was written


def test_a_run_owns_its_data_an_append_meanwhile_is_refused_naming_the_run(tmp_path):
    from support import REAL, split_into_days

    (tmp_path / "head.txt").write_text("".join(REAL["sasrec"].read_text().splitlines(keepends=True)[:30000]))
    days = split_into_days(tmp_path / "head.txt", tmp_path / "days", (0.8, 0.2), late_users=0.1, seed=0)
    parts, run = tmp_path / "parts", tmp_path / "run"
    parts.mkdir()
    shutil.copy2(days[0], parts)
    (parts / ".day-2.txt.part").write_text("")  # a writer's hidden temporary file, and a folder: not parts
    (parts / "archive").mkdir()
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        **{k: list(v) if isinstance(v, tuple) else v for k, v in SMALL.items()}, "epochs": 3,
        "dataset": str(parts), "run_dir": str(run), "topology": str(tmp_path / "topo.yaml")}))
    proc = subprocess.Popen([str(BIN / "shardflow"), "run", "--config", str(tmp_path / "run.yaml"), "--json"],
                            env=embedded(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = run / "versions" / "0001" / "checkpoints" / "epoch-000001" / "manifest.json"
    deadline = time.monotonic() + RUN_S
    while not first.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (
            proc.stderr.read()[-3000:] if proc.poll() else "slow"
        )
        time.sleep(0.05)
    shutil.copy2(days[1], parts)  # the next day's part lands while version 1 trains
    append = subprocess.run([str(BIN / "shardflow"), "import", "--format", "sasrec", str(parts), str(run / "dataset"),
                             "--append"], capture_output=True, text=True, timeout=300)
    out, err = proc.communicate(timeout=RUN_S)
    assert proc.returncode == 0, err[-3000:]
    assert append.returncode == 2 and "Traceback" not in append.stderr, append.stderr[-3000:]
    assert f"dataset is held by another process (run {run}: host " in append.stderr
    summary = json.loads(out)
    assert summary["parts"] == 1 and len(versions.started(run, 1).parts) == 1  # measured on its own data
    assert f"skipped 2 entries of {parts} that are not parts: .day-2.txt.part (hidden), archive (a directory)" \
        in summary["warnings"]
