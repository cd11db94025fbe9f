"""Jobs larger than one machine: the claiming Celery worker drives them on a Ray cluster.

entry.py       run_on_ray_cluster: the job runner's and `cispo train`'s door (the deployment check, then Ray)
driver.py      run_on_ray: reserve the gang, start one actor per rank, relay rank 0's callbacks, clean up
cluster.py     connecting to the cluster, the placement group (all GPUs at once, or GangUnavailable), release
rank_actor.py  the Ray actor of one rank: today's FSDP2 Trainer under torchrun's environment variables
sampler_actor.py  asynchronous rollouts: the sampler as a Ray actor of its own, fed numbered versions by rank 0
layout.py      who is which rank: torchrun's variables (RANK, LOCAL_RANK, MASTER_ADDR...) from where actors landed
files.py       the job's files (dataset, warm start, checkpoints) as bytes: no shared filesystem is assumed
errors.py      the cluster's failures (no gang, a node lost): the job waits them out using no attempt

The Celery side keeps everything it has (lease, heartbeat, epoch fencing,
cancel/pause/drain at step boundaries, retries): Ray only runs the ranks (and
an asynchronous job's sampler).
Every object-store and SQL write stays in the driver, fenced by its epoch;
the ranks never hold the store's credentials. The actors and the placement
group belong to the driver's Ray job, so they die with it (Ray's fate
sharing): a driver that dies leaves nothing running, and the worker that
takes the lease after it (a higher epoch) starts the Ray job again.
"""
