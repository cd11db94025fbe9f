"""The service side of the `cispo` command: database, keys, the API server, the embedded stack (main) and the jobs client (jobs)."""
