"""Stage 2, sharding: a profile and a topology become a plan store (stage), the cost model's distinct rows
fitted to real batches (touch). The planner's pure core is shardflow.planner."""
