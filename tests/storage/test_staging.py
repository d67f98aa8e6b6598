import pytest

from shardflow.errors import InputError
from storage.staging import check_apart


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
