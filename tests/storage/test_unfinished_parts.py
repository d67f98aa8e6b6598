"""Only finished parts are imported; a part that changed after its import is replaced, not a dead end."""

import os
import time
from pathlib import Path

import numpy as np
import pytest

from shardflow.errors import InputError
from storage.dataset import Dataset
from storage.importers import import_dataset
from storage.sources import finished, not_parts, resolve_parts, unfinished
from support import REAL, sequences_by_raw_user, siblings, snapshot, split_into_days


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> list[Path]:
    return split_into_days(REAL["sasrec"], tmp_path_factory.mktemp("days"))


def names(parts) -> list[str]:
    return [p.name for p in parts]


def test_a_part_without_its_last_newline_waits_and_so_does_every_part_after_it(tmp_path):
    src = tmp_path / "logs"
    src.mkdir()
    (src / "day-1.txt").write_text("1 2\n1 3\n")
    (src / "day-2.txt").write_text("2 4\n2 5")  # its writer is not done
    (src / "day-3.txt").write_text("3 6\n")
    (src / "day-4.txt").write_text("")
    assert names(finished(resolve_parts(src))) == ["day-1.txt"]
    assert unfinished(resolve_parts(src)) == ["day-2.txt (does not end with a newline)",
                                              "day-3.txt (after an unfinished part)",
                                              "day-4.txt (after an unfinished part)"]
    done = import_dataset("sasrec", src, tmp_path / "ds")
    assert (done.parts_added, done.parts_waiting[0]) == ((str(src / "day-1.txt"),),
                                                         "day-2.txt (does not end with a newline)")
    assert Dataset.open(tmp_path / "ds").info.interactions == 2

    with open(src / "day-2.txt", "a") as f:
        f.write("\n")
    (src / "day-4.txt").write_text("4 7\n")
    grown = import_dataset("sasrec", src, tmp_path / "ds", append=True)
    assert names(map(Path, grown.parts_added)) == ["day-2.txt", "day-3.txt", "day-4.txt"]
    assert grown.parts_waiting == () and Dataset.open(tmp_path / "ds").info.interactions == 6


def test_an_empty_or_recently_modified_part_waits_for_the_settle_time(tmp_path):
    src = tmp_path / "logs"
    src.mkdir()
    (src / "day-1.txt").write_text("1 2\n")
    (src / "day-2.txt").write_text("")
    assert unfinished(resolve_parts(src)) == ["day-2.txt (empty)"]
    (src / "day-2.txt").write_text("2 3\n")
    assert unfinished(resolve_parts(src, settle_s=3600)) == ["day-1.txt (modified 0 s ago; part_settle_s 3600)",
                                              "day-2.txt (after an unfinished part)"]
    with pytest.raises(InputError, match=r"logs: no finished part yet \(day-1.txt \(modified 0 s ago; "
                                         r"part_settle_s 3600\), day-2.txt"):
        import_dataset("sasrec", src, tmp_path / "ds", settle_s=3600)
    assert not (tmp_path / "ds").exists()
    an_hour_ago = time.time() - 3601
    os.utime(src / "day-1.txt", (an_hour_ago, an_hour_ago))
    assert names(finished(resolve_parts(src, settle_s=3600))) == ["day-1.txt"]


def test_a_directory_with_markers_reads_the_parts_that_have_one(tmp_path):
    src = tmp_path / "logs"
    src.mkdir()
    (src / "day-1.txt").write_text("1 2\n")
    (src / "day-1.txt.done").write_text("")
    (src / "day-2.txt").write_text("2 3\n")  # complete-looking, but its writer has not said so
    # the marker, not the settle time, decides
    assert names(finished(resolve_parts(src, settle_s=3600))) == ["day-1.txt"]
    assert unfinished(resolve_parts(src)) == ["day-2.txt (no day-2.txt.done marker yet)"]
    assert not_parts(src) == []  # a marker is not reported as something that is not a part
    (src / "day-2.txt.done").write_text("")
    assert names(finished(resolve_parts(src))) == ["day-1.txt", "day-2.txt"]


def test_a_part_that_changed_after_its_import_is_replaced_keeping_every_row(tmp_path, days):
    """The stuck state of a part imported while its writer was busy, then finished: the append names the
    command, and --replace-from makes the store a fresh import's equal, every earlier id on its old row."""
    src = tmp_path / "src"
    src.mkdir()
    for p in days[:2]:
        os.link(p, src / p.name)
    whole = days[2].read_bytes()
    cut = whole.index(b"\n", len(whole) // 2) + 1
    (src / "day-3.txt").write_bytes(whole[:cut - 2] + b"\n")  # half a day, its last line cut short
    import_dataset("sasrec", src, tmp_path / "ds")
    before = Dataset.open(tmp_path / "ds")
    rows_before = {t: dict(zip(*(a.tolist() for a in before.raw_ids(t)), strict=True)) for t in ("item",)}
    users_before = before.user_ids().tolist()

    (src / "day-3.txt").unlink()
    (src / "day-3.txt").write_bytes(whole)
    kept = snapshot(tmp_path / "ds")
    with pytest.raises(InputError, match=r"part 'day-3.txt' changed since version 1 imported it .*To take the part "
                                         r"as it is now: shardflow import --format sasrec --replace-from day-3.txt "
                                         + str(src) + " " + str(tmp_path / "ds")):
        import_dataset("sasrec", src, tmp_path / "ds", append=True)
    assert snapshot(tmp_path / "ds") == kept

    done = import_dataset("sasrec", src, tmp_path / "ds", replace_from="day-3.txt")
    assert (done.manifest["version"], done.parts_added) == (2, (str(src / "day-3.txt"),))
    assert done.manifest["source"]["replaced"][0]["part"] == "day-3.txt"
    assert done.manifest["source"]["replaced"][0]["segment"] == 2
    ds = Dataset.open(tmp_path / "ds")
    import_dataset("sasrec", src, tmp_path / "fresh")
    fresh = Dataset.open(tmp_path / "fresh")
    assert sequences_by_raw_user(ds) == sequences_by_raw_user(fresh)
    assert ds.info.interactions == fresh.info.interactions
    rows_after = dict(zip(*(a.tolist() for a in ds.raw_ids("item")), strict=True))
    assert all(rows_after[raw] == row for raw, row in rows_before["item"].items())
    assert sorted(rows_after.values()) == list(range(ds.info.table("item").rows))
    assert ds.user_ids().tolist()[: len(users_before)] == users_before
    assert np.array_equal(ds.user_ids()[len(users_before):], np.setdiff1d(fresh.user_ids(), users_before))
    assert siblings(tmp_path / "ds") == ["fresh", "src"]  # no staged or replaced store left beside it
    assert import_dataset("sasrec", src, tmp_path / "ds", append=True).parts_added == ()


@pytest.mark.parametrize("name, message", [
    ("day-9.txt", r"--replace-from day-9.txt: not a part .*ds holds; accepted: one of day-1.txt, day-2.txt"),
])
def test_a_replacement_of_a_part_the_store_does_not_hold_is_refused(tmp_path, days, name, message):
    src = tmp_path / "src"
    src.mkdir()
    for p in days[:2]:
        os.link(p, src / p.name)
    import_dataset("sasrec", src, tmp_path / "ds")
    kept = snapshot(tmp_path / "ds")
    with pytest.raises(InputError, match=message):
        import_dataset("sasrec", src, tmp_path / "ds", replace_from=name)
    assert snapshot(tmp_path / "ds") == kept


@pytest.mark.parametrize("fmt, options", [
    ("recbole", {}),  # users by text id, regrouped by time: the users of the replaced part keep their index
    ("criteo", {"hash_rows": "exact"}),  # every line its own user: numbered on from the parts kept
])
def test_a_replacement_keeps_rows_and_users_in_the_other_formats(tmp_path, fmt, options):
    lines = REAL[fmt].read_text().splitlines()
    head, body = lines[:1], lines[1:]  # each part repeats the header line
    half = len(body) // 2
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("\n".join(head + body[:half]) + "\n")
    (src / "b").write_text("\n".join(head + body[half: half + half // 2]) + "\n")  # half of b, then all of it
    import_dataset(fmt, src, tmp_path / "ds", **options)
    before = Dataset.open(tmp_path / "ds")
    rows_before = {t: dict(zip(*(a.tolist() for a in before.raw_ids(t)), strict=True)) for t in before.info.table_names}
    (src / "b").unlink()
    (src / "b").write_text("\n".join(head + body[half:]) + "\n")
    import_dataset(fmt, src, tmp_path / "ds", replace_from="b", **options)
    import_dataset(fmt, src, tmp_path / "fresh", **options)
    ds, fresh = Dataset.open(tmp_path / "ds"), Dataset.open(tmp_path / "fresh")
    assert ds.info.interactions == fresh.info.interactions == len(body)
    for t in ds.info.table_names:
        rows = dict(zip(*(a.tolist() for a in ds.raw_ids(t)), strict=True))
        assert all(rows[raw] == row for raw, row in rows_before[t].items())
        assert sorted(rows.values()) == list(range(ds.info.table(t).rows))
    if fmt == "recbole":
        assert ds.user_ids().tolist()[: before.info.users] == before.user_ids().tolist()
        assert sequences_by_raw_user(ds) == sequences_by_raw_user(fresh)
    else:
        assert ds.info.users == len(body)
        np.testing.assert_array_equal(ds.column("labels"), fresh.column("labels"))


def test_a_printed_command_quotes_a_hostile_part_name_so_pasting_it_runs_nothing_else(tmp_path):
    """A part named like a shell command, changed after its import: the printed command, pasted into a shell,
    is the import of that one part and nothing more."""
    import shlex
    import subprocess

    src = tmp_path / "logs dir"
    src.mkdir()
    hostile = "day-2.txt; touch sfmark_inject #"
    (src / "day-1.txt").write_text("1 2\n1 3\n")
    (src / hostile).write_text("2 4\n")
    import_dataset("sasrec", src, tmp_path / "ds")
    (src / hostile).write_text("2 4\n2 5\n")
    with pytest.raises(InputError) as refused:
        import_dataset("sasrec", src, tmp_path / "ds", append=True)
    command = str(refused.value).split("To take the part as it is now: ", 1)[1]
    words = shlex.split(command)
    assert words[:5] == ["shardflow", "import", "--format", "sasrec", "--replace-from"]
    assert words[5:] == [hostile, str(src), str(tmp_path / "ds")]
    subprocess.run(["bash", "-c", "true " + command], cwd=tmp_path, check=True)  # pasted after a harmless word
    assert not (tmp_path / "sfmark_inject").exists()


def logs(tmp_path: Path, **parts: str) -> Path:
    """A parts directory holding day-1.txt ('1 2') and `parts` (file name -> content)."""
    src = tmp_path / "logs"
    src.mkdir()
    (src / "day-1.txt").write_text("1 2\n")
    for name, text in parts.items():
        (src / name).write_text(text)
    return src


@pytest.mark.parametrize("name", ["day-2\n.txt", "day-2\x1b[2J.txt", "day-2\r.txt"])
def test_a_part_name_with_a_control_character_is_one_line_naming_it(tmp_path, name):
    src = logs(tmp_path, **{name: "2 4\n"})
    with pytest.raises(InputError, match=r"has a control character in its name; accepted: names of printable") as e:
        import_dataset("sasrec", src, tmp_path / "ds")
    assert "\n" not in str(e.value) and not (tmp_path / "ds").exists()


def test_a_link_is_a_part_only_when_it_leads_to_a_file_inside_the_directory(tmp_path):
    src = logs(tmp_path)
    (src / "day-2.txt").symlink_to(src / "day-1.txt")  # inside: a part like any other
    assert names(resolve_parts(src)) == ["day-1.txt", "day-2.txt"]
    (tmp_path / "secret").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (src / "day-3.txt").symlink_to(tmp_path / "secret")
    with pytest.raises(InputError, match=r"part 'day-3.txt' is a link to a file outside the directory") as e:
        import_dataset("sasrec", src, tmp_path / "ds")
    assert "root:x" not in str(e.value) and not (tmp_path / "ds").exists()


def test_a_part_stamped_in_the_future_is_judged_by_its_content_not_waited_for(tmp_path):
    src = logs(tmp_path, **{"day-2.txt": "2 4\n"})
    os.utime(src / "day-1.txt", (time.time() - 3600, time.time() - 3600))
    ten_years = time.time() + 10 * 365 * 86400
    os.utime(src / "day-2.txt", (ten_years, ten_years))
    assert names(finished(resolve_parts(src, settle_s=60))) == ["day-1.txt", "day-2.txt"]
    (src / "day-3.txt").write_text("3 6")  # no newline: still unfinished, whatever its time stamp
    os.utime(src / "day-3.txt", (ten_years, ten_years))
    assert unfinished(resolve_parts(src, settle_s=60)) == ["day-3.txt (does not end with a newline)"]
