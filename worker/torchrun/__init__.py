"""Running a job's Trainer in several processes under torchrun (above the trainer; the helpers it shards
with are in worker/distributed/).

launch.py    the job-runner side: starts torchrun for a job and relays rank 0's callbacks
rank.py      the rank side: joins the process group and runs the ordinary Trainer
"""
