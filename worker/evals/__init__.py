"""Evaluation as evidence: confidence intervals (intervals.py; pure numpy, used by the trainer's evals and by
worker/jobs/eval_runner.py)."""
