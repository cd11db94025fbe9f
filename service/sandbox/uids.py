"""A distinct uid for each live sandbox, leased from the configured range, host-wide.

Two sandboxes never share a uid, so RLIMIT_NPROC, the per-uid keyring and
/proc access checks separate them, even across worker processes on one host:
a lease is an exclusive flock on LEASE_DIR/<uid>, which the kernel drops when
the holder closes it or dies. gid = uid (no passwd entry is needed or used).

    with lease_uid(first=100000, count=1000) as uid:  # raises NoUidFree when all are taken
        ...
"""

from __future__ import annotations

import fcntl
import os
import random
from pathlib import Path


class NoUidFree(RuntimeError):
    """Every uid of the range belongs to a live sandbox."""


def lease_dir() -> Path:
    """Host-wide (not per process) and unreachable from a sandbox: /run where it is writable, else /tmp."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path("/tmp")
    return base / "cispo-sandbox-uids"


class UidLease:
    """An exclusive hold on one uid until release() (idempotent) or this process's end."""

    def __init__(self, uid: int, fd: int):
        self.uid, self._fd = uid, fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # drops the flock

    def __enter__(self) -> int:
        return self.uid

    def __exit__(self, *exc) -> None:
        self.release()


def lease_uid(first: int, count: int) -> UidLease:
    """A uid of [first, first + count) that no other live sandbox holds (starting at a random one)."""
    if first < 1 or count < 1:
        raise ValueError("the sandbox uid range must start above 0 and hold at least one uid")
    root = lease_dir()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    start = random.randrange(count)  # spreads concurrent spawners over the range
    for i in range(count):
        uid = first + (start + i) % count
        fd = os.open(root / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # per open file: conflicts within a process too
        except BlockingIOError:
            os.close(fd)
            continue
        return UidLease(uid, fd)
    raise NoUidFree(f"all {count} sandbox uids ({first}-{first + count - 1}) are in use by live sandboxes")
