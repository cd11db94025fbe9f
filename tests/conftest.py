"""Shared fixtures: the tiny model and the toy dataset, built once per test session."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

BUCKET = "cispo-test"
# A Redis database of the tests' own, flushed per stack; parallel checkouts on one machine set their own.
REDIS_TEST_URL = f"redis://127.0.0.1:6379/{os.environ.get('CISPO_TEST_REDIS_DB', '15')}"


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory) -> Path:
    """A directory with the tiny model (model/), train.jsonl, val.jsonl and spec.yaml."""
    pytest.importorskip("torch")
    from worker.toy.__main__ import prepare

    kept = os.environ.get("CISPO_TEST_TOY_DIR")  # bench/mutate.py: one build for all its test runs
    if not kept:
        root = tmp_path_factory.mktemp("toy")
        prepare(root)
        return root
    root = Path(kept)
    if not (root / "spec.yaml").exists():  # built aside, then renamed: a concurrent run never sees half of it
        building = root.with_name(f"{root.name}.{os.getpid()}")
        prepare(building)
        try:
            os.rename(building, root)
        except OSError:  # another run got there first
            shutil.rmtree(building, ignore_errors=True)
    return root


# -- databases -----------------------------------------------------------------

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _fresh_postgres(name: str) -> str:
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


def _drop_postgres(name: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def make_database(kind: str, tmp_path: Path) -> tuple[str, callable]:
    """A new, migrated database of the kind ('sqlite' or 'postgresql'); returns (url, drop)."""
    import uuid

    from service.db.migrate import upgrade

    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / f'db-{uuid.uuid4().hex[:8]}.sqlite'}"
        drop = lambda: None  # noqa: E731
    else:
        name = f"cispo_test_{uuid.uuid4().hex[:10]}"
        url = _fresh_postgres(name)
        drop = lambda: _drop_postgres(name)  # noqa: E731
    upgrade(url)
    return url, drop


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> str:
    """A fresh database built by `alembic upgrade head`, on SQLite and on the real PostgreSQL."""
    url, drop = make_database(request.param, tmp_path)
    yield url
    from service.db.session import session_factory

    session_factory(url).kw["bind"].dispose()
    drop()


@pytest.fixture
def postgres_url(tmp_path) -> str:
    url, drop = make_database("postgresql", tmp_path)
    yield url
    from service.db.session import session_factory

    session_factory(url).kw["bind"].dispose()
    drop()


# -- S3: moto's standalone server over real HTTP on loopback ----------------------



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    """Start moto's server as a subprocess, so boto3 talks real HTTP; yields its endpoint URL."""
    # Found, not imported: moto's server pulls in flask, whose context-local proxies (in sys.modules) break
    # code that inspects every loaded module, such as vLLM's kernel registration at engine start.
    if importlib.util.find_spec("moto") is None:
        pytest.skip("moto is not installed")
    boto3 = pytest.importorskip("boto3")
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto server exited with {proc.returncode}; see {log.name}")
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"moto server did not answer on {endpoint}; see {log.name}")
                time.sleep(0.1)
        with pytest.MonkeyPatch.context() as mp:
            # Dummy credentials, and nothing from the developer's own AWS setup.
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
                mp.delenv(var, raising=False)
            mp.setenv("AWS_CONFIG_FILE", "/nonexistent")
            mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
            boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1") \
                .create_bucket(Bucket=BUCKET)
            yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def s3_url(moto_endpoint) -> str:
    """A fresh, empty prefix in the test bucket, as an s3:// URL usable with open_store."""
    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}?endpoint_url={moto_endpoint}"
