"""The models in PyTorch (sequence: the sequence recommender; dlrm: the click-log DLRM), their optimisers
(optim) and quality metrics (metrics). Pure: no Dask, Prefect or zarr."""
