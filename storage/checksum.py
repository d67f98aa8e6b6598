"""Content checksums: what a store holds, independent of chunking and compression.

Each array is hashed as its name, dtype, shape and values in order (little-endian),
fed block by block while it is written, so a 10^8-id column is never hashed from
one buffer. The store's checksum combines the arrays' digests in name order.
"""

from __future__ import annotations

import hashlib

import numpy as np


class ArrayHash:
    """sha256 of one array's logical content, fed in order."""

    def __init__(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self._dtype = np.dtype(dtype)
        self._h = hashlib.sha256(f"{name}|{self._dtype.str}|{tuple(shape)}|".encode())

    def update(self, block: np.ndarray) -> None:
        if self._dtype.kind in "TUO":
            for value in np.asarray(block).ravel().tolist():
                encoded = str(value).encode()
                self._h.update(len(encoded).to_bytes(8, "little") + encoded)
        else:
            self._h.update(np.ascontiguousarray(block, dtype=self._dtype.newbyteorder("<")).data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def combine(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}={digests[name]}\n".encode())
    return "sha256:" + h.hexdigest()


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()
