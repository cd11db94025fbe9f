"""Telling the outside how a job goes: W&B and MLflow trackers, TensorBoard event files, webhooks."""
