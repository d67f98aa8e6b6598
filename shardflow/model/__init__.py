"""The models in PyTorch (sequence: the sequence recommender; dlrm: the click-log DLRM), their optimisers
(optim) and quality metrics (metrics); their configs without PyTorch (configs, sizes). Pure: no Dask, Prefect or
zarr."""
