"""The published formats, parsed block by block by pyarrow's CSV reader.

Each format turns one block of whole lines (storage.sources.Block) into columns:
the users of the block's runs, one column per table, the numeric columns, labels and
time stamps. Nothing is done per line or per token in Python on this path; arrow's C++
reader converts the text and numpy does the rest. Only when arrow refuses a block is it
read again line by line (`diagnose`) to name the first bad line and what is accepted.

Formats (see data/README.md for the files they come from):
    sasrec   `user item` per line, a user's lines in time order (SASRec's data/*.txt)
    s3rec    `user i1 i2 ...`, one user per line in time order (S3-Rec / ICLRec)
    recbole  RecBole's atomic `.inter` file: tab-separated, typed header `name:type`; a sequence
             log, or with a click label (`rating>=4`) a click log whose examples are the
             interactions in time order, joined by id with RecBole's `.user` and `.item`
             feature files where they are given (`read_features`)
    criteo   Criteo display-ads CSV/TSV: label, I1..I13 integers, C1..C26 hashed categoricals;
             or Avazu's CSV: id, click (the label), hour (YYMMDDHH: its hour of day is a
             categorical `hour`), every other column a hashed categorical, id dropped

Numeric ids (sasrec, s3rec) are ASCII decimal digits only, at most 18 of them, no leading zero
(one spelling per id: `007` would read as the row of `7`); recbole tokens and criteo categoricals
are text, their spellings kept as they are.
"""

from __future__ import annotations

from shardflow.errors import InputError
from storage.formats.base import Columns, Format, diagnose, runs_of
from storage.formats.criteo import Criteo
from storage.formats.recbole import FEATURE_FILES, FeatureFile, Recbole, feature_files, parse_click_label, read_features
from storage.formats.sequences import S3rec, Sasrec

__all__ = ["FEATURE_FILES", "FORMATS", "Columns", "Criteo", "FeatureFile", "Format", "Recbole", "S3rec", "Sasrec",
           "diagnose", "feature_files", "make_format", "parse_click_label", "read_features", "runs_of",
           "sniff_delimiter"]

FORMATS = ("sasrec", "s3rec", "recbole", "criteo")


def make_format(name: str, label: str | None = None) -> Format:
    """The parser of format `name`; `label`: recbole's click label (a click log), None for the others."""
    if name not in FORMATS:
        raise InputError(f"format {name!r} is not known; accepted: {', '.join(FORMATS)}")
    if name == "recbole":
        return Recbole(label)
    return {"sasrec": Sasrec, "s3rec": S3rec, "criteo": Criteo}[name]()


def sniff_delimiter(fmt: Format, first_line: bytes) -> None:
    """sasrec files separate user and item by a space or a tab: whichever the first line uses."""
    if isinstance(fmt, Sasrec):
        fmt.delimiter = "\t" if b"\t" in first_line and b" " not in first_line.strip() else " "
