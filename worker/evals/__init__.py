"""Evaluation as evidence: confidence intervals (intervals.py) and eval runs of a model on a file (runner.py)."""
