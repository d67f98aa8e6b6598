"""shardflow core: importable without Prefect.

Every stage's logic lives here: profiling, the sharding planner and the plan
stage, training on Dask, the models and their metrics, promotion and reporting.
"""

from shardflow.errors import InputError

__all__ = ["InputError"]
__version__ = "0.1.0"
