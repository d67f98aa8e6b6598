"""A run_dir's version records without training: the current link, an operator's rollback, cut-off writes."""

from __future__ import annotations

import os

import pytest

from shardflow.config import RetrainConfig
from shardflow.errors import InputError
from storage import versions
from storage.dataset import Dataset
from support import REAL, version_start


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


@pytest.mark.parametrize("reason, shown", [("x" * 501, "of 501 characters"), ("a\nb", "'a\\nb'"), (" ", "' '"),
                                           ("", "''")])
def test_a_rollback_s_reason_is_one_line_of_at_most_500_characters_or_nothing_is_promoted(run, reason, shown):
    """5,000 characters were recorded, and a newline split the CLI's one line."""
    with pytest.raises(InputError) as refused:
        versions.rollback(run, 1, reason)
    assert str(refused.value) == f"reason {shown}; accepted: one line of 1 to 500 printable characters"
    assert versions.current(run) == 3 and versions.promotions(run) == []
    with pytest.raises(InputError, match=r"versions/0001/model: no manifest.json"):  # 500: past the reason's check
        versions.rollback(run, 1, "x" * 500)


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


def test_before_any_version_finished_a_promotion_says_none_has(tmp_path):
    versions.start(tmp_path, version_start(1, segments=("1",)))  # the first night, still running or cut off
    with pytest.raises(InputError) as refused:
        versions.promote_by_operator(tmp_path, 1, "x")
    assert str(refused.value) == (f"version 1 of {tmp_path} is not a finished model version; accepted: a finished "
                                  "version, and none has finished yet")


@pytest.mark.parametrize("target", ["versions/0009", "somewhere/else", "versions/0004", "versions/abcd"])
def test_a_dangling_or_garbage_current_link_is_one_line_naming_the_mend(run, target):
    (run / versions.CURRENT).unlink()
    (run / versions.CURRENT).symlink_to(target)
    with pytest.raises(InputError, match=rf"current points at '{target}', not a finished model version; accepted: "
                                         rf"a link to one, made by shardflow promote .* --version N \(finished "
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


@pytest.mark.parametrize("entry", ["run.lock", "dataset", "versions", "current", "dask-workers.log", "estimate"])
def test_a_directory_holding_anything_a_run_writes_is_a_run_dir_and_one_of_other_files_is_not(tmp_path, entry):
    assert versions.other_contents(tmp_path / "new") == [] and versions.other_contents(tmp_path) == []
    (tmp_path / "notes.txt").write_text("mine")
    assert versions.other_contents(tmp_path) == ["notes.txt"]
    if entry == "current":  # a dangling link a cut-off promotion left is the run's too
        os.symlink("versions/0007", tmp_path / entry)
    else:
        (tmp_path / entry).touch()
    assert versions.other_contents(tmp_path) == []


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


def test_a_version_exported_before_a_model_key_existed_is_taken_to_have_its_default(tmp_path):
    """A run_dir promoted by an older shardflow, whose export's model record lacks newer keys (bottom, encoder,
    blocks, heads, dropout, item_dropout; the dense and row optimisers) and holds a retired one (candidate_dropout),
    warm-starts a run that keeps their defaults, and refuses one that changes what shapes the model, naming both
    values; settings that shape nothing pass."""
    from shardflow.data.clicks import config_from_record, config_record, model_config
    from shardflow.preflight import check_model_shape
    from storage.checkpoint import sealed
    from storage.importers import import_dataset
    from storage.manifest import write_manifest

    cfg = RetrainConfig(run_dir=str(tmp_path), encoder="mean", loss="bce", row_optimizer="adagrad")  # as then
    import_dataset("sasrec", REAL["sasrec"], tmp_path / "dataset")
    m = cfg.model
    model = model_config(Dataset.open(tmp_path / "dataset"), dim=m.dim, mlp=m.mlp, bottom=m.bottom_mlp,
                         history=m.history, negatives=m.negatives, seed=cfg.train.seed)
    newer = ("encoder", "blocks", "heads", "dropout", "item_dropout")
    older = {**{k: v for k, v in config_record(model).items() if k not in newer}, "candidate_dropout": 0.2}
    assert config_from_record({**config_record(model), "candidate_dropout": 0.2}) == model
    versions.start(tmp_path, version_start(1))
    (versions.version_dir(tmp_path, 1) / "model").mkdir()
    write_manifest(versions.version_dir(tmp_path, 1) / "model", {  # as that shardflow wrote it: no optimizers named
        "format": "shardflow.model", "format_version": 1, "tables": {}, "dim": m.dim, "model": older, "chunk_rows": 1,
        "dense_steps": 0, **sealed({})})
    versions.finish(tmp_path, 1, {"promoted": True})
    versions.promote(tmp_path, 1)
    check_model_shape(cfg)

    def changed(**keys) -> RetrainConfig:
        return RetrainConfig.build({**cfg.flat(), **keys})

    with pytest.raises(InputError, match=r"has mlp = \[64, 32\], this run mlp = \[32\]"):
        check_model_shape(changed(mlp=(32,)))
    # Its model had the mean encoder: another is refused; the attention's settings shape no mean model.
    with pytest.raises(InputError, match=r"'mean', this run attention_blocks = 1, encoder = 'self-attention'"):
        check_model_shape(changed(encoder="self-attention"))
    with pytest.raises(InputError, match=r"has dense_optimizer = 'adam', this run dense_optimizer = 'adagrad'"):
        check_model_shape(changed(dense_optimizer="adagrad"))
    # Its manifest names no row optimizer either: Adagrad's sums, the only rows' state there was.
    with pytest.raises(InputError, match=r"has row_optimizer = 'adagrad', this run row_optimizer = 'adam'"):
        check_model_shape(changed(row_optimizer="adam"))
    check_model_shape(changed(attention_blocks=5, dropout=0.3, item_dropout=0.1, seed=7))
    # Today's defaults train another model: a run that leaves them out is refused, naming each.
    with pytest.raises(InputError, match=r"has attention_blocks = 2, encoder = 'mean', row_optimizer = 'adagrad', "
                       r"this run attention_blocks = 1, encoder = 'self-attention', row_optimizer = 'adam'"):
        check_model_shape(RetrainConfig(run_dir=str(tmp_path)))
    check_model_shape(changed(bottom_mlp=(32,)))  # a sequence model has no bottom MLP


def test_the_parts_a_version_added_are_those_no_earlier_version_had_whichever_run_imported_them(tmp_path):
    """A version cut off and made again by a later run (whose import found nothing new) names the parts it is the
    first to train on, as the uninterrupted run that imported them would have."""
    for n, parts in ((1, ("day-1", "day-2")), (2, ("day-1", "day-2", "day-3")), (3, ("day-1", "day-2", "day-3"))):
        versions.start(tmp_path, version_start(n, parts=parts))
    assert [versions.new_parts(tmp_path, versions.started(tmp_path, n)) for n in (1, 2, 3)] == [
        ("day-1", "day-2"), ("day-3",), ()]
    again = version_start(2, parts=("day-1", "day-2", "day-3"))  # version 2 started again by the next run
    assert versions.new_parts(tmp_path, again) == ("day-3",)
