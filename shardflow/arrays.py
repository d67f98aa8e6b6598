"""The array module a device computes with: numpy on `cpu`, CuPy on `cuda`.

Model, optimizers and shards take `xp` and never import either directly, so the same
code runs on both. Arrays cross the wire as numpy (to_host); a CUDA shard moves them
onto its GPU on arrival (to_device).
"""

from __future__ import annotations

import numpy as np

from shardflow.errors import InputError

DEVICES = ("cpu", "cuda")


def array_module(device: str):
    if device not in DEVICES:
        raise InputError(f"device {device!r}; accepted: {', '.join(DEVICES)}")
    if device == "cpu":
        return np
    try:
        import cupy
    except ImportError:
        raise InputError("device 'cuda' needs CuPy (pip install cupy-cuda12x); accepted here: cpu") from None
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise InputError("device 'cuda': no CUDA device is visible; accepted here: cpu")
    return cupy


def sparse_module(xp):
    """scipy.sparse for numpy, cupyx.scipy.sparse for CuPy."""
    if xp is np:
        import scipy.sparse

        return scipy.sparse
    import cupyx.scipy.sparse

    return cupyx.scipy.sparse


def sparse_matrix(xp, data, row, col, shape: tuple[int, int]):
    """A CSR matrix from coordinates; repeated coordinates add up."""
    return sparse_module(xp).csr_matrix((data, (row, col)), shape=shape)


def scatter_add(xp, target, index, values) -> None:
    """target[index] += values, adding repeated indices up, in a deterministic order.

    As the sparse product S @ values with S[index[i], i] = 1: an order of magnitude
    faster than np.add.at on rows of floats, and the same code on CuPy.
    """
    n = int(index.size)
    if n:
        ones = xp.ones(n, dtype=target.dtype)
        target += sparse_matrix(xp, ones, index, xp.arange(n), (target.shape[0], n)) @ values


def to_host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def to_device(xp, x):
    return x if xp is np else xp.asarray(x)
