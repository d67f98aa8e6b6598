"""Stage 1, frequency profiling: per-row access counts of every table, over the dataset's chunks in parallel
on Dask (profiles), with the counting kernels (counting)."""
