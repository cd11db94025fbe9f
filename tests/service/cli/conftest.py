from tests.service.api.conftest import api  # noqa: F401  (the real app over a real database, as the API tests use it)
