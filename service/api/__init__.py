"""The HTTP API (FastAPI): routes, dependencies, error envelope, body limits. See app.create_app."""
