"""ObjectStore contract, run against both a local directory and S3 (moto over HTTP)."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from pathlib import Path

import pytest
from botocore.config import Config

from service.storage import LocalStore, NotFound, S3Store, StorageError, open_store

from tests.conftest import free_port


@pytest.fixture(params=["local", "s3"])
def store_url(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_url")


@pytest.fixture
def store(store_url):
    return open_store(store_url)


def test_large_file_roundtrip(store, tmp_path):
    # Above boto3's 8 MiB threshold, so S3 goes through a real multipart upload.
    data = os.urandom(9 * (1 << 20) + 123)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()

    assert store.put_file("runs/r1/model.bin", src) == want
    assert store.size("runs/r1/model.bin") == len(data)
    assert store.exists("runs/r1/model.bin")

    dest = tmp_path / "out" / "model.bin"
    assert store.get_file("runs/r1/model.bin", dest) == want
    assert dest.read_bytes() == data
    assert os.listdir(dest.parent) == ["model.bin"]  # no temp file left behind


def test_put_bytes_overwrites(store):
    assert store.put_bytes("a/b.txt", b"first") == hashlib.sha256(b"first").hexdigest()
    assert store.put_bytes("a/b.txt", b"second!") == hashlib.sha256(b"second!").hexdigest()
    assert b"".join(store.iter_bytes("a/b.txt")) == b"second!"
    assert store.size("a/b.txt") == 7
    assert store.put_bytes("empty", b"") == hashlib.sha256(b"").hexdigest()
    assert b"".join(store.iter_bytes("empty")) == b""


@pytest.mark.parametrize("start,end", [(0, None), (0, 1), (5, 17), (1000, None), (4000, 10240),
                                       (10239, None), (7, 7), (10240, None), (20000, 30000)])
def test_iter_bytes_ranges(store, start, end):
    data = bytes(range(256)) * 40  # 10240 bytes, every offset distinguishable within 256
    store.put_bytes("blob", data)
    chunks = list(store.iter_bytes("blob", chunk_size=1000, start=start, end=end))
    assert b"".join(chunks) == data[start:end]
    assert all(0 < len(c) <= 1000 for c in chunks)


def test_iter_bytes_bad_range(store):
    store.put_bytes("blob", b"x")
    with pytest.raises(ValueError):
        store.iter_bytes("blob", start=-1)
    with pytest.raises(ValueError):
        store.iter_bytes("blob", start=5, end=4)


def test_list_and_delete(store):
    for key in ["a/1", "a/2", "a/sub/3", "ab/4", "b"]:
        store.put_bytes(key, key.encode())
    assert store.list() == ["a/1", "a/2", "a/sub/3", "ab/4", "b"]
    assert store.list("a") == ["a/1", "a/2", "a/sub/3"]  # a directory: 'ab/4' is not under 'a'
    assert store.list("a/") == ["a/1", "a/2", "a/sub/3"]
    assert store.list("a/sub") == ["a/sub/3"]
    assert store.list("nope") == []

    store.delete("a/2")
    store.delete("a/2")  # deleting twice is fine, as on S3
    assert not store.exists("a/2")
    assert store.list("a") == ["a/1", "a/sub/3"]

    store.delete_prefix("a")
    assert store.list() == ["ab/4", "b"]
    assert b"".join(store.iter_bytes("ab/4")) == b"ab/4"
    with pytest.raises(ValueError):
        store.delete_prefix("")


def test_s3_pagination_and_delete_batches(s3_url):
    store = open_store(s3_url)
    store.batch = 3  # exercise several list pages and several DeleteObjects calls
    keys = sorted(f"p/k{i:02d}" for i in range(10))
    for k in keys:
        store.put_bytes(k, b"x")
    store.put_bytes("keep", b"y")
    assert store.list("p") == keys
    store.delete_prefix("p")
    assert store.list() == ["keep"]


def test_missing_key(store, tmp_path):
    for call in [lambda: store.size("no/such"),
                 lambda: store.iter_bytes("no/such"),  # raises at call time, before iteration
                 lambda: store.iter_bytes("no/such", start=3, end=3),
                 lambda: store.get_file("no/such", tmp_path / "dest")]:
        with pytest.raises(NotFound, match="no/such") as info:
            call()
        assert isinstance(info.value, StorageError)
    assert not store.exists("no/such")
    assert not (tmp_path / "dest").exists()
    store.put_bytes("dir/file", b"x")
    assert not store.exists("dir")  # a 'directory' is not an object
    with pytest.raises(NotFound):
        store.size("dir")


BAD_KEYS = ["../x", "a/../../x", "/abs", "a//b", "a\\b", "..", ".", "a/./b", "a/", "", ".tmp-1"]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_refused(store, key, tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"payload")
    for call in [lambda: store.put_bytes(key, b"x"), lambda: store.put_file(key, src),
                 lambda: store.iter_bytes(key), lambda: store.get_file(key, tmp_path / "d"),
                 lambda: store.size(key), lambda: store.exists(key), lambda: store.delete(key)]:
        with pytest.raises(ValueError):
            call()
    if key not in ("", "a/"):  # both are valid prefixes
        with pytest.raises(ValueError):
            store.list(key)
        with pytest.raises(ValueError):
            store.delete_prefix(key)
    assert store.list() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"] + (["store"] if isinstance(store, LocalStore) else [])


def test_local_write_failure_keeps_old_object(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    store.put_bytes("k", b"old")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(StorageError, match="disk full"):
        store.put_bytes("k", b"new")
    monkeypatch.undo()
    assert b"".join(store.iter_bytes("k")) == b"old"
    assert os.listdir(tmp_path / "store") == ["k"]  # the temp file was cleaned up


def test_local_reader_never_sees_partial_write(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put_bytes("k", b"a" * 5000)
    reader = store.iter_bytes("k", chunk_size=1000)
    first = next(reader)
    store.put_bytes("k", b"b" * 7000)  # replaced while the old version is being read
    assert first + b"".join(reader) == b"a" * 5000
    assert b"".join(store.iter_bytes("k")) == b"b" * 7000


def test_ping(store):
    store.ping()


def test_ping_fails_when_s3_unreachable(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    port = free_port()  # nothing listens there once the probe socket is closed
    quick = Config(connect_timeout=1, read_timeout=1, retries={"total_max_attempts": 1})
    store = open_store(f"s3://bucket?endpoint_url=http://127.0.0.1:{port}", config=quick)
    began = time.monotonic()
    with pytest.raises(StorageError, match="unreachable"):
        store.ping()
    assert time.monotonic() - began < 5


def test_ping_fails_for_missing_bucket(s3_url):
    with pytest.raises(StorageError):
        open_store(s3_url.replace("s3://cispo-test/", "s3://no-such-bucket/")).ping()


def test_ping_fails_when_local_root_gone(tmp_path):
    store = LocalStore(tmp_path / "store")
    (tmp_path / "store").rmdir()
    with pytest.raises(StorageError):
        store.ping()


def test_open_store_urls(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")

    local = open_store(f"file://{tmp_path}/a%20b")
    assert isinstance(local, LocalStore) and local.root == tmp_path / "a b" and local.root.is_dir()
    plain = open_store(str(tmp_path / "plain"))
    assert isinstance(plain, LocalStore) and plain.root == tmp_path / "plain" and plain.root.is_dir()

    s3 = open_store("s3://bkt/some/prefix/?endpoint_url=http://127.0.0.1:5000&region=eu-west-1")
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix) == ("bkt", "some/prefix")
    assert s3.client.meta.endpoint_url == "http://127.0.0.1:5000"
    assert s3.client.meta.region_name == "eu-west-1"
    s3 = open_store("s3://bkt", region="ap-south-1")
    assert (s3.bucket, s3.prefix, s3.client.meta.region_name) == ("bkt", "", "ap-south-1")
    assert open_store("s3://bkt").client.meta.region_name == "us-east-1"

    for url, match in [("gs://bkt/x", "'gs'"), ("http://host/x", "'http'"), ("s3:///x", "bucket"),
                       ("s3://bkt?colour=red", "colour"), ("file://otherhost/x", "file:///"),
                       ("s3://bkt/a/../b", "invalid")]:
        with pytest.raises(ValueError, match=match):
            open_store(url)


def test_local_deletes_leave_no_empty_directories(tmp_path):
    store = LocalStore(tmp_path / "store")
    for key in ("jobs/j/checkpoints/epoch-000001/step-000002/adapter.tar",
                "jobs/j/checkpoints/epoch-000002/step-000004/adapter.tar", "jobs/j/result.csv"):
        store.put_bytes(key, b"x")
    store.delete_prefix("jobs/j/checkpoints/epoch-000001/step-000002")  # a pruned checkpoint
    assert not (store.root / "jobs/j/checkpoints/epoch-000001").exists()
    assert (store.root / "jobs/j/checkpoints/epoch-000002/step-000004").is_dir()
    store.delete_prefix("jobs/j/checkpoints/epoch-000002/step-000004")
    assert not (store.root / "jobs/j/checkpoints").exists()
    store.delete("jobs/j/result.csv")
    assert list(store.root.iterdir()) == []  # the root itself stays
    store.put_bytes("jobs/j/again", b"y")  # and writes make what they need again
    assert store.list() == ["jobs/j/again"]
