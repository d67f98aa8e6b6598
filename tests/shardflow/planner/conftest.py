import numpy as np

from shardflow.planner.access import TableAccess


def zipf_access(name: str, rows: int, alpha: float, lookups: float = 8.0, seed: int = 0) -> TableAccess:
    """Expected Zipf counts (out of 10^7 accesses) on a seeded random permutation of the rows."""
    w = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    counts = np.round(w / w.sum() * 1e7).astype(np.int64)
    return TableAccess.from_counts(name, np.random.default_rng(seed).permutation(counts), lookups)
