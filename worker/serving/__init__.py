"""The serving worker (`cispo serve`): keeps base models resident, hot-loads LoRA adapters, streams completions."""
