"""Stage 3, training on Dask: a job from a dataset and a plan (run), the engine and its roles (engine, actor,
transport, persistence), one device (device, shard, protocol) and evaluation."""
