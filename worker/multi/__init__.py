"""Several LoRA jobs of one base model trained together in one worker (issue 16).

One frozen base stays resident; each job is a named adapter on it. A shared
forward runs every row through the base once and adds, per contiguous
segment of rows (rows are sorted by job), that job's own low-rank path
(`lora.SegmentRouter`). Sampling (`rollout`, decoded by
worker/rollout/decode.py's `sample_jobs`) and the update
(`update`) use it, so several jobs cost one pass over the base weights per
decode step or micro-batch instead of one each. The adapters are disjoint,
so summing the jobs' losses (each normalised by its own token count) gives
each adapter exactly its own job's gradient; clipping, optimizer and
learning-rate schedule stay per job. `cycle` advances every resident job by
one trainer step.
"""
