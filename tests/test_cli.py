"""The installed `shardflow` command, run as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

from support import REAL, snapshot

SHARDFLOW = str(Path(sys.executable).parent / "shardflow")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SHARDFLOW, *args], capture_output=True, text=True, timeout=300)


def test_import_and_profile_print_one_json_object(tmp_path):
    imported = run("import", "--format", "sasrec", str(REAL["sasrec"]), str(tmp_path / "ds"), "--json")
    assert imported.returncode == 0, imported.stderr
    summary = json.loads(imported.stdout)
    assert summary["users"] == 31013 and summary["tables"] == {"item": 23715}

    profiled = run("profile", str(tmp_path / "ds"), "--out", str(tmp_path / "p"), "--workers", "1", "--json")
    assert profiled.returncode == 0, profiled.stderr
    result = json.loads(profiled.stdout)
    item = result["tables"]["item"]
    assert set(item) == {"rows", "accesses", "distinct", "top1pct_share", "top10pct_share", "zipf_slope"}
    assert (item["rows"], item["accesses"], item["distinct"]) == (23715, 287107, 23715)
    assert isinstance(item["zipf_slope"], float)

    human = run("profile", str(tmp_path / "ds"), "--out", str(tmp_path / "p"), "--workers", "1", "--overwrite")
    assert human.returncode == 0, human.stderr
    assert "item" in human.stdout and "287,107" in human.stdout


def test_synth_command(tmp_path):
    done = run("synth", str(tmp_path / "ds"), "--tables", "item:1000:1.2", "tag:20", "--interactions", "5000",
               "--seed", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tables"] == {"item": 1000, "tag": 20}


def test_bad_input_exits_2_with_one_clear_line_and_no_stdout(tmp_path):
    run("import", "--format", "s3rec", str(REAL["s3rec"]), str(tmp_path / "ds"))
    before = snapshot(tmp_path / "ds")
    refused = run("import", "--format", "sasrec", str(REAL["sasrec"]), str(tmp_path / "ds"), "--json")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "already holds a store; pass --overwrite" in refused.stderr
    assert snapshot(tmp_path / "ds") == before

    missing = run("profile", str(tmp_path / "nope"), "--workers", "1", "--json")
    assert missing.returncode == 2 and missing.stdout == ""
    assert "no such directory" in missing.stderr

    workers = run("profile", str(tmp_path / "ds"), "--workers", "0")
    assert workers.returncode == 2 and "workers = 0; accepted: an integer >= 1" in workers.stderr
