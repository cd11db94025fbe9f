"""Running jobs and eval runs: the runners, the steps of a run (lifecycle/), its reporter, evidence and lease
heartbeat, graceful drain, the reconciler, eval turns, result files and progress."""
