"""A run_dir's version records without training: the current link, an operator's rollback, cut-off writes."""

from __future__ import annotations

import os

import pytest

from shardflow.errors import InputError
from storage import versions
from support import version_start


@pytest.fixture
def run(tmp_path):
    """Three finished versions (1 and 3 promoted, 2 rejected) and version 4 begun; version 3 current."""
    for n, promoted in ((1, True), (2, False), (3, True)):
        versions.start(tmp_path, version_start(n, segments=(str(n),)))
        versions.finish(tmp_path, n, {"promoted": promoted})
    versions.start(tmp_path, version_start(4, segments=("4",)))
    versions.promote(tmp_path, 3)
    return tmp_path


def test_an_operator_rolls_back_and_no_run_undoes_it(run):
    record = versions.promote_by_operator(run, 1, "v3 recommends stale items")
    assert versions.current(run) == 1
    assert (record.version, record.previous, record.newest_finished, record.reason) == (1, 3, 3,
                                                                                     "v3 recommends stale items")
    assert versions.promotions(run) == [record] and record.by and record.at
    assert not versions.promotion_cut_off(run, 3)  # without the record, 3 would count as a cut-off promotion
    os.remove(run / versions.PROMOTIONS)
    assert versions.promotion_cut_off(run, 3)


def test_a_version_made_after_the_rollback_is_promoted_again_if_its_switch_was_cut_off(run):
    versions.promote_by_operator(run, 1, "rollback")
    versions.finish(run, 4, {"promoted": True})  # version 4 accepted, killed before `current` switched
    assert versions.promotion_cut_off(run, 4)


@pytest.mark.parametrize("number", [2, 4, 9])
def test_only_a_finished_version_can_be_promoted(run, number):
    if number == 2:  # rejected by the gate, but finished: an operator may choose it
        versions.promote_by_operator(run, 2, "operator's choice")
        assert versions.current(run) == 2
        return
    with pytest.raises(InputError, match=rf"version {number} of .* is not a finished model version; accepted: "
                                         r"one of 1, 2, 3"):
        versions.promote_by_operator(run, number, "x")
    assert versions.current(run) == 3


@pytest.mark.parametrize("target", ["versions/0009", "somewhere/else", "versions/0004", "versions/abcd"])
def test_a_dangling_or_garbage_current_link_is_one_line_naming_the_mend(run, target):
    (run / versions.CURRENT).unlink()
    (run / versions.CURRENT).symlink_to(target)
    with pytest.raises(InputError, match=rf"current points at '{target}', not a finished model version; accepted: "
                                         rf"a link to one, made by 'shardflow promote .* --version N' \(finished "
                                         r"versions: 1, 2, 3\)"):
        versions.current(run)
    versions.promote_by_operator(run, 3, "mend")
    assert versions.current(run) == 3


def test_a_cut_off_atomic_write_leaves_temporary_files_the_next_run_sweeps(run):
    left = [run / ".current.0123abcd", run / ".promotions.json.89abcdef",
            versions.version_dir(run, 3) / ".result.json.deadbeef"]
    left[0].symlink_to("versions/0001")
    for p in left[1:]:
        p.write_text("")
    kept = versions.version_dir(run, 3) / ".result.json.notahexname"
    kept.write_text("")
    assert sorted(versions.sweep_temporary(run)) == [".current.0123abcd", ".promotions.json.89abcdef",
                                                     "versions/0003/.result.json.deadbeef"]
    assert not any(p.is_symlink() or p.exists() for p in left) and kept.exists()
    assert versions.current(run) == 3


def test_a_rollback_holds_the_run_dirs_lock_and_refuses_a_run_dir_without_versions(run, tmp_path_factory):
    from storage.lock import run_lock

    with run_lock(run):
        with pytest.raises(InputError, match="is in use by another run"):
            versions.rollback(run, 1, "during a night")
    assert versions.current(run) == 3
    with pytest.raises(InputError, match="holds no model versions"):
        versions.rollback(tmp_path_factory.mktemp("empty"), 1, "x")


def test_a_start_record_reads_back_as_written_and_a_bad_field_is_named(run):
    made = version_start(5, dataset="/data/ds", segments=("a1", "b2"), parts=("day-1.txt", "day-2.txt"),
                         warm_start_from=3, window=(1, 1), config={"epochs": 2})
    versions.start(run, made)
    assert versions.started(run, 5) == made and versions.started(run, 6) is None
    path = versions.version_dir(run, 5) / versions.STARTED
    path.write_text(path.read_text().replace('"warm_start_from": 3', '"warm_start_from": "3"'))
    with pytest.raises(InputError, match=rf"{path}: warm_start_from = '3'; accepted: int or none"):
        versions.started(run, 5)


def test_a_bad_promotion_entry_is_named(run):
    versions.promote_by_operator(run, 1, "rollback")
    path = run / versions.PROMOTIONS
    path.write_text(path.read_text().replace('"newest_finished": 3', '"newest_finished": null'))
    with pytest.raises(InputError, match=rf"{path} entry 1: newest_finished = None; accepted: int"):
        versions.promotions(run)
    path.write_text("{}")
    with pytest.raises(InputError, match=rf"{path}: a dict; accepted: a JSON list of promotions"):
        versions.promotions(run)
