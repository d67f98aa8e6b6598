"""The training data of each workload, read from a dataset store: examples, batches and their held-out
targets (batches: sequences; clicks: click logs), and the seeded synthetic logs."""
