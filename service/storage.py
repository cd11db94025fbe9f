"""Object storage for datasets, checkpoints and adapters.

The service and its workers exchange files through one small interface, so the
same code runs against a local directory (tests, a single box) and against S3 or
an S3-compatible server (anything spanning machines). `open_store(url)` picks the
implementation from a URL, so a deployment chooses by configuration alone.

Keys are '/'-separated relative paths. Anything that could climb out of the
store's root ('..', absolute paths, backslashes, empty segments) is refused by
both stores alike, so a key that works locally also works on S3 and vice versa.
Every write reports the sha256 of what was stored, computed while streaming.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
from abc import ABC, abstractmethod
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator
from urllib.parse import parse_qsl, unquote, urlsplit

import boto3
from boto3.exceptions import Boto3Error
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from service.private_paths import FILE_MODE, private_dir

CHUNK = 1 << 20
# In-flight local writes are named like this; keys may not use it so list() can skip them.
_TMP = ".tmp-"


class StorageError(Exception):
    """The store failed or could not be reached."""


class NotFound(StorageError):
    def __init__(self, key: str):
        super().__init__(f"no object at key {key!r}")
        self.key = key


def check_key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError("storage key must be a non-empty string")
    for seg in key.split("/"):
        if seg in ("", ".", "..") or "\\" in seg or "\0" in seg or seg.startswith(_TMP):
            raise ValueError(f"invalid storage key {key!r}")
    return key


def _check_prefix(prefix: str) -> str:
    """'' means everything; otherwise a key, matched as a directory ('a' covers 'a/x', not 'ab')."""
    return check_key(prefix.removesuffix("/")) if prefix else ""


def _check_range(start: int, end: int | None) -> None:
    if start < 0 or (end is not None and end < start):
        raise ValueError(f"invalid byte range [{start}, {end})")


def _chunks(f: BinaryIO, chunk_size: int, start: int = 0, end: int | None = None) -> Iterator[bytes]:
    with f:
        f.seek(start)
        left = None if end is None else end - start
        while left is None or left > 0:
            chunk = f.read(chunk_size if left is None else min(chunk_size, left))
            if not chunk:
                return
            if left is not None:
                left -= len(chunk)
            yield chunk


def _create(path: Path, mode: int) -> BinaryIO:
    """Open a new file, making its directories; again if a delete pruned them (empty) in between."""
    for tries_left in (2, 1, 0):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode), "wb")
        except FileNotFoundError:
            if not tries_left:
                raise


def _write_atomic(dest: Path, chunks: Iterable[bytes], mode: int = 0o666) -> str:
    """Write via a sibling temp file + rename: readers see the old file or the new one, never a mix."""
    tmp = dest.with_name(f"{_TMP}{secrets.token_hex(8)}")
    digest = hashlib.sha256()
    try:
        with _create(tmp, mode) as f:
            for chunk in chunks:
                digest.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename itself is only durable once the directory entry is on disk.
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest()


class ObjectStore(ABC):
    @abstractmethod
    def put_file(self, key: str, path: str | Path) -> str: ...
    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> str: ...
    @abstractmethod
    def iter_bytes(self, key: str, chunk_size: int = CHUNK, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Stream bytes [start, end) of an object. Raises NotFound at call time, not on first next()."""
    @abstractmethod
    def size(self, key: str) -> int: ...
    @abstractmethod
    def list(self, prefix: str = "") -> list[str]: ...
    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; removing a missing one is not an error (as on S3)."""
    @abstractmethod
    def delete_prefix(self, prefix: str) -> None: ...
    @abstractmethod
    def ping(self) -> None: ...

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except NotFound:
            return False

    def get_file(self, key: str, dest: str | Path) -> str:
        return _write_atomic(Path(dest), self.iter_bytes(key))


@contextmanager
def _os_errors(key: str, reading: bool = True):
    try:
        yield
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        if reading:
            raise NotFound(key) from e
        raise StorageError(f"cannot write {key!r}: {e}") from e
    except OSError as e:
        raise StorageError(f"{key!r}: {e}") from e


class LocalStore(ObjectStore):
    def __init__(self, root: str | Path):
        self.root = private_dir(Path(root).expanduser().resolve())  # every project's datasets and adapters

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put_file(self, key, path):
        dest = self._path(key)
        with open(path, "rb") as src, _os_errors(key, reading=False):
            return _write_atomic(dest, _chunks(src, CHUNK), FILE_MODE)

    def put_bytes(self, key, data):
        dest = self._path(key)
        with _os_errors(key, reading=False):
            return _write_atomic(dest, [data], FILE_MODE)

    def iter_bytes(self, key, chunk_size=CHUNK, start=0, end=None):
        _check_range(start, end)
        path = self._path(key)
        with _os_errors(key):
            f = open(path, "rb")
        return _chunks(f, chunk_size, start, end)

    def size(self, key):
        path = self._path(key)
        with _os_errors(key):
            if not path.is_file():
                raise FileNotFoundError(path)
            return path.stat().st_size

    def list(self, prefix=""):
        p = _check_prefix(prefix)
        base = self.root.joinpath(*p.split("/")) if p else self.root
        keys = []
        for dirpath, _, files in os.walk(base):
            rel = Path(dirpath).relative_to(self.root)
            keys += [(rel / f).as_posix() for f in files if not f.startswith(_TMP)]
        return sorted(keys)

    def delete(self, key):
        path = self._path(key)
        try:
            with _os_errors(key):
                path.unlink()
        except NotFound:
            pass
        self._prune(path.parent)

    def delete_prefix(self, prefix):
        if not prefix:
            raise ValueError("refusing to delete the whole store")
        base = self.root.joinpath(*_check_prefix(prefix).split("/"))
        if base.is_dir():
            with _os_errors(prefix, reading=False):
                shutil.rmtree(base)
        self._prune(base.parent)

    def _prune(self, directory: Path) -> None:
        """Remove directories left empty up to the root: S3 has no directories, so a local store must not
        collect empty ones (jobs/<id>/checkpoints/epoch-N/ once its checkpoints are deleted)."""
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError:  # not empty (or already gone): nothing above it is empty either
                return
            directory = directory.parent

    def ping(self):
        if not (self.root.is_dir() and os.access(self.root, os.W_OK | os.X_OK)):
            raise StorageError(f"local store {self.root} is missing or not writable")


class _HashingReader:
    """Hashes bytes as boto3 reads them. Not seekable on purpose: s3transfer then reads the
    source once, in order, buffering each part for retries, so the digest is of what was sent
    (S3's own multipart checksums are composite and can't be compared with a plain sha256)."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.digest = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.digest.update(data)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


@contextmanager
def _s3_errors(key: str):
    try:
        yield
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            raise NotFound(key) from e
        raise StorageError(f"S3 error on {key!r}: {e}") from e
    except (BotoCoreError, Boto3Error) as e:
        raise StorageError(f"S3 error on {key!r}: {e}") from e


class S3Store(ObjectStore):
    batch = 1000  # DeleteObjects' per-request limit; also the list page size

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str = "us-east-1", config: Config | None = None):
        self.bucket = bucket
        self.prefix = _check_prefix(prefix)
        # Custom endpoints (MinIO, moto, ...) seldom have wildcard DNS for virtual-host buckets.
        base = Config(s3={"addressing_style": "path"}) if endpoint_url else Config()
        # Bounded waits, and retries with backoff for throttling, 5xx and dropped connections: a blip
        # must not fail a job, and a hung endpoint must not hang one forever.
        base = base.merge(Config(connect_timeout=10, read_timeout=60,
                                 retries={"mode": "standard", "total_max_attempts": 5}))
        # A private session: boto3's default one is not safe to build clients from concurrently.
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region,
            config=base.merge(config) if config else base)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}" if self.prefix else check_key(key)

    def _upload(self, key: str, f: BinaryIO) -> str:
        reader, k = _HashingReader(f), self._key(key)
        with _s3_errors(key):
            self.client.upload_fileobj(reader, self.bucket, k)
        return reader.digest.hexdigest()

    def put_file(self, key, path):
        self._key(key)  # refuse a bad key before touching the source
        with open(path, "rb") as f:
            return self._upload(key, f)

    def put_bytes(self, key, data):
        return self._upload(key, io.BytesIO(data))

    def iter_bytes(self, key, chunk_size=CHUNK, start=0, end=None):
        _check_range(start, end)
        k = self._key(key)
        if end == start:  # S3 cannot express an empty range; still say whether the key exists
            self.size(key)
            return iter(())
        extra = {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if start or end else {}
        with _s3_errors(key):
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=k, **extra)["Body"]
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") != "InvalidRange":
                    raise
                return iter(())  # start is past the end: nothing to send, like a local file
        return self._stream(key, body, chunk_size)

    def _stream(self, key, body, chunk_size):
        with _s3_errors(key):
            try:
                yield from body.iter_chunks(chunk_size)
            finally:
                body.close()

    def size(self, key):
        k = self._key(key)
        with _s3_errors(key):
            return self.client.head_object(Bucket=self.bucket, Key=k)["ContentLength"]

    def _root(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def list(self, prefix=""):
        p = _check_prefix(prefix)
        root = self._root()
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=root + (f"{p}/" if p else ""),
            PaginationConfig={"PageSize": self.batch})
        with _s3_errors(prefix):
            return sorted(o["Key"][len(root):] for page in pages for o in page.get("Contents", []))

    def delete(self, key):
        k = self._key(key)
        with _s3_errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=k)

    def delete_prefix(self, prefix):
        if not prefix:
            raise ValueError("refusing to delete the whole store")
        keys, root = self.list(prefix), self._root()
        for i in range(0, len(keys), self.batch):
            objects = [{"Key": root + k} for k in keys[i:i + self.batch]]
            with _s3_errors(prefix):
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})
            if resp.get("Errors"):
                raise StorageError(f"S3 refused to delete {resp['Errors'][:3]}")

    def ping(self):
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (ClientError, BotoCoreError) as e:
            raise StorageError(f"S3 bucket {self.bucket!r} unreachable: {e}") from e


def open_store(url: str, **options) -> ObjectStore:
    """'file:///abs/dir' or a plain path -> LocalStore; 's3://bucket/prefix[?endpoint_url=..&region=..]'
    -> S3Store (keyword options override the query; credentials come from boto3's usual chain)."""
    if "://" not in url:
        return LocalStore(url, **options)
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or parts.query:
            raise ValueError(f"file URL must look like file:///abs/path, got {url!r}")
        return LocalStore(unquote(parts.path), **options)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"s3 URL has no bucket: {url!r}")
        query = dict(parse_qsl(parts.query))
        if unknown := set(query) - {"endpoint_url", "region"}:
            raise ValueError(f"unknown s3 URL options {sorted(unknown)} in {url!r}")
        return S3Store(parts.netloc, unquote(parts.path).strip("/"), **{**query, **options})
    raise ValueError(f"unsupported storage URL scheme {parts.scheme!r} in {url!r}")
