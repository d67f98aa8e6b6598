"""The sharding planner: profile + topology + budget -> a plan for every row, and its cost.

One module per role, so the file list reads as the pipeline:
    topology    the cluster: nodes, devices, link speeds (validated YAML)
    access      what the profile says about lookups: per-row probabilities, in classes
    plan        ShardingPlan: tier and home of every row, memory per device
    costmodel   expected bytes per step between every pair of devices, and the time
    relaxation  the fractional tier choice: FlexShard's tiers and the lower bound
    placement   where single-copy and replicated rows live
    strategies  table-wise, row-wise-mod, row-wise-block, flexshard: one protocol
    shardmap    global id <-> (device, local row), vectorised both ways
"""
