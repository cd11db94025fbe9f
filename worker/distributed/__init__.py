"""Multi-process training: FSDP2 (torch.distributed.fsdp.fully_shard) under torchrun.

launch.py    the job-runner side: starts torchrun for a job and relays rank 0's callbacks
rank.py      the rank side: joins the process group and runs the ordinary Trainer
group.py     who am I (rank, world size) and the few collectives the trainer needs
shard.py     sharding a model, and unsharding it for generation and no-grad scoring
state.py     whole state dicts gathered from the shards (checkpoints) and spread back (resume)

With one process none of this runs: every helper falls back to the local value.
"""
