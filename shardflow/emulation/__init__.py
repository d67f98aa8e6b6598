"""An emulated multi-host cluster on one Linux machine: network namespaces, shaped links, real Dask processes.

`python -m shardflow.emulation --help` builds one from a topology file and runs a command in it.
"""
