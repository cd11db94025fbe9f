from tests.worker.trainer.conftest import lora_model  # noqa: F401  (the tiny LoRA model the trainer tests use too)
