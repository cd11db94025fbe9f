"""Embedded state readable by its owner only.

The SQLite database (API keys' hashes, every tenant's jobs and secrets' ciphertext), the broker file and
the local object store (datasets, adapters) hold every project's data; on a shared machine a 0644 file
or a 0755 directory would hand them to any local user. Files are created 0600 and directories 0700, and
ones an older version left wider are narrowed when we own them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def _narrow(path: Path, mode: int) -> None:
    info = path.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & ~mode:
        path.chmod(stat.S_IMODE(info.st_mode) & mode)


def private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) 0700, or narrow it to 0700 if it exists and is ours."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    _narrow(path, DIR_MODE)
    return path


def private_file(path: Path) -> Path:
    """Create an empty `path` 0600 unless it exists (SQLite takes an empty file as an empty database and
    gives its -wal and -shm files the database's mode), then narrow it and its siblings to 0600."""
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE))
    for each in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm"),
                 path.with_name(path.name + "-journal")):
        if each.exists():
            _narrow(each, FILE_MODE)
    return path


def sqlite_file(url: str) -> Path | None:
    """The file a sqlite:/// (or sqla+sqlite:///) URL names; None for memory databases and other URLs."""
    for prefix in ("sqlite:///", "sqla+sqlite:///", "sqlite+pysqlite:///"):
        if url.startswith(prefix):
            path = url[len(prefix):].split("?", 1)[0]
            return Path(path) if path and path != ":memory:" else None
    return None
