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


def scatter_add(xp, target, index, values) -> None:
    """target[index] += values, adding repeated indices up."""
    if xp is np:
        np.add.at(target, index, values)
    else:
        import cupyx

        cupyx.scatter_add(target, index, values)


def to_host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def to_device(xp, x):
    return x if xp is np else xp.asarray(x)
