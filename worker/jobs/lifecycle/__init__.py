"""The life of one run, in steps shared by every runner: a job alone (worker/jobs/job_runner.py), a resident job on
a shared base (worker/multi/runner.py) and an eval run (worker/jobs/eval_runner.py).

start.py     the claim under a lease, the secrets, the reporter, the inputs on local disk
failures.py  how a run that raised ends: lost, cancelled, or failed with a code that says whether to retry
end.py       how a job's run ends: its outcome, recorded (fenced), its next run queued, its scratch removed
"""
