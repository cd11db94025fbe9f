"""Engine and session factories for PostgreSQL (psycopg 3) or the embedded SQLite file.

Two kinds of session share one engine: the default (reads and writes) and a
read-only one for GET routes. On SQLite the difference matters: a writing
transaction takes the write lock at BEGIN (BEGIN IMMEDIATE, so read-then-write
cannot deadlock), while a read-only one uses a plain deferred BEGIN and, in WAL
mode, never waits for the writer nor makes the writer (the trainer) wait. So
hundreds of pollers do not stall training.
"""

from __future__ import annotations

import os
import weakref
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from service.private_paths import private_file, sqlite_file

READ_ONLY = "cispo_read_only"  # an execution option: this connection never writes


def make_engine(url: str, *, pool_size: int = 5, max_connections: int = 15) -> Engine:
    # A connection waits for a free pool slot at most this long: a bounded wait, never a hang.
    pool = {"pool_size": pool_size, "max_overflow": max(0, max_connections - pool_size), "pool_timeout": 30}
    if url.startswith("sqlite"):
        if (path := sqlite_file(url)) is not None:
            private_file(path)  # before SQLite creates it 0644
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, **pool)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            # In WAL mode NORMAL syncs at checkpoints, not at every commit: a commit stays durable when a process
            # dies (the API, a worker) and may be lost only to a power cut or an OS crash, for 0.05 ms a commit
            # instead of one fsync (4.5 ms on this disk), which every job event, metric and Tinker call pays.
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):
            conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")

        return engine
    # A bounded connect, so /readyz and workers fail fast instead of hanging on an unreachable server.
    return create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 5}, **pool)


_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@lru_cache
def _engine(url: str, pool_size: int, max_connections: int) -> Engine:
    engine = make_engine(url, pool_size=pool_size, max_connections=max_connections)
    _engines.add(engine)
    return engine


@lru_cache
def session_factory(url: str, *, pool_size: int = 5, max_connections: int = 15) -> sessionmaker[Session]:
    return sessionmaker(_engine(url, pool_size, max_connections), expire_on_commit=False)


@lru_cache
def read_session_factory(url: str, *, pool_size: int = 5, max_connections: int = 15) -> sessionmaker[Session]:
    """Sessions that only read (same pool): on SQLite they never take the write lock."""
    engine = _engine(url, pool_size, max_connections).execution_options(**{READ_ONLY: True})
    return sessionmaker(engine, expire_on_commit=False)


def _forget_inherited_connections() -> None:
    """In a forked child (a Celery prefork worker): give every engine a fresh pool. The pooled
    connections are the parent's sockets; using them from two processes corrupts the protocol
    stream, and closing them here would close the parent's, so they are dropped unclosed."""
    for engine in list(_engines):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_inherited_connections)
