"""The installed `shardflow` command, run as a user runs it."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import REAL, snapshot, split_into_days

pytestmark = pytest.mark.server  # the tier: `shardflow run` or `prefect` as processes

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


def test_import_of_parts_then_append_prints_what_it_added(tmp_path):
    days = split_into_days(REAL["sasrec"], tmp_path / "all")
    src = tmp_path / "logs"
    src.mkdir()
    for day in days[:2]:
        (src / day.name).write_bytes(day.read_bytes())
    first = run("import", "--format", "sasrec", str(src), str(tmp_path / "ds"), "--workers", "2", "--json")
    assert first.returncode == 0, first.stderr
    (src / days[2].name).write_bytes(days[2].read_bytes())
    added = run("import", "--format", "sasrec", str(src), str(tmp_path / "ds"), "--append", "--json")
    assert added.returncode == 0, added.stderr
    summary = json.loads(added.stdout)
    assert set(summary) >= {"path", "users", "interactions", "tables", "checksum", "version", "parts_added",
                            "parts_skipped", "seconds"}
    assert summary["parts_added"] == [str(src / "day-3.txt")] and len(summary["parts_skipped"]) == 2
    assert (summary["version"], summary["users"], summary["interactions"]) == (2, 31013, 287107)
    assert summary["tables"] == {"item": 23715} and summary["seconds"] > 0
    again = run("import", "--format", "sasrec", str(src), str(tmp_path / "ds"), "--append")
    assert again.returncode == 0 and "version 2: 0 parts added, 3 already held" in again.stdout


def test_import_with_a_click_label_makes_a_click_log_of_recbole_files(tmp_path):
    imported = run("import", "--format", "recbole", "--label", "rating>=4", str(REAL["recbole"]),
                   str(tmp_path / "ds"), "--json")
    assert imported.returncode == 0, imported.stderr
    summary = json.loads(imported.stdout)
    assert summary["sequence_table"] is None and summary["users"] == summary["interactions"] == 100_000
    assert summary["tables"] == {"user": 943, "item": 1682, "age": 61, "gender": 2, "occupation": 21,
                                 "zip_code": 795, "release_year": 73, "movie_title": 2652, "class": 19}
    assert summary["widths"] == {"movie_title": 15, "class": 6}  # genres and title words: token sequences
    shown = run("import", "--format", "recbole", "--label", "rating>=4", str(REAL["recbole"]), str(tmp_path / "ds2"))
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"table class +19 rows  \(feature, up to 6 tokens an example\)", shown.stdout), shown.stdout
    refused = run("import", "--format", "recbole", "--label", "rating=4", str(REAL["recbole"]), str(tmp_path / "x"))
    assert refused.returncode == 2 and refused.stdout == "" and not (tmp_path / "x").exists()
    assert refused.stderr.strip().count("\n") == 0
    assert "click label 'rating=4'; accepted: FIELD>=NUMBER" in refused.stderr


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

    twice = run("import", "--format", "criteo", str(REAL["criteo"]), str(tmp_path / "clicks"), "--table-rows", "C1=5",
                "--table-rows", "C1=6")  # the last one was taken silently
    assert twice.returncode == 2 and not (tmp_path / "clicks").exists()
    assert twice.stderr == "shardflow import: error: --table-rows C1 given twice; accepted: each table's size once\n"

    # A first night whose only part is still being written: refused before the embedded API starts, nothing written.
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "day-1.txt").write_text("1 2\n1 3")
    early = run("run", "--set", f"dataset={tmp_path / 'parts'}", "--set", f"run_dir={tmp_path / 'night'}")
    assert early.returncode == 2 and early.stdout == "" and not (tmp_path / "night").exists(), early.stderr
    assert early.stderr == (f"shardflow run: error: {tmp_path / 'parts'}: no finished part yet (day-1.txt (does not "
                            "end with a newline)); accepted: parts that end with a newline and have settled, or carry "
                            "a NAME.done marker\n")

    # A GPU asked of a local cluster on a machine without one: refused before the import and the API (it was
    # refused by the workers, after import, profile and plan: 12.7 s on 2 cores).
    if not torch.cuda.is_available():
        cuda = run("run", "--set", "device=cuda", "--set", f"run_dir={tmp_path / 'gpu'}")
        assert cuda.returncode == 2 and cuda.stdout == "" and not (tmp_path / "gpu").exists(), cuda.stderr
        assert cuda.stderr == ("shardflow run: error: device 'cuda': no CUDA device is visible to PyTorch; accepted "
                               "here: cpu\n"), cuda.stderr


def test_a_successful_run_keeps_the_terminal_quiet_unless_asked(tmp_path):
    run("synth", str(tmp_path / "ds"), "--tables", "item:300:1.1", "--interactions", "3000", "--seed", "1",
        "--mean-length", "10")
    (tmp_path / "topo.yaml").write_text(
        "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n"
    )
    keys = [f"dataset={tmp_path / 'ds'}", f"topology={tmp_path / 'topo.yaml'}", "epochs=1", "batch_size=64", "dim=8",
            "mlp=[8]", "eval_users=50"]

    def stderr(run_dir: str, *extra: str) -> list[str]:
        done = run("run", *(a for k in keys + [f"run_dir={tmp_path / run_dir}"] for a in ("--set", k)), *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr.splitlines()

    quiet = stderr("quiet")
    assert not [line for line in quiet if "Traceback" in line or " distributed." in line]
    verbose = stderr("verbose", "--verbose")
    assert any(" distributed.scheduler INFO " in line for line in verbose)


def test_an_error_raised_while_a_ctrl_c_is_handled_counts_as_the_interrupt():
    from shardflow.errors import Terminated, as_stop, interrupted

    def prefect_fails_while_interrupted():  # as Prefect's task engine does when Ctrl-C lands as a task begins
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ValueError("Task run is not set")  # noqa: B904 (as Prefect raises it: the interrupt is its context)

    try:
        prefect_fails_while_interrupted()
    except ValueError as e:
        assert interrupted(e)
    assert not interrupted(ValueError("Task run is not set")) and interrupted(KeyboardInterrupt())
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = KeyboardInterrupt()
    assert interrupted(wrapped)
    # the flow raises it as the interrupt it is: Prefect records Crashed, not Failed (no stop signal noted here)
    assert isinstance(as_stop(wrapped), KeyboardInterrupt) and as_stop(ValueError("Task run is not set")) is None
    assert as_stop(KeyboardInterrupt()) is None and as_stop(Terminated()) is None


LOST_IN_A_FINALIZER = """
import signal, sys, time
from cli.main import _Interrupts
from shardflow.errors import Terminated, stop_if_asked


class Finalized:
    def __del__(self):
        signal.raise_signal(signal.Signals[sys.argv[1]])  # the handler raises here: Python ignores it
        print("not reached")


_Interrupts("run")
Finalized()
print("lost", flush=True)
try:
    for _ in range(1000):
        stop_if_asked()  # as a training step or a run's next stage does
        time.sleep(0.01)
except (Terminated, KeyboardInterrupt) as e:
    print("taken up as", type(e).__name__)
"""


@pytest.mark.parametrize("signame, raised", [("SIGTERM", "Terminated"), ("SIGINT", "KeyboardInterrupt")])
def test_a_stop_whose_exception_a_finalizer_loses_is_taken_up_at_the_next_step_without_a_traceback(signame,
                                                                                                 raised):
    """The signal's handler raises inside a finalizer, where Python prints the exception and goes on (a run once
    trained on to the end after a SIGTERM that landed there): the next stop check raises it again, quietly."""
    done = subprocess.run([sys.executable, "-c", LOST_IN_A_FINALIZER, signame], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.splitlines() == ["lost", f"taken up as {raised}"], done
    assert done.stderr == "", done.stderr


TWICE = """
import os, signal, sys, time
from cli.main import _Interrupts

interrupts = _Interrupts("train")
first, second = (getattr(signal, name) for name in sys.argv[1:])
try:
    os.kill(os.getpid(), first)
    time.sleep(30)
except BaseException as e:
    print("winding down after", type(e).__name__, flush=True)
    try:
        os.kill(os.getpid(), second)  # lands in the winding down: a cluster's close, a lock's bookkeeping
        time.sleep(30)
    except BaseException as again:
        print("raised again:", type(again).__name__)
"""


@pytest.mark.parametrize("first, second, status, raised, how", [
    ("SIGTERM", "SIGTERM", 143, "Terminated", "terminated (SIGTERM)"),
    ("SIGINT", "SIGTERM", 143, "KeyboardInterrupt", "terminated (SIGTERM)"),
    ("SIGTERM", "SIGINT", 130, "Terminated", "interrupted"),
])
def test_a_second_stop_signal_ends_the_command_at_once_in_one_line(first, second, status, raised, how):
    """Seen here: `shardflow train` sent SIGTERM twice (by `timeout` and by `pkill`) waited in Dask's Client.close
    for good, the second Terminated having landed inside a threading.Condition's bookkeeping and left its lock
    held. A second stop signal of either kind now ends the command at once, as a second Ctrl-C did."""
    done = subprocess.run([sys.executable, "-c", TWICE, first, second], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == status and done.stdout.splitlines() == [f"winding down after {raised}"], done
    assert done.stderr.splitlines() == [f"shardflow train: {how} twice, stopped at once; every complete checkpoint "
                                        "and store is kept: run the same command again to resume"], done.stderr


CUT_COROUTINE = """
from cli.main import _ended, _Interrupts
from shardflow.errors import Terminated

interrupts = _Interrupts("import")


async def open_group():
    pass


def write():
    cut = open_group()  # made as the signal landed (zarr's sync wrapper), never awaited
    raise Terminated("signal 15")


try:
    write()
except BaseException as e:
    status = _ended("import", interrupts, e)
print(status)
"""


def test_a_coroutine_a_stop_cut_short_prints_no_warning_after_the_one_line():
    """Seen once in CI: a SIGTERM to `shardflow import` inside zarr left a coroutine never awaited, and Python's
    RuntimeWarning about it (two lines) followed the command's one line."""
    done = subprocess.run([sys.executable, "-c", CUT_COROUTINE], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.split() == ["143"], done
    assert done.stderr.splitlines() == ["shardflow import: terminated (SIGTERM); every complete checkpoint and store "
                                        "is kept: run the same command again to resume"], done.stderr


HALF_BUILT = """
import signal, sys
from cli.main import _ended, _Interrupts

interrupts = _Interrupts("import")


class HalfBuilt:  # asyncio's event loop, made by zarr as a SIGTERM landed in its constructor
    def __init__(self):
        signal.raise_signal(signal.SIGTERM)
        self.ssock = None

    def __del__(self):
        self.ssock


class Broken:
    def __del__(self):
        raise ValueError("a finalizer's own error")


if sys.argv[1] == "stopped":
    try:
        HalfBuilt()
    except BaseException as e:
        status = _ended("import", interrupts, e)
    print(status)
else:
    Broken()
    print(0)
"""


def test_an_object_a_stop_cut_short_fails_in_its_finalizer_after_the_one_line_quietly():
    """Seen once in CI: a SIGTERM to `shardflow import` as zarr made its event loop left the loop without
    `_ssock`, and Python's report of its finalizer's AttributeError (nine lines) followed the command's one line.
    Without a stop, a finalizer's error is still reported as Python reports it."""
    where = Path(__file__).resolve().parents[2]
    stopped = subprocess.run([sys.executable, "-c", HALF_BUILT, "stopped"], capture_output=True, text=True,
                             timeout=60, cwd=where)
    assert stopped.stdout.split() == ["143"], stopped
    assert stopped.stderr.splitlines() == ["shardflow import: terminated (SIGTERM); every complete checkpoint and "
                                           "store is kept: run the same command again to resume"], stopped.stderr
    running = subprocess.run([sys.executable, "-c", HALF_BUILT, "running"], capture_output=True, text=True,
                             timeout=60, cwd=where)
    assert running.stdout.split() == ["0"] and "ValueError: a finalizer's own error" in running.stderr, running


ENDS_AT_EXIT = """
import atexit, sys
from cli import end_at_exit


class Torn:
    def __del__(self):
        print("torn down", file=sys.stderr)


kept = Torn()  # a module's global: deleted by the interpreter's teardown only
atexit.register(lambda: open(sys.argv[1], "w").write("ran"))
sys.stdout.write("said")  # held in the buffer of a pipe
if sys.argv[2] == "end":
    end_at_exit(3)
sys.exit(3)
"""


def test_a_command_ends_after_its_exit_handlers_without_the_interpreters_teardown(tmp_path):
    """What the command says and its exit handlers' work are kept; the teardown is skipped (as the same process
    without end_at_exit shows, torn down)."""
    where = Path(__file__).resolve().parents[2]
    ended, torn = (subprocess.run([sys.executable, "-c", ENDS_AT_EXIT, str(tmp_path / how), how], capture_output=True,
                                  text=True, timeout=60, cwd=where) for how in ("end", "plain"))
    for done, how in ((ended, "end"), (torn, "plain")):
        assert done.returncode == 3 and done.stdout == "said" and (tmp_path / how).read_text() == "ran", done
    assert ended.stderr == "" and torn.stderr == "torn down\n", (ended.stderr, torn.stderr)


def test_a_running_run_listens_on_loopback_only_and_its_export_evaluates_alike_from_the_cli(tmp_path):
    """Every socket the run's processes listen on (embedded API, Dask scheduler, nannies, workers, dashboard) is
    bound to a loopback address, sampled while the run trains. The version's full-catalog figures (ranked on the
    cluster's workers) are what `shardflow evaluate` computes in its own process on the same users."""
    import ipaddress
    import time

    import psutil

    run("synth", str(tmp_path / "ds"), "--tables", "item:300:1.1", "--interactions", "3000", "--seed", "1",
        "--mean-length", "10")
    (tmp_path / "topo.yaml").write_text(
        "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n"
    )
    keys = [f"dataset={tmp_path / 'ds'}", f"topology={tmp_path / 'topo.yaml'}", "epochs=3", "batch_size=64", "dim=8",
            "mlp=[8]", "eval_users=50", f"run_dir={tmp_path / 'run'}"]
    proc = psutil.Popen([SHARDFLOW, "run", *(a for k in keys for a in ("--set", k))], stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE, text=True)
    listening: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        for p in [proc, *proc.children(recursive=True)]:
            try:
                listening |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections("inet")
                              if c.status == psutil.CONN_LISTEN}
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        time.sleep(0.1)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert len(listening) >= 5, listening  # the API, a scheduler, its dashboard, two nannies and workers
    assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in listening), sorted(listening)

    result = json.loads((tmp_path / "run" / "versions" / "0001" / "result.json").read_text())
    assert result["full_ranking"] == "exclude-seen" and 0 <= result["full_hr_at_10"] <= result["full_hr_at_20"] <= 1
    done = run("evaluate", result["model"], str(tmp_path / "ds"), "--users", "50", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    again = json.loads(done.stdout)
    keys = ("auc", "hr_at_10", "ndcg_at_10", "full_hr_at_10", "full_ndcg_at_10", "full_hr_at_20", "full_ndcg_at_20")
    assert {k: again[k] for k in keys} == {k: result[k] for k in keys}
    assert not [line for line in done.stderr.splitlines() if " INFO " in line]
    for given, export in ((tmp_path / "run" / "versions" / "0001", result["model"]),
                          (tmp_path / "run", tmp_path / "run" / "current" / "model")):
        refused = run("evaluate", str(given), str(tmp_path / "ds"))
        assert refused.returncode == 2 and not refused.stdout, refused
        assert refused.stderr.splitlines() == [
            f"shardflow evaluate: error: {given}: no manifest.json; the export is incomplete (a download was cut "
            f"off) or absent; accepted: an export's directory, such as {export}"], refused.stderr


def test_recommend_shows_the_current_versions_newest_list_of_the_user_also_after_a_rollback(tmp_path):
    """Night 1 promotes v1 (lists of u1, u2 by v1); night 2 rejects v2 (lists of its new users, u3, by v1);
    night 3 promotes v3 (lists of u1, u4 by v3). A user's list comes from the current version only: the newest of
    its nights that lists the user."""
    import numpy as np

    from storage import recommendations, versions
    from support import version_start

    def night(n: int, by: int, users: list[str]) -> None:
        versions.start(tmp_path, version_start(n, segments=(str(n),)))
        versions.finish(tmp_path, n, {"promoted": by == n})
        store = versions.version_dir(tmp_path, n) / "recommendations"
        store.mkdir()
        items = np.array([[f"{u}-by-{by}-night-{n}", "x"] for u in users])
        files = recommendations.write_part(store, 0, np.array(users), items, np.ones(items.shape))
        recommendations.finish(store, {"version": by, "k": 2, "users_from": "window", "first_part": n - 1,
                                       "users": len(users)}, files)
        if by == n:
            versions.promote(tmp_path, n)

    night(1, 1, ["u1", "u2"])
    night(2, 1, ["u3"])
    night(3, 3, ["u1", "u4"])

    def shown(user: str) -> tuple[int, str]:
        done = run("recommend", str(tmp_path), "--user", user, "--k", "1", "--json")
        assert done.returncode == 0, done.stderr
        printed = json.loads(done.stdout)
        return printed["version"], printed["items"][0]["item"]

    def refused(user: str) -> str:
        done = run("recommend", str(tmp_path), "--user", user)
        assert done.returncode == 2 and not done.stdout, done
        return done.stderr.strip()

    assert [shown("u1"), shown("u4")] == [(3, "u1-by-3-night-3"), (3, "u4-by-3-night-3")]
    night3 = versions.version_dir(tmp_path, 3) / "recommendations"
    assert refused("u2") == (f"shardflow recommend: error: user 'u2': no list in {night3} (it holds the 2 users seen "
                             "from part 3 of the dataset on, ranked by version 3); accepted: a raw user id of those "
                             "users, as the dataset spells it")
    versions.promote(tmp_path, 1)  # a rollback: v3's lists are no longer what the product shows
    assert [shown("u1"), shown("u2"), shown("u3")] == [
        (1, "u1-by-1-night-1"), (1, "u2-by-1-night-1"), (1, "u3-by-1-night-2")]
    night2 = versions.version_dir(tmp_path, 2) / "recommendations"
    assert refused("u4") == (f"shardflow recommend: error: user 'u4': no list in {night2} (it holds the 1 users seen "
                             "from part 2 of the dataset on, ranked by version 1; nor do its lists of 1 earlier "
                             "night(s)); accepted: a raw user id of those users, as the dataset spells it")
    versions.promote(tmp_path, 2)  # the rejected version, an operator's choice: none of its nights ranked lists
    assert refused("u1") == (f"shardflow recommend: error: run_dir {tmp_path}: no top-K lists ranked by the current "
                             f"version 2 (the newest, {night3}, are version 3's); accepted: a run_dir after a night "
                             "under the current version (the next night writes its lists)")
