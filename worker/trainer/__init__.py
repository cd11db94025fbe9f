"""The CISPO training loop for LoRA adapters, one process (CPU or one GPU)."""
