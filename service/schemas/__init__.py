"""Public schemas shared by the API and the worker (torch-free)."""

from service.schemas.job_spec import JobSpec

__all__ = ["JobSpec"]
