"""Service-side commands of `cispo`: database migrations, API keys, the API server, the embedded stack, and
the HTTP client: `jobs` (service/cli/jobs.py), `files`, `models`, `evals` (service/cli/resources.py).

Nothing here imports torch; `cispo up` starts the worker as a separate process.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys

from service.cli.jobs import utc_time, add_jobs_command
from service.cli.resources import add_resource_commands
from service.settings import get_settings


class CliError(Exception):
    """A problem the user can fix; `cispo` prints the message (no traceback) and exits 2."""


HOW_TO_POINT = ("run it in the directory where `cispo up` runs (its state is ./.cispo there), or point at that "
                "state with CISPO_HOME=/path/to/.cispo, or at a server database with DATABASE_URL=postgresql://...")


def _key_database() -> str:
    """The URL of the database that holds the keys; CliError when it plainly is not there.

    A missing SQLite file is refused rather than created: a key in a new, empty database is one the API
    (which reads its own) never accepts."""
    settings = get_settings()
    if not settings.database_url:
        path = (settings.home / "cispo.db").resolve()
        if not path.is_file():
            raise CliError(f"no cispo database at {path} (CISPO_HOME is {settings.home}): {HOW_TO_POINT}")
    return settings.resolved_database_url()


def _sessions():
    from sqlalchemy.engine import make_url

    from service.db.session import session_factory

    url = _key_database()
    return session_factory(url), make_url(url).render_as_string(hide_password=True)


def _database_errors(func):
    """Key commands: a database that cannot be opened or has no schema is a message naming it, not a traceback."""
    def run(args) -> int:
        from sqlalchemy.exc import OperationalError, ProgrammingError

        try:
            return func(args)
        except (OperationalError, ProgrammingError) as e:
            url = _sessions()[1]
            reason = str(getattr(e, "orig", e)).strip().splitlines()[0]
            raise CliError(f"cannot use the database at {url} ({reason}); `cispo db upgrade` creates the schema; "
                           f"{HOW_TO_POINT}") from None
    return run


def cmd_db_upgrade(args) -> int:
    from service.db.migrate import upgrade

    settings = get_settings()
    settings.home.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new home is private (service/private_paths.py)
    upgrade(settings.resolved_database_url())
    return 0


@_database_errors
def cmd_keys_create(args) -> int:
    from service.repositories import projects

    with _sessions()[0].begin() as s:
        key = projects.create_key(s, projects.get_or_create_project(s, args.project))
    print(key)
    return 0


@_database_errors
def cmd_keys_list(args) -> int:
    from service.repositories import projects

    with _sessions()[0]() as s:
        for key, project in projects.keys(s, args.project):
            state = "active" if key.revoked_at is None else f"revoked {utc_time(key.revoked_at)} UTC"
            used = f"{utc_time(key.last_used_at)} UTC" if key.last_used_at else "never"
            print(f"{key.id}  {key.prefix}…  {project}  {state}  last used: {used}")
    return 0


@_database_errors
def cmd_keys_revoke(args) -> int:
    from service.repositories import projects

    with _sessions()[0].begin() as s:
        key = projects.revoke(s, args.key_id)
    if key is None:
        print(f"cispo: no such key: {args.key_id} (see `cispo keys list`)", file=sys.stderr)
        return 1
    print(f"revoked {key.id}; requests with it now get 401")
    return 0


def cmd_api(args) -> int:
    import uvicorn

    uvicorn.run("service.api.app:create_app", factory=True, host=args.host, port=args.port, log_level="info")
    return 0


def cmd_up(args) -> int:
    """API + worker + serving worker + Tinker worker on the embedded default (SQLite, a server-less broker, a local object store), supervised:
    a worker that dies is restarted, and SIGTERM/SIGINT stop both before `cispo up` exits."""
    from service.supervisor import Child, supervise

    cmd_db_upgrade(args)
    settings = get_settings()
    print(f"cispo: state in {settings.home.resolve()}; API on http://{args.host}:{args.port}", flush=True)
    cli = [sys.executable, "-m", "worker.cli"]
    env = os.environ.copy()
    if args.worker_jobs is not None:  # LoRA jobs of one base trained at once on one copy of it (worker/multi/)
        env["CISPO_WORKER_JOBS"] = str(args.worker_jobs)
    exit_without_teardown(supervise([
        Child("api", [*cli, "api", "--host", args.host, "--port", str(args.port)], restart=False),
        Child("worker", [*cli, "worker", "--pool", "solo"], restart=True),
        Child("serve", [*cli, "serve"], restart=True),  # /v1/chat/completions for any base, loaded on first use
        Child("tinker", [*cli, "tinker"], restart=True),  # the Tinker API's training clients (/api/v1)
    ], env=env))


def exit_without_teardown(code: int) -> None:
    """Exit now, once a long-running command is done: run the atexit hooks (weakref finalizers among
    them) and flush the logs, but skip the interpreter's teardown of every module, which takes about a
    second for the service's modules and several with torch loaded, all of it added to every stop."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def add_commands(sub: argparse._SubParsersAction) -> None:
    add_jobs_command(sub)  # `cispo jobs ...`: the HTTP client
    add_resource_commands(sub)  # `cispo files|models|evals ...`: the same client
    db = sub.add_parser("db", help="database migrations").add_subparsers(dest="db_command", required=True)
    db.add_parser("upgrade", help="apply all migrations (alembic upgrade head)").set_defaults(func=cmd_db_upgrade)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create a key for a project and print it")
    create.add_argument("--project", required=True)
    create.set_defaults(func=cmd_keys_create)
    listing = keys.add_parser("list", help="list keys (id, prefix, project, state; never the key itself)")
    listing.add_argument("--project")
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="revoke a key by id: it gets 401 from the next request on")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=cmd_keys_revoke)

    for name, func, help_ in (("api", cmd_api, "run the HTTP API"),
                              ("up", cmd_up, "run API and worker on the embedded default")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=8000)
        if name == "up":
            p.add_argument("--worker-jobs", type=int, choices=range(1, 65), metavar="N",
                           help="LoRA jobs of one base model the worker trains at once on one copy of the base "
                                "(default CISPO_WORKER_JOBS, 1: one job at a time)")
        p.set_defaults(func=func)
