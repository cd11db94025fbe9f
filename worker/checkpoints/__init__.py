"""Checkpoints: the directory format with its sha256 manifest (checkpoint.py) and its transfer to and from the
object store (artifacts.py)."""
