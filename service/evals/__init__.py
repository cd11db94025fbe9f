"""Evaluation runs: the request shape (request.py) and creating, listing and reading runs (runs.py)."""
