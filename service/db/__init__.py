"""Persistence: ORM models, the engine/session factory, repositories and migrations."""
