import errno
import os
from pathlib import Path

import pytest

from shardflow.errors import InputError
from storage.manifest import write_manifest
from storage.staging import check_apart, check_destination, staged


def test_a_destination_apart_from_what_is_read_passes_and_one_that_overlaps_it_is_named(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ds")
    for apart in ("ds2", "d", "profile", "other/ds"):  # names sharing a prefix are not paths inside one another
        check_apart(tmp_path / apart, (tmp_path / "ds",))
    for dest, where in (("ds", "the same path as"), ("link", "the same path as"), (".", "a directory holding"),
                        ("ds/profile", "a path inside"), ("link/profile", "a path inside")):
        with pytest.raises(InputError) as refused:
            check_apart(tmp_path / dest, (tmp_path / "ds", tmp_path / "plan"))  # the first it overlaps is named
        assert str(refused.value) == f"{tmp_path / dest}: {where} {tmp_path / 'ds'}, which this command reads; " \
                                     "accepted: a path outside it"
    check_apart(tmp_path / "ds" / "dataset", (tmp_path / "ds",), inside=True)  # an import's parts: files only


def test_an_overwrite_replaces_only_a_store_shardflow_wrote_and_no_store_is_made_inside_another(tmp_path):
    """A directory with a manifest.json of its own (a web app's, a browser extension's) was taken for a store and
    replaced by `import --overwrite`, its other files lost; a store made inside another went with the outer
    one's overwrite."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "my web app"}')
    (app / "notes.txt").write_text("precious")
    with pytest.raises(InputError, match=r"app exists, is not empty and is not a shardflow store; refusing to "):
        check_destination(app, overwrite=True)
    store = tmp_path / "store"
    store.mkdir()
    write_manifest(store, {"format": "shardflow.dataset", "format_version": 1})
    check_destination(store, overwrite=True)
    text = (store / "manifest.json").read_text()
    (store / "manifest.json").write_text(text[: len(text) // 2])  # damaged: a resume replaces such a checkpoint
    check_destination(store, overwrite=True)
    for inner in (store / "inner", store / "segments" / "x"):
        with pytest.raises(InputError) as refused:
            check_destination(inner, overwrite=False)
        assert str(refused.value) == f"{inner}: a path inside the shardflow store {store}; accepted: a path " \
                                     "outside any store"
    check_destination(app / "inner", overwrite=False)  # inside a directory that is no store: nothing to lose
    assert (app / "notes.txt").read_text() == "precious"


def test_a_destination_that_is_a_symbolic_link_is_refused_and_its_store_kept(tmp_path):
    """`import --overwrite` through a link to a store moved the link aside, put the new store where the link was,
    then failed on a traceback ("Cannot call rmtree on a symbolic link"): the old store stayed, a leftover link
    beside it."""
    store = tmp_path / "store"
    store.mkdir()
    write_manifest(store, {"format": "shardflow.dataset", "format_version": 1})
    for name, target in (("link", store), ("dangling", tmp_path / "gone")):
        (tmp_path / name).symlink_to(target)
        with pytest.raises(InputError) as refused:
            check_destination(tmp_path / name, overwrite=True)
        assert str(refused.value) == f"{tmp_path / name}: a symbolic link to {target}; accepted: a path that is not " \
                                     f"a link (the store's own: {target})"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "link", "store"]


def test_the_working_directory_is_replaced_as_any_store_is(tmp_path, monkeypatch):
    """`import … . --overwrite` inside a store ended in a traceback (renaming `.` failed: Device or resource busy)."""
    for made in range(2):
        with staged(tmp_path / "store" if made == 0 else Path("."), overwrite=made == 1) as stage:
            write_manifest(stage, {"format": "shardflow.dataset", "format_version": 1, "made": made})
        monkeypatch.chdir(tmp_path / "store")
    assert '"made": 1' in (tmp_path / "store" / "manifest.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_a_store_moved_aside_goes_back_when_the_new_one_cannot_be_renamed_in(tmp_path, monkeypatch):
    """The old store was left at `.store.replaced-*`, the destination empty, for a later sweep to delete."""
    with staged(tmp_path / "store", overwrite=False) as stage:
        write_manifest(stage, {"format": "shardflow.dataset", "format_version": 1, "made": 0})

    def refused(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(src))

    monkeypatch.setattr(os, "rename", refused)
    with pytest.raises(PermissionError):
        with staged(tmp_path / "store", overwrite=True) as stage:
            write_manifest(stage, {"format": "shardflow.dataset", "format_version": 1, "made": 1})
    assert '"made": 0' in (tmp_path / "store" / "manifest.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
