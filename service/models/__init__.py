"""Models on the API side: which base models a job may name, their dry-run check, and fine-tuned models."""
