"""Multi-process training helpers: FSDP2 (torch.distributed.fsdp.fully_shard); started by worker/torchrun/.

group.py     who am I (rank, world size) and the few collectives the trainer needs
shard.py     sharding a model, and unsharding it for generation and no-grad scoring
state.py     whole state dicts gathered from the shards (checkpoints) and spread back (resume)

With one process none of this runs: every helper falls back to the local value.
"""
