"""Public schemas shared by the API and the worker (torch-free). What a job is: service/job_spec/."""
