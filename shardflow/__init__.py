"""shardflow core: importable without Prefect.

Profiling kernels, training-example construction, synthetic data and (in later
stages) topology, sharding plans, cost model and model math live here.
"""

from shardflow.errors import InputError

__all__ = ["InputError"]
__version__ = "0.1.0"
