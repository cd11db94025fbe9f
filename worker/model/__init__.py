"""The model and what is fed to it, shared by the trainer, the rollout engines and serving (imports neither).

policy.py        the policy: base + LoRA adapter or every weight, its tokenizer, its reference; loading
precision.py     the compute dtype and float32 master weights
quantization.py  QLoRA's 4-bit base (bitsandbytes)
turns.py         chat turns as token ids (a sampled action is never re-tokenized)
streams.py       random streams keyed by purpose (sampling seeds, mini-batch shuffles), never by process
"""
