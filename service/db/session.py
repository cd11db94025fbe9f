"""Engine and session factory for PostgreSQL (psycopg 3) or the embedded SQLite file."""

from __future__ import annotations

import os
import weakref
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # One writer at a time: wait for the lock instead of failing at once, and
        # take it at BEGIN so a read-then-write transaction cannot deadlock.
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # A bounded connect, so /readyz and workers fail fast instead of hanging on an unreachable server.
    return create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 5})


_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@lru_cache
def session_factory(url: str) -> sessionmaker[Session]:
    engine = make_engine(url)
    _engines.add(engine)
    return sessionmaker(engine, expire_on_commit=False)


def _forget_inherited_connections() -> None:
    """In a forked child (a Celery prefork worker): give every engine a fresh pool. The pooled
    connections are the parent's sockets; using them from two processes corrupts the protocol
    stream, and closing them here would close the parent's, so they are dropped unclosed."""
    for engine in list(_engines):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_inherited_connections)
