"""The serving channel: request queues per base model, a reply list per request, and worker presence.

Two transports, one contract: Redis lists (BLPOP) when the broker is Redis,
and tables in a SQLite file under CISPO_HOME on the embedded default, where
`cispo up` runs without servers. Every message has a time to live, so a
request nobody took, or a reply nobody read, does not stay behind.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Protocol

from service.private_paths import private_file
from service.settings import Settings

ANY_BASE = "*"  # the queue of workers that load whichever base a request names
PREFIX = "cispo:serve"


def request_queue(base: str) -> str:
    return f"{PREFIX}:q:{_slug(base)}"


def presence_key(base: str) -> str:
    return f"{PREFIX}:alive:{_slug(base)}"


def cancel_key(reply: str) -> str:
    """Set (as a presence mark) when the caller of the request answered on `reply` hung up: the worker stops
    decoding it at its next token."""
    return f"{reply}:cancel"


def _slug(base: str) -> str:
    # A hash, not the name: base names are paths or hub ids of any length and alphabet.
    return "any" if base == ANY_BASE else hashlib.sha256(base.encode()).hexdigest()[:24]


class Channel(Protocol):
    def push(self, key: str, message: dict, ttl_s: float) -> None: ...

    def push_many(self, messages: list[tuple[str, dict]], ttl_s: float) -> None: ...

    def pop(self, keys: list[str], timeout_s: float) -> tuple[str, dict] | None: ...

    def mark_alive(self, key: str, ttl_s: float) -> None: ...

    def alive(self, key: str) -> bool: ...

    def alive_many(self, keys: list[str]) -> list[bool]: ...


class RedisChannel:
    def __init__(self, url: str, timeout_s: float):
        import redis

        # The socket timeout must outlast a BLPOP's own wait; a stalled Redis still fails within it.
        self.redis = redis.Redis.from_url(url, socket_connect_timeout=timeout_s,
                                          socket_timeout=timeout_s + 30)

    def push(self, key: str, message: dict, ttl_s: float) -> None:
        with self.redis.pipeline() as p:
            p.rpush(key, json.dumps(message))
            p.pexpire(key, int(ttl_s * 1000))
            p.execute()

    def push_many(self, messages: list[tuple[str, dict]], ttl_s: float) -> None:
        """push() of each (key, message), in order, in one round trip (a serving worker's replies of a step)."""
        with self.redis.pipeline(transaction=False) as p:
            for key, message in messages:
                p.rpush(key, json.dumps(message))
            for key in dict.fromkeys(key for key, _ in messages):
                p.pexpire(key, int(ttl_s * 1000))
            p.execute()

    def pop(self, keys: list[str], timeout_s: float) -> tuple[str, dict] | None:
        got = self.redis.blpop(keys, timeout=max(timeout_s, 0.01))
        return None if got is None else (got[0].decode(), json.loads(got[1]))

    def mark_alive(self, key: str, ttl_s: float) -> None:
        self.redis.set(key, "1", px=int(ttl_s * 1000))

    def alive(self, key: str) -> bool:
        return bool(self.redis.exists(key))

    def alive_many(self, keys: list[str]) -> list[bool]:
        """alive() of each key, in one round trip (a serving worker looks at every request's cancel mark a step)."""
        with self.redis.pipeline(transaction=False) as p:
            for key in keys:
                p.exists(key)
            return [bool(n) for n in p.execute()]


class SqliteChannel:
    """The same lists as rows of one table, polled: the embedded default's single machine."""

    POLL_S = 0.01

    def __init__(self, path: Path):
        self.path = str(private_file(path))  # the queued prompts and answers of every tenant: 0600
        with closing(self._connect()) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS messages (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                       "key TEXT NOT NULL, body TEXT NOT NULL, expires REAL NOT NULL)")
            db.execute("CREATE INDEX IF NOT EXISTS messages_key ON messages (key, id)")
            db.execute("CREATE TABLE IF NOT EXISTS alive (key TEXT PRIMARY KEY, expires REAL NOT NULL)")

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10, isolation_level=None)

    def push(self, key: str, message: dict, ttl_s: float) -> None:
        with closing(self._connect()) as db:
            db.execute("INSERT INTO messages (key, body, expires) VALUES (?, ?, ?)",
                       (key, json.dumps(message), time.time() + ttl_s))

    def push_many(self, messages: list[tuple[str, dict]], ttl_s: float) -> None:
        expires = time.time() + ttl_s
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            db.executemany("INSERT INTO messages (key, body, expires) VALUES (?, ?, ?)",
                           [(key, json.dumps(message), expires) for key, message in messages])
            db.execute("COMMIT")

    def pop(self, keys: list[str], timeout_s: float) -> tuple[str, dict] | None:
        deadline = time.monotonic() + timeout_s
        marks = ",".join("?" * len(keys))
        db = self._connect()
        try:
            while True:
                db.execute("BEGIN IMMEDIATE")
                db.execute("DELETE FROM messages WHERE expires < ?", (time.time(),))
                row = db.execute(f"SELECT id, key, body FROM messages WHERE key IN ({marks}) ORDER BY id LIMIT 1",
                                 keys).fetchone()
                if row is not None:
                    db.execute("DELETE FROM messages WHERE id = ?", (row[0],))
                db.execute("COMMIT")
                if row is not None:
                    return row[1], json.loads(row[2])
                if time.monotonic() >= deadline:
                    return None
                time.sleep(self.POLL_S)
        finally:
            db.close()

    def mark_alive(self, key: str, ttl_s: float) -> None:
        with closing(self._connect()) as db:
            db.execute("INSERT OR REPLACE INTO alive (key, expires) VALUES (?, ?)", (key, time.time() + ttl_s))

    def alive(self, key: str) -> bool:
        with closing(self._connect()) as db:
            return db.execute("SELECT 1 FROM alive WHERE key = ? AND expires > ?", (key, time.time())).fetchone() \
                is not None

    def alive_many(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        with closing(self._connect()) as db:
            found = {k for (k,) in db.execute(f"SELECT key FROM alive WHERE key IN ({','.join('?' * len(keys))}) "
                                                "AND expires > ?", (*keys, time.time()))}
        return [k in found for k in keys]


def open_channel(settings: Settings) -> Channel:
    broker = settings.resolved_broker_url()
    if broker.startswith(("redis://", "rediss://")):
        return RedisChannel(broker, settings.broker_timeout_s)
    return SqliteChannel(settings.home.resolve() / "serve.db")
