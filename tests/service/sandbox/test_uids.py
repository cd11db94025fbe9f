"""Sandbox uid leases (service/sandbox/uids.py) without a sandbox: where they live, the range they accept, and that
two live leases never hold one uid. (Live sandboxes never sharing a uid: tests/service/sandbox/test_kernel.py.)"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from service.sandbox import uids


@pytest.mark.parametrize("run_writable, expected", [(True, "/run/cispo-sandbox-uids"),
                                                    (False, "/tmp/cispo-sandbox-uids")])
def test_leases_live_in_run_where_it_is_writable_else_tmp(monkeypatch, run_writable, expected):
    asked = []

    def access(path, mode):
        asked.append((path, mode))
        return run_writable

    monkeypatch.setattr(uids.os, "access", access)
    assert uids.lease_dir() == Path(expected)
    assert asked == [("/run", uids.os.W_OK)]


@pytest.fixture
def leases(monkeypatch, tmp_path) -> Path:
    where = tmp_path / "not" / "yet" / "there"
    monkeypatch.setattr(uids, "lease_dir", lambda: where)
    return where


def test_the_lease_directory_is_made_private(leases):
    with uids.lease_uid(first=1, count=1) as uid:  # the lowest uid a range may start at
        assert uid == 1
    assert stat.S_IMODE(leases.stat().st_mode) == 0o700


@pytest.mark.parametrize("first, count", [(0, 5), (-3, 5), (1000, 0)])
def test_a_range_that_starts_at_root_or_holds_nothing_is_refused(leases, first, count):
    with pytest.raises(ValueError, match="must start above 0 and hold at least one uid"):
        uids.lease_uid(first=first, count=count)


def test_live_leases_never_share_a_uid_and_a_released_one_is_free_again(leases, monkeypatch):
    monkeypatch.setattr(uids.random, "randrange", lambda n: 0)  # every scan starts at a uid already held
    held = [uids.lease_uid(first=5000, count=3) for _ in range(3)]
    assert {stat.S_IMODE((leases / str(lease.uid)).stat().st_mode) for lease in held} == {0o600}
    assert sorted(lease.uid for lease in held) == [5000, 5001, 5002]
    with pytest.raises(uids.NoUidFree, match="5000-5002"):
        uids.lease_uid(first=5000, count=3)
    freed = held.pop(1)
    freed.release()
    freed.release()  # idempotent
    again = uids.lease_uid(first=5000, count=3)
    assert again.uid == freed.uid
    for lease in (*held, again):
        lease.release()
