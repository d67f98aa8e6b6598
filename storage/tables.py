"""Table specs: what an embedding table is, independent of where it lives."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from shardflow.errors import InputError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
INT32_MAX_ROWS = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: a name and its row count (ids are 0 <= id < rows)."""

    name: str
    rows: int

    def __post_init__(self) -> None:
        parse_table_name(self.name)
        if isinstance(self.rows, bool) or not isinstance(self.rows, (int, np.integer)) or self.rows < 1:
            raise InputError(f"table '{self.name}': rows = {self.rows!r}; accepted: an integer >= 1")
        object.__setattr__(self, "rows", int(self.rows))

    @property
    def id_dtype(self) -> np.dtype:
        """The narrowest id dtype that holds every row of this table."""
        return np.dtype(np.int32) if self.rows <= INT32_MAX_ROWS else np.dtype(np.int64)


def parse_table_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InputError(
            f"table name {name!r} is not accepted; accepted: letters, digits, '_', '.', '-' "
            "starting with a letter or digit"
        )
    return name
