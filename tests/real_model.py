"""What the tests ask the real model (tests/conftest.py's real_model_dir: SmolLM2-135M-Instruct, built from its
wheel); its job spec is tests/specs.py's real_spec."""

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
