"""Prefect tasks: thin adapters that take parameters, call the core and hand I/O to storage/."""
