"""Prefect flows: read top to bottom like a retraining run; no logic of their own."""
