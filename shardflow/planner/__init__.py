"""The sharding planner: profile + topology + budget -> a plan for every row, and its cost. Pure: no Dask,
Prefect or zarr (the stage over stores is shardflow.sharding).

One module per role, so the file list reads as the pipeline:
    topology       the cluster: nodes, devices, link speeds (validated YAML)
    access         what the profile says about lookups: per-row probabilities, in classes
    sharding_plan  ShardingPlan: tier and home of every row, memory per device
    memory         a device's budget, whether the tables fit, a worker's peak
    costmodel      expected bytes per step between every pair of devices, and the time
    relaxation     the fractional tier choice: FlexShard's tiers and the lower bound
    placement      where single-copy and replicated rows live
    copies         which nodes hold a copy of the hottest rows
    refine         moves and swaps of the hottest single rows that lower the modeled time
    exact          the cost model's exact optimum on small instances (a check on the heuristics)
    strategies     table-wise, row-wise-mod, row-wise-block, flexshard: one protocol
    estimation     Caffe2-style estimation: every table on one parameter server, scaled to fit
    shardmap       global id <-> (device, local row), vectorised both ways
    report         the figures a plan is judged by: memory, traffic, modeled time, the bound
"""
