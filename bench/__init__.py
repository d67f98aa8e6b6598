"""Benchmarks that print tables: run as scripts (python bench/NAME.py)."""
