"""What a job is, in one place (torch-free, shared by the API and the worker).

- spec.py: JobSpec, the resolved job the worker runs, with every bound it relies on.
- request.py: JobCreate, the body of POST /v1/fine_tuning/jobs (OpenAI's shape, with our `cispo` method).
- build.py: build_spec, the one function mapping a request onto a JobSpec (errors name the request's fields).
"""
