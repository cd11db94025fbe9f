"""Static checks of the deployment files against the code they deploy.

Nothing here runs docker, helm or Kubernetes. The files are parsed and
cross-checked: commands against the real `cispo` argument parser, environment
variables against the Settings model, probe paths against the API routes,
values.yaml against values.schema.json and against the templates that read it.
Helm templates are checked through a small stand-in for rendering (see
`render_template`): `.Values` references are replaced by their values.yaml
value, other template expressions by opaque tokens, and lines that are pure
template control flow are dropped; what is left must be YAML manifests.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import jsonschema
import pytest
import yaml
from pydantic import AliasChoices

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
CHART = REPO / "helm" / "cispo"
TEMPLATES = CHART / "templates"

APP_SERVICES = ("migrate", "api", "worker")  # compose services that run the cispo image
CONNECTION_VARS = ("DATABASE_URL", "BROKER_URL", "STORAGE_URL")


# -- shared helpers -------------------------------------------------------------


def settings_env_names() -> set[str]:
    """Every environment variable name service.settings.Settings reads."""
    from service.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    names: set[str] = set()
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        if alias is None:
            names.add(f"{prefix}{name}".upper())
        elif isinstance(alias, AliasChoices):
            names |= {c.upper() for c in alias.choices if isinstance(c, str)}
        else:
            names.add(str(alias).upper())
    return names


def is_known_env(name: str) -> bool:
    # AWS_* is read by boto3 (service/storage.py leaves credentials to its usual chain).
    return name in settings_env_names() or name.startswith("AWS_")


def parse_cispo(argv: list) -> object:
    """Parse argv (starting at the word after `cispo`) with the real parser; fail on error."""
    from worker.cli import build_parser

    argv = [str(a) for a in argv]
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse exits on unknown commands and options
        pytest.fail(f"`cispo {' '.join(argv)}` is not a valid cispo command (argparse exit {e.code})")
    assert callable(getattr(ns, "func", None)), f"`cispo {' '.join(argv)}` selects no command"
    return ns


def cispo_tail(argv: list) -> list | None:
    """The arguments after the `cispo` word of a command line, or None if it does not run cispo."""
    words = [str(a) for a in argv]
    for i, w in enumerate(words):
        if w == "cispo" or w.endswith("/cispo"):
            return words[i + 1 :]
    return None


def as_argv(command) -> list:
    return shlex.split(command) if isinstance(command, str) else list(command)


def command_name(ns) -> str:
    """'db upgrade', 'api', 'worker', ... from a parsed namespace."""
    sub = getattr(ns, "db_command", None) or getattr(ns, "keys_command", None)
    return f"{ns.command} {sub}" if sub else ns.command


# -- docker-compose.yml ---------------------------------------------------------

_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: str) -> str:
    """Compose variable interpolation with an empty environment: ${X:-default} -> default."""

    def sub(m: re.Match) -> str:
        if m.group(4):
            return ""
        op, arg = m.group(2), m.group(3)
        if op and op.endswith("-"):
            return arg
        if op and op.endswith("?"):
            pytest.fail(f"compose variable {m.group(1)} is required ({arg}); give local development a default")
        return ""

    parts = value.split("$$")  # $$ is a literal $
    return "$".join(_INTERP.sub(sub, p) for p in parts)


def _interpolate_all(obj):
    if isinstance(obj, dict):
        return {k: _interpolate_all(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_interpolate_all(v) for v in obj]
    if isinstance(obj, str):
        return interpolate(obj)
    return obj


def compose() -> dict:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict), "no services in docker-compose.yml"
    return doc


def compose_services() -> dict:
    return _interpolate_all(compose()["services"])


def service_env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def depends_on(svc: dict) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def test_compose_parses_with_the_expected_services():
    services = compose_services()
    missing = {"postgres", "redis", "minio", "migrate", "api", "worker"} - set(services)
    assert not missing, f"docker-compose.yml lacks services {sorted(missing)}"
    for name, svc in services.items():
        assert svc.get("image") or svc.get("build"), f"service {name} has neither image nor build"


def test_compose_depends_on_names_existing_services_with_sensible_conditions():
    services = compose_services()
    for name, svc in services.items():
        for dep, condition in depends_on(svc).items():
            assert dep in services, f"{name} depends on {dep!r}, which is not a service"
            assert dep != name, f"{name} depends on itself"
            assert condition in {"service_started", "service_healthy", "service_completed_successfully"}, (
                f"{name}: unknown depends_on condition {condition!r}"
            )
            if condition == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits for {dep} to be healthy; {dep} has no healthcheck"
            if condition == "service_completed_successfully":
                assert str(services[dep].get("restart", "no")) in {"no", "False", "false"}, (
                    f"{name} waits for {dep} to complete, but {dep} restarts"
                )
    # no cycles
    graph = {n: set(depends_on(s)) for n, s in services.items()}
    done: set[str] = set()

    def visit(n: str, path: tuple[str, ...]) -> None:
        assert n not in path, f"depends_on cycle: {' -> '.join(path + (n,))}"
        if n in done:
            return
        for d in graph.get(n, ()):
            visit(d, path + (n,))
        done.add(n)

    for n in graph:
        visit(n, ())


def test_compose_start_order_migrations_first():
    services = compose_services()
    assert depends_on(services["migrate"]).get("postgres") == "service_healthy"
    for name in ("api", "worker"):
        deps = depends_on(services[name])
        assert deps.get("migrate") == "service_completed_successfully", f"{name} must wait for the migrations"
        for infra in ("postgres", "redis", "minio"):
            assert deps.get(infra) == "service_healthy", f"{name} must wait for {infra} to be healthy"


def test_compose_cispo_commands_parse_with_the_real_parser():
    services = compose_services()
    seen = {}
    for name, svc in services.items():
        for key in ("entrypoint", "command"):
            if svc.get(key) is None:
                continue
            tail = cispo_tail(as_argv(svc[key]))
            if tail is not None:
                seen[name] = command_name(parse_cispo(tail))
    assert seen.get("migrate") == "db upgrade"
    assert seen.get("api") == "api"
    assert seen.get("worker") == "worker"
    assert seen.get("serve") == "serve"
    assert seen.get("tinker") == "tinker"
    api_args = parse_cispo(cispo_tail(as_argv(services["api"]["command"])))
    assert api_args.host == "0.0.0.0", "the API must listen on all interfaces inside its container"
    worker_args = parse_cispo(cispo_tail(as_argv(services["worker"]["command"])))
    assert worker_args.pool == "prefork", "a fresh child per job needs the prefork pool"


def test_compose_app_environment_is_what_settings_reads():
    services = compose_services()
    for name in APP_SERVICES:
        env = service_env(services[name])
        unknown = sorted(k for k in env if not is_known_env(k))
        assert not unknown, f"{name}: environment variables no setting reads: {unknown}"
        for var in CONNECTION_VARS:
            assert env.get(var), f"{name}: {var} is not set"


def test_compose_connection_settings_match_the_servers(monkeypatch):
    services = compose_services()
    env = service_env(services["api"])
    for name in APP_SERVICES:
        assert {k: service_env(services[name]).get(k) for k in CONNECTION_VARS} == {k: env[k] for k in CONNECTION_VARS}, (
            f"{name} connects elsewhere than the api"
        )

    db = urlsplit(env["DATABASE_URL"])
    pg = service_env(services["postgres"])
    assert db.scheme in ("postgresql", "postgres", "postgresql+psycopg")
    assert db.hostname == "postgres" and (db.port or 5432) == 5432
    assert db.username == pg.get("POSTGRES_USER", "postgres")
    assert db.password == pg["POSTGRES_PASSWORD"]
    assert db.path.lstrip("/") == pg.get("POSTGRES_DB", db.username)

    broker = urlsplit(env["BROKER_URL"])
    redis_cmd = [str(a) for a in as_argv(services["redis"]["command"])]
    assert broker.scheme == "redis" and broker.hostname == "redis"
    assert "--requirepass" in redis_cmd, "redis runs without a password"
    assert broker.password == redis_cmd[redis_cmd.index("--requirepass") + 1], "BROKER_URL has another password"
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert redis_cmd[redis_cmd.index("--maxmemory-policy") + 1] == "noeviction"

    storage = urlsplit(env["STORAGE_URL"])
    query = dict(parse_qsl(storage.query))
    minio = service_env(services["minio"])
    assert storage.scheme == "s3"
    assert urlsplit(query["endpoint_url"]).hostname == "minio"
    assert env["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"]
    bucket_job = " ".join(
        " ".join(as_argv(s.get("entrypoint") or [])) + " " + " ".join(as_argv(s.get("command") or []))
        for n, s in services.items()
        if n != "minio"
    )
    assert re.search(rf"\bmc mb\b[^\n]*/{re.escape(storage.netloc)}\b", bucket_job), (
        f"no one-shot job creates the bucket {storage.netloc!r}"
    )

    # The code accepts these values: Settings normalizes the URL, the store parses its query.
    from service.settings import Settings
    from service.storage import open_store

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = Settings()
    assert settings.resolved_database_url().startswith("postgresql+psycopg://")
    assert settings.resolved_broker_url().startswith("redis://")
    assert settings.home == Path(env["CISPO_HOME"])
    store = open_store(settings.resolved_storage_url())
    assert type(store).__name__ == "S3Store"


def test_compose_passes_the_shared_worker_settings_through(monkeypatch):
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in ("api", "worker"):  # the API orders queue positions by the weights
        env = raw[name]["environment"]
        for key in ("CISPO_PROJECT_WEIGHTS", "CISPO_WORKER_MEMORY_GIB"):
            assert re.fullmatch(r"\$\{" + key + r":-[^}]*\}+", str(env.get(key))), f"{name}: {key} is not passed through"
    # unset, they are the code's defaults: no weights, 90% of the device's memory
    settings = settings_under(service_env(compose_services()["worker"]), monkeypatch)
    assert settings.project_weights == {} and settings.worker_memory_gib is None


def test_compose_cispo_home_is_a_mounted_volume():
    services = compose_services()
    for name in ("api", "worker"):
        home = service_env(services[name])["CISPO_HOME"]
        targets = [v.split(":")[1] if isinstance(v, str) else v.get("target") for v in services[name].get("volumes", [])]
        assert home in targets, f"{name}: CISPO_HOME {home} is not on a volume"


def test_compose_only_the_api_publishes_ports():
    services = compose_services()
    publishing = {name for name, svc in services.items() if svc.get("ports")}
    assert publishing == {"api"}, f"services publishing ports on the host: {sorted(publishing)}"
    host_net = {name for name, svc in services.items() if svc.get("network_mode") == "host"}
    assert not host_net, f"services on the host network: {sorted(host_net)}"
    ports = [str(p) if not isinstance(p, dict) else f"{p.get('published')}:{p.get('target')}" for p in services["api"]["ports"]]
    api_port = parse_cispo(cispo_tail(as_argv(services["api"]["command"]))).port
    assert any(p.split(":")[-1].split("/")[0] == str(api_port) for p in ports), (
        f"the api publishes {ports}, but listens on {api_port}"
    )


def test_compose_worker_reserves_a_gpu():
    for gpu_user in ("worker", "serve", "tinker"):  # serving and Tinker workers keep a base resident on a GPU
        svc = compose_services()[gpu_user]
        devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
        gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
        assert gpus, f"the {gpu_user} reserves no nvidia GPU"
        assert all(d.get("count") == 1 or d.get("device_ids") for d in gpus), f"one GPU per {gpu_user}"
    # a Ray node (the `ray` profile) is a whole machine: all its GPUs, one rank each
    node = compose_services()["ray-node"]["deploy"]["resources"]["reservations"]["devices"]
    assert [d["count"] for d in node if d.get("driver") == "nvidia"] == ["all"]
    for name, svc in compose_services().items():
        if name not in ("worker", "serve", "tinker", "ray-node"):
            assert "deploy" not in svc or "devices" not in str(svc["deploy"]), f"{name} reserves devices"


def test_compose_healthchecks():
    services = compose_services()
    for name in ("postgres", "redis", "minio", "api"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert "pg_isready" in str(services["postgres"]["healthcheck"]["test"])
    assert "/healthz" in str(services["api"]["healthcheck"]["test"])


def test_compose_build_targets_exist():
    stages = dockerfile_stages()
    services = compose_services()
    for name, target in (("migrate", "api"), ("api", "api"), ("worker", "worker")):
        build = services[name].get("build")
        assert isinstance(build, dict), f"{name} is not built from the Dockerfile"
        assert build.get("target") == target, f"{name} builds target {build.get('target')!r}, not {target!r}"
        assert build.get("target") in stages
        assert (REPO / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE


# -- Dockerfile -----------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            instr, _, rest = buf.strip().partition(" ")
            out.append((instr.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_stages() -> dict[str, dict]:
    stages: dict[str, dict] = {}
    current = None
    for instr, rest in dockerfile_instructions():
        if instr == "FROM":
            m = re.match(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?\s*$", rest, re.I)
            assert m, f"cannot read FROM {rest}"
            name = (m.group(2) or str(len(stages))).lower()
            current = stages[name] = {"base": m.group(1).lower(), "instructions": []}
        elif current is not None:
            current["instructions"].append((instr, rest))
    return stages


def stage_chain(stages: dict, name: str) -> list[tuple[str, str]]:
    """A target's instructions, those of the stages it is built FROM first."""
    chain, seen = [], set()
    while name in stages and name not in seen:
        seen.add(name)
        chain = stages[name]["instructions"] + chain
        name = stages[name]["base"]
    return chain


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list), f"not exec form: {arguments}"
    return value


def test_dockerfile_has_api_and_worker_targets():
    stages = dockerfile_stages()
    assert {"api", "worker"} <= set(stages), f"Dockerfile stages: {sorted(stages)}"


def _pip_installs(chain) -> list[str]:
    return [rest for instr, rest in chain if instr == "RUN" and "pip install" in rest]


def test_api_target_does_not_install_the_worker_extra():
    stages = dockerfile_stages()
    api_runs = " ".join(rest for instr, rest in stage_chain(stages, "api") if instr == "RUN")
    assert "[worker" not in api_runs, "the api image installs the [worker] extra"
    assert not re.search(r"\btorch\b", api_runs), "the api image installs torch"
    assert _pip_installs(stage_chain(stages, "api")), "the api image installs nothing"
    worker_installs = " ".join(_pip_installs(stage_chain(stages, "worker")))
    assert re.search(r"\.\[worker[\],]", worker_installs), "the worker image does not install the [worker] extra"


def test_images_keep_the_repository_layout_for_migrations():
    stages = dockerfile_stages()
    for target in ("api", "worker"):
        chain = stage_chain(stages, target)
        workdirs = [rest for instr, rest in chain if instr == "WORKDIR"]
        assert workdirs and workdirs[-1] == "/app", f"{target}: WORKDIR is not /app"
        assert ("COPY", ". .") in chain, f"{target}: the source tree is not copied whole"
        assert any(re.search(r"pip install[^&]*\s-e\s+\.(\s|$)", r) for r in _pip_installs(chain)), (
            f"{target}: the project is not installed editable from /app"
        )


def test_image_commands_are_real_cispo_commands():
    stages = dockerfile_stages()
    expected = {"api": "api", "worker": "worker"}
    for target, command in expected.items():
        chain = stage_chain(stages, target)
        cmds = [rest for instr, rest in chain if instr == "CMD"]
        assert cmds, f"{target} has no CMD"
        tail = cispo_tail(exec_form(cmds[-1]))
        assert tail is not None, f"{target}'s CMD does not run cispo"
        assert command_name(parse_cispo(tail)) == command


def dockerignore_patterns() -> list[str]:
    return [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _docker_match(pattern: str, path: str) -> bool:
    """Go filepath.Match plus '**', as .dockerignore uses it; a pattern also covers what lies under a match."""
    regex = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            regex += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            regex += ".*"
            i += 2
        elif pattern[i] == "*":
            regex += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            regex += "[^/]"
            i += 1
        else:
            regex += re.escape(pattern[i])
            i += 1
    parts = path.split("/")
    return any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1))


def docker_ignored(path: str) -> bool:
    ignored = False
    for pat in dockerignore_patterns():
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if _docker_match(pat, path):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_the_image_needs():
    needed = ["pyproject.toml", "README.md", "service/settings.py", "service/db/migrate.py", "worker/cli.py",
              "migrations/env.py"]
    needed += [str(p.relative_to(REPO)) for p in (REPO / "migrations" / "versions").glob("*.py")]
    dropped = [p for p in needed if docker_ignored(p)]
    assert not dropped, f".dockerignore leaves out {dropped}"
    for junk in (".git/HEAD", ".venv/bin/python", "service/__pycache__/x.pyc"):
        assert docker_ignored(junk), f".dockerignore sends {junk} to the build"


# -- helm chart -----------------------------------------------------------------


@functools.cache
def _values_yaml() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def chart_values() -> dict:
    """values.yaml, a copy of its own for each caller (parsed once: the renders below look up hundreds of keys)."""
    return copy.deepcopy(_values_yaml())


def values_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def template_files(pattern: str = "*") -> list[Path]:
    files = sorted(p for p in TEMPLATES.glob(pattern) if p.is_file())
    assert files, f"no templates matching {pattern}"
    return files


def test_chart_yaml():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart.get("apiVersion") == "v2"
    assert chart.get("name") == "cispo" == CHART.name
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.-]+)?", str(chart.get("version", ""))), "version is not SemVer"
    assert chart.get("type", "application") == "application"


def test_values_validate_against_the_schema():
    schema = values_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    assert "draft-07" in schema.get("$schema", "")
    assert schema.get("additionalProperties") is False
    values = chart_values()
    jsonschema.Draft7Validator(schema).validate(values)
    assert set(schema.get("required", [])) >= {"api", "worker", "migrations", "config", "secrets"}
    assert set(values) == set(schema["properties"]), "values.yaml and the schema describe different keys"


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda v: v.update(unknown=1), id="unknown-top-level-key"),
        pytest.param(lambda v: v["api"].update(replica=3), id="misspelt-component-key"),
        pytest.param(lambda v: v["api"]["image"].update(tag=1.0), id="numeric-image-tag"),
        pytest.param(lambda v: v["worker"].update(pool="threads"), id="pool-cispo-does-not-offer"),
        pytest.param(lambda v: v["worker"]["resources"]["limits"].update({"nvidia.com/gpu": 2}), id="gpu-set-twice"),
        pytest.param(lambda v: v["config"]["extraEnv"].update(DATABASE_URL="x"), id="secret-in-configmap"),
        pytest.param(lambda v: v["worker"].pop("image"), id="missing-image"),
        pytest.param(lambda v: v["api"].update(port="8000"), id="port-as-string"),
        pytest.param(lambda v: v["config"].update(sandbox="on"), id="sandbox-mode-cispo-does-not-know"),
        pytest.param(lambda v: v["config"].update(workerJobs=0), id="no-job-slot"),
        pytest.param(lambda v: v["worker"].pop("containerSecurityContext"), id="worker-without-its-security-context"),
        pytest.param(lambda v: v["worker"]["containerSecurityContext"].update(appArmorProfile={"type": "unconfined"}),
                     id="apparmor-type-misspelt"),
    ],
)
def test_schema_refuses_wrong_values(mutate):
    values = copy.deepcopy(chart_values())
    mutate(values)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(values_schema()).validate(values)


def test_schema_allows_every_pool_the_cli_offers():
    from worker.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    choices = next(a for a in sub.choices["worker"]._actions if a.dest == "pool").choices
    assert set(values_schema()["properties"]["worker"]["properties"]["pool"]["enum"]) == set(choices)


_VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def lookup_values(path: list[str], values: dict | None = None):
    node = _values_yaml() if values is None else values
    for i, key in enumerate(path):
        assert isinstance(node, dict) and key in node, f".Values.{'.'.join(path)}: no {'.'.join(path[: i + 1])} in values.yaml"
        node = node[key]
    return node


def test_every_values_reference_exists_in_values_yaml():
    refs = 0
    for path in template_files():
        for m in _VALUES_REF.finditer(path.read_text()):
            lookup_values(m.group(1)[1:].split("."))
            refs += 1
    assert refs > 20, "suspiciously few .Values references"


# A template action: {{ ... }}, {{- ... -}}; comments {{/* */}} are dropped first.
_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
_COMMENT = re.compile(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}", re.S)
_PIPE = r'quote|int|int64|toString|toJson|default\s+"[^"]*"'
_ONLY_VALUES = re.compile(r"^\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)((?:\s*\|\s*(?:" + _PIPE + r"))*)$")


def apply_pipes(value, pipes: str):
    """A `.Values.x` expression's value through its pipeline, as Helm's functions would return it."""
    for fn in re.findall(_PIPE, pipes):
        if fn.startswith("default"):
            value = value if value not in (None, "", 0, False, {}, []) else json.loads(fn.split(None, 1)[1])
        elif fn == "toJson":
            value = json.dumps(value, separators=(",", ":"), sort_keys=True)  # Go: compact, map keys sorted
        elif fn in ("quote", "toString"):
            value = str(value)
    return value


def render_template(text: str, values: dict | None = None) -> tuple[list[dict], dict[str, str]]:
    """Approximate a render: returns the YAML documents and {token: template expression}.

    Lines holding nothing but template actions (if/with/range/end, include|nindent,
    toYaml|nindent) are dropped; `.Values.x` expressions become their value in
    `values` (default: values.yaml), through their pipeline; any other expression
    becomes a token TPL<n>X, mapped back in the table.
    """
    table: dict[str, str] = {}
    text = _COMMENT.sub("", text)
    lines = []
    for line in text.splitlines():
        if line.strip() and not _ACTION.sub("", line).strip():
            continue
        lines.append(line)

    def sub(m: re.Match) -> str:
        expr = m.group(1).strip()
        only = _ONLY_VALUES.match(expr)
        if only:
            return json.dumps(apply_pipes(lookup_values(only.group(1)[1:].split("."), values), only.group(2)))
        token = f"TPL{len(table)}X"
        table[token] = expr
        return token

    body = _ACTION.sub(sub, "\n".join(lines))
    docs = [d for d in yaml.safe_load_all(body) if d]
    return docs, table


@functools.cache
def _rendered() -> tuple[tuple[Path, dict, dict], ...]:
    out = []
    for path in template_files("*.yaml"):
        docs, table = render_template(path.read_text())
        assert docs, f"{path.name} renders no manifest"
        out.extend((path, d, table) for d in docs)
    return tuple(out)


def manifests() -> list[tuple[Path, dict, dict]]:
    """Every template rendered with values.yaml (rendered once; each caller gets a copy to change)."""
    return copy.deepcopy(list(_rendered()))


def expressions(value, table: dict) -> list[str]:
    return [table[t] for t in re.findall(r"TPL\d+X", str(value))]


def include_names(value, table: dict) -> list[str]:
    return [m for e in expressions(value, table) for m in re.findall(r'include\s+"([^"]+)"', e)]


def component_of(doc: dict) -> str | None:
    return (doc["metadata"].get("labels") or {}).get("app.kubernetes.io/component")


def find(kind: str, component: str | None = None) -> list[tuple[Path, dict, dict]]:
    found = [(p, d, t) for p, d, t in manifests() if d.get("kind") == kind]
    if component is not None:
        found = [(p, d, t) for p, d, t in found if component_of(d) == component]
    return found


def one(kind: str, component: str | None = None) -> tuple[Path, dict, dict]:
    found = find(kind, component)
    assert len(found) == 1, f"expected one {kind} {component or ''}, found {[p.name for p, _, _ in found]}"
    return found[0]


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["template"]["spec"] if doc["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet") else doc["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def test_templates_parse_as_kubernetes_manifests():
    kinds = []
    for path, doc, _ in manifests():
        assert isinstance(doc, dict), f"{path.name}: not a mapping"
        for key in ("apiVersion", "kind", "metadata"):
            assert doc.get(key), f"{path.name}: no {key}"
        assert doc["metadata"].get("name"), f"{path.name}: no metadata.name"
        kinds.append(doc["kind"])
        if doc["kind"] in ("Deployment", "Job"):
            for c in containers(doc):
                assert c.get("name") and c.get("image"), f"{path.name}: a container without name or image"
    for kind in ("Deployment", "Service", "Job", "ConfigMap", "Secret"):
        assert kind in kinds, f"the chart renders no {kind}"


def test_helpers_define_every_included_template():
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    defined = set(re.findall(r'define\s+"([^"]+)"', helpers))
    for path in template_files():
        for name in re.findall(r'(?:include|template)\s+"([^"]+)"', path.read_text()):
            assert name in defined, f"{path.name} includes {name!r}, which _helpers.tpl does not define"


def define_body(name: str) -> str:
    """The text of `{{ define "name" }} ... {{ end }}` in _helpers.tpl, nesting respected."""
    text = (TEMPLATES / "_helpers.tpl").read_text()
    start = re.search(r'\{\{-?\s*define\s+"' + re.escape(name) + r'"\s*-?\}\}', text)
    assert start, f"_helpers.tpl does not define {name}"
    depth = 1
    for m in _ACTION.finditer(text, start.end()):
        word = m.group(1).split(" ", 1)[0]
        if word in ("if", "with", "range", "define", "block"):
            depth += 1
        elif word == "end":
            depth -= 1
            if depth == 0:
                return text[start.end() : m.start()]
    pytest.fail(f"define {name} is not closed")


def test_cispo_commands_in_templates_parse_with_the_real_parser():
    seen = {}
    for path, doc, _ in manifests():
        if doc["kind"] not in ("Deployment", "Job"):
            continue
        for c in containers(doc):
            argv = list(c.get("command") or []) + list(c.get("args") or [])
            tail = cispo_tail(argv)
            if tail is not None:
                seen[(doc["kind"], component_of(doc))] = command_name(parse_cispo(tail))
    assert seen == {
        ("Deployment", "api"): "api",
        ("Deployment", "worker"): "worker",
        ("Deployment", "serve"): "serve",
        ("Deployment", "tinker"): "tinker",
        ("Job", "migrations"): "db upgrade",
    }, seen
    notes = (TEMPLATES / "NOTES.txt").read_text()
    for line in notes.splitlines():
        if re.search(r"\s--\s+cispo\s", line):
            parse_cispo(cispo_tail(shlex.split(line.split(" -- ", 1)[1])))


def test_containers_keep_the_image_entrypoint():
    # command: would replace the image's ENTRYPOINT (tini, which forwards SIGTERM and reaps children).
    for path, doc, _ in manifests():
        if doc["kind"] in ("Deployment", "Job"):
            for c in containers(doc):
                assert "command" not in c, f"{path.name}: {c['name']} overrides the image entrypoint; use args"


def test_images_per_component():
    expected = {("Deployment", "api"): ".Values.api.image", ("Deployment", "worker"): ".Values.worker.image",
                ("Job", "migrations"): ".Values.api.image"}  # migrations need no torch
    for (kind, component), ref in expected.items():
        _, doc, table = one(kind, component)
        exprs = expressions(containers(doc)[0]["image"], table)
        assert any(ref in e for e in exprs), f"{kind} {component} does not use {ref}: {exprs}"


def test_api_probes_point_at_health_routes_that_exist():
    path, doc, _ = one("Deployment", "api")
    (c,) = containers(doc)
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    port_names = {p.get("name") for p in c["ports"]} | {p.get("containerPort") for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe in c:
            assert c[probe]["httpGet"]["port"] in port_names, f"{probe} targets a port the container lacks"
    # the routes: plain text search, the API is written alongside these files
    sources = "\n".join(p.read_text() for p in (REPO / "service" / "api").rglob("*.py"))
    for route in ("/healthz", "/readyz"):
        assert f'"{route}"' in sources or f"'{route}'" in sources, f"no {route} route in service/api"


def test_api_port_service_and_args_agree():
    _, dep, _ = one("Deployment", "api")
    (c,) = containers(dep)
    args = parse_cispo(cispo_tail(c["args"]))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.port == ports["http"], f"the API listens on {args.port}, the container port is {ports['http']}"
    assert args.host == "0.0.0.0"
    _, svc, _ = one("Service", "api")
    assert svc["spec"]["selector"].get("app.kubernetes.io/component") == "api", "the Service would also select workers"
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in ports or port["targetPort"] in ports.values()


def test_selectors_match_pod_labels():
    for path, doc, table in find("Deployment"):
        selector = doc["spec"]["selector"]["matchLabels"]
        labels = doc["spec"]["template"]["metadata"]["labels"]
        for k, v in selector.items():
            assert labels.get(k) == v, f"{path.name}: selector {k}={v} is not on the pods"
        assert selector.get("app.kubernetes.io/component"), f"{path.name}: selector without a component"
    # the dropped include lines: selector and pod labels come from the same helper
    for path in template_files("*deployment*.yaml"):
        text = path.read_text()
        sel = re.findall(r'include\s+"(cispo\.[A-Za-z]*[Ll]abels)"', text.split("template:", 1)[0].split("selector:", 1)[1])
        pod = re.findall(r'include\s+"(cispo\.[A-Za-z]*[Ll]abels)"', text.split("template:", 1)[1].split("spec:", 1)[0])
        assert sel == pod == ["cispo.selectorLabels"], f"{path.name}: selector {sel}, pod labels {pod}"
    components = [d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for _, d, _ in find("Deployment")]
    assert len(components) == len(set(components)), "two Deployments select the same pods"


def test_worker_gets_one_gpu_and_time_to_stop():
    _, doc, _ = one("Deployment", "worker")
    spec = doc["spec"]["template"]["spec"]
    (c,) = containers(doc)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["terminationGracePeriodSeconds"] >= 600
    assert doc["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "a rollout would need a spare GPU"
    assert parse_cispo(cispo_tail(c["args"])).pool == "prefork"
    for resident in ("serve", "tinker"):  # serving and Tinker workers keep a base resident on a GPU of their own
        _, doc, _ = one("Deployment", resident)
        assert containers(doc)[0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert doc["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "a rollout would need a spare GPU"
    for path, other, _ in manifests():
        if other["kind"] in ("Deployment", "Job") and component_of(other) not in ("worker", "serve", "tinker"):
            for oc in containers(other):
                assert "nvidia.com/gpu" not in str(oc.get("resources")), f"{path.name} asks for a GPU"


def _hook(doc: dict) -> tuple[set[str], int, set[str]]:
    ann = doc["metadata"].get("annotations") or {}
    events = {e.strip() for e in str(ann.get("helm.sh/hook", "")).split(",") if e.strip()}
    weight = int(ann.get("helm.sh/hook-weight", "0"))
    policies = {p.strip() for p in str(ann.get("helm.sh/hook-delete-policy", "")).split(",") if p.strip()}
    return events, weight, policies


def test_migration_job_is_a_pre_install_pre_upgrade_hook():
    _, job, table = one("Job", "migrations")
    events, weight, policies = _hook(job)
    assert {"pre-install", "pre-upgrade"} <= events, f"hook events {events}"
    assert "before-hook-creation" in policies, f"hook delete policy {policies}"
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    for path, doc, _ in manifests():
        if doc["kind"] in ("Deployment", "Job", "Service") and (doc["kind"], component_of(doc)) != ("Job", "migrations"):
            assert not _hook(doc)[0], f"{path.name}: only the migrations run as a hook"


def test_migration_job_can_read_its_settings_before_the_release_exists():
    """Pre-install hooks run before the chart's ordinary objects: what the Job reads must be a hook too."""
    _, job, jtable = one("Job", "migrations")
    _, jweight, _ = _hook(job)
    (c,) = containers(job)
    hook_secrets = {}
    ordinary = set()
    for path, doc, table in manifests():
        if doc["kind"] in ("Secret", "ConfigMap"):
            names = tuple(expressions(doc["metadata"]["name"], table))
            events, weight, _ = _hook(doc)
            if {"pre-install", "pre-upgrade"} <= events:
                hook_secrets[names] = weight
            else:
                ordinary.add(names)
    env_names = {e["name"] for e in c.get("env") or []}
    for source in c.get("envFrom") or []:
        ref = source.get("secretRef") or source.get("configMapRef")
        names = tuple(expressions(ref["name"], jtable))
        assert names not in ordinary, f"the migration Job reads {names}, which does not exist yet at pre-install"
        assert names in hook_secrets, f"the migration Job reads {names}, which is no pre-install/pre-upgrade hook"
        assert hook_secrets[names] < jweight, "the Job's Secret must be created before the Job (lower hook weight)"
    assert "configMapRef" not in str(c.get("envFrom")), "the ConfigMap does not exist at pre-install"
    # The non-secret settings come as plain env, rendered from the ConfigMap's own helper.
    job_text = _COMMENT.sub("", (TEMPLATES / "migrations-job.yaml").read_text())
    assert re.search(r'\benv:\s*\n\s*\{\{-?\s*include\s+"cispo\.configEnv"', job_text) or env_names, (
        "the Job gets no CISPO_* settings"
    )
    assert 'include "cispo.config"' in define_body("cispo.configEnv")
    assert 'include "cispo.config"' in (TEMPLATES / "configmap.yaml").read_text()
    secret_helper = define_body("cispo.migrationsSecretName")
    assert ".Values.secrets.existingSecret" in secret_helper


def test_configmap_and_secret_keys_are_settings():
    config_keys = re.findall(r"^([A-Z][A-Z0-9_]*):", define_body("cispo.config"), re.M)
    secret_keys = re.findall(r"^([A-Z][A-Z0-9_]*):", define_body("cispo.secretData"), re.M)
    assert config_keys and secret_keys
    unknown = [k for k in config_keys + secret_keys if not is_known_env(k)]
    assert not unknown, f"keys no setting reads: {unknown}"
    assert set(CONNECTION_VARS) <= set(secret_keys), "the Secret lacks a connection URL"
    assert not set(CONNECTION_VARS) & set(config_keys), "connection URLs (with passwords) belong in the Secret"
    assert "CISPO_HOME" in config_keys
    # values the templates set directly
    for path, doc, _ in manifests():
        if doc["kind"] in ("Deployment", "Job"):
            for c in containers(doc):
                for e in c.get("env") or []:
                    assert is_known_env(e["name"]), f"{path.name}: env {e['name']} is no setting"


def rendered_config(values: dict) -> dict[str, str]:
    """The ConfigMap's settings under `values`: the keys rendered from values (not those from includes or extraEnv)."""
    (data,), _ = render_template(define_body("cispo.config"), values)
    return {k: v for k, v in data.items() if k.startswith("CISPO_") and "TPL" not in f"{k}{v}"}


def settings_under(env: dict[str, str], monkeypatch):
    from service.settings import Settings

    for key in [k for k in os.environ if k.startswith("CISPO_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings()


def test_shared_worker_settings_reach_the_api_and_the_workers(monkeypatch):
    values = copy.deepcopy(chart_values())
    values["config"].update(projectWeights={"research": 2.5, "team b": 1}, workerMemoryGiB=70.5)
    jsonschema.Draft7Validator(values_schema()).validate(values)
    settings = settings_under(rendered_config(values), monkeypatch)
    assert settings.project_weights == {"research": 2.5, "team b": 1}
    assert settings.worker_memory_gib == 70.5
    # values.yaml's defaults are the code's: no weights, 90% of the device's memory
    settings = settings_under(rendered_config(chart_values()), monkeypatch)
    assert settings.project_weights == {} and settings.worker_memory_gib is None
    # the API orders queue positions by the weights, the workers admit by both: each reads the ConfigMap
    for component in ("api", "worker"):
        (c,) = containers(one("Deployment", component)[1])
        assert [r for r in c.get("envFrom") or [] if "configMapRef" in r], f"the {component} does not read the ConfigMap"


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda c: c.update(projectWeights={"research": 0}), id="weight-zero"),
        pytest.param(lambda c: c.update(projectWeights={"research": -1}), id="weight-negative"),
        pytest.param(lambda c: c.update(projectWeights={"research": "2"}), id="weight-as-string"),
        pytest.param(lambda c: c.update(projectWeights=[{"research": 2}]), id="weights-not-a-map"),
        pytest.param(lambda c: c.pop("projectWeights"), id="weights-null"),  # Helm drops a key set to null
        pytest.param(lambda c: c.update(workerMemoryGiB=0), id="memory-zero"),
        pytest.param(lambda c: c.update(workerMemoryGiB="40Gi"), id="memory-as-quantity"),
        pytest.param(lambda c: c["extraEnv"].update(CISPO_PROJECT_WEIGHTS="{}"), id="weights-set-twice"),
        pytest.param(lambda c: c["extraEnv"].update(CISPO_WORKER_MEMORY_GIB="40"), id="memory-set-twice"),
    ],
)
def test_schema_refuses_wrong_shared_worker_values(mutate):
    values = copy.deepcopy(chart_values())
    mutate(values["config"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(values_schema()).validate(values)


def test_app_pods_read_the_configmap_and_the_secret():
    configmaps = {tuple(expressions(d["metadata"]["name"], t)) for _, d, t in find("ConfigMap")}
    for component in ("api", "worker"):
        _, doc, table = one("Deployment", component)
        (c,) = containers(doc)
        refs = c.get("envFrom") or []
        cm = [tuple(expressions(r["configMapRef"]["name"], table)) for r in refs if "configMapRef" in r]
        sec = [include_names(r["secretRef"]["name"], table) for r in refs if "secretRef" in r]
        assert cm and all(n in configmaps for n in cm), f"{component} does not read the chart's ConfigMap"
        assert sec == [["cispo.secretName"]], f"{component} reads secrets {sec}"
    body = define_body("cispo.secretName")
    assert ".Values.secrets.existingSecret" in body
    secret_names = [expressions(d["metadata"]["name"], t) for _, d, t in find("Secret") if not _hook(d)[0]]
    assert secret_names and all(any(e.replace(" ", "") in body.replace(" ", "") for e in n) for n in secret_names), (
        "cispo.secretName does not name the chart's Secret"
    )


def test_home_is_writable_under_a_read_only_root():
    values = chart_values()
    for path, doc, _ in manifests():
        if doc["kind"] not in ("Deployment", "Job"):
            continue
        volumes = {v["name"] for v in doc["spec"]["template"]["spec"].get("volumes", [])}
        for c in containers(doc):
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert values["config"]["home"] in mounts, f"{path.name}: CISPO_HOME is not a volume"
            assert "/tmp" in mounts, f"{path.name}: no writable /tmp"
            assert set(mounts.values()) <= volumes, f"{path.name}: mounts a volume it does not define"
    assert values["containerSecurityContext"]["readOnlyRootFilesystem"] is True
    assert values["podSecurityContext"]["runAsNonRoot"] is True
    assert values["worker"]["containerSecurityContext"]["readOnlyRootFilesystem"] is True


# -- privileges: only the worker runs as root, with what its sandbox needs ------
#
# User Python code runs only in the sandbox of service/sandbox/spawn.py (launched by
# service/sandbox/launch.py, probed by service/sandbox/probe.py), which the
# worker builds as root and which drops the user code to an unprivileged uid.
# These are the capabilities building it takes; the worker is given exactly these.
SANDBOX_CAPS = {
    "SYS_ADMIN",  # unshare() of the network, pid, mount and IPC namespaces; mount()
    "SYS_CHROOT",  # chroot() into the sandbox's new root
    "SETUID",  # setuid() to the sandbox uid
    "SETGID",  # setgroups() and setgid() to the sandbox gid
    "DAC_OVERRIDE",  # root writing where it is not the owner: cgroup directories of mode 0555, CISPO_HOME
    "SYS_PTRACE",  # /proc/PID/ns/pid of the sandbox uid's processes: members(), kill()'s survivor check
}
# Not CHOWN/FOWNER: the workdir is a tmpfs mounted with the sandbox uid as owner
# (test_sandbox_deploy.py checks that no sandbox module chowns). Measured: the
# containment tests pass with exactly SANDBOX_CAPS as the bounding set.
ROOT = ("root", "0")


def dockerfile_user(target: str) -> str:
    """The user (name or uid, without the group) a Dockerfile target runs as; root when it sets none."""
    users = [rest for instr, rest in stage_chain(dockerfile_stages(), target) if instr == "USER"]
    return users[-1].split(":")[0] if users else "root"


def caps(names) -> set[str]:
    return {str(n).upper().removeprefix("CAP_") for n in names or []}


def test_api_image_runs_as_the_chart_s_non_root_user():
    user = dockerfile_user("api")
    uid = chart_values()["podSecurityContext"]["runAsUser"]
    assert user not in ROOT, f"the api image runs as {user}"
    assert user == str(uid), f"the api image runs as {user}, the chart's API and migrations as {uid}"
    env = " ".join(rest for instr, rest in stage_chain(dockerfile_stages(), "api") if instr == "ENV")
    assert f"CISPO_HOME={chart_values()['config']['home']}" in env


def test_worker_image_runs_as_root_and_has_the_sandbox_launcher():
    user = dockerfile_user("worker")
    assert user in ROOT, f"the worker image runs as {user}: it could not build the sandbox, user code would be refused"
    runs = " ".join(rest for instr, rest in stage_chain(dockerfile_stages(), "worker") if instr == "RUN")
    assert re.search(r"""python -c "[^"]*\bshutil\.which\('unshare'""", runs), (
        "the worker build does not check that `unshare` is there"
    )


def test_compose_worker_has_what_the_sandbox_needs_and_no_more():
    worker = compose_services()["worker"]
    user = str(worker.get("user", dockerfile_user("worker"))).split(":")[0]
    assert user in ROOT, f"the compose worker runs as {user}"
    assert caps(worker.get("cap_drop")) == {"ALL"}, "the worker keeps Docker's default capabilities"
    assert caps(worker.get("cap_add")) == SANDBOX_CAPS, f"worker capabilities {sorted(caps(worker.get('cap_add')))}"
    assert not worker.get("privileged"), "the worker is privileged"
    opts = [str(o).replace(":", "=", 1) for o in worker.get("security_opt") or []]
    # docker-default's AppArmor profile denies mount(), SYS_ADMIN or not.
    assert "apparmor=unconfined" in opts, f"security_opt {opts}"
    # Docker's default seccomp profile admits unshare/mount to a container with SYS_ADMIN (and
    # chroot with SYS_CHROOT); it is the only syscall filter the user code runs under: keep it.
    assert not [o for o in opts if o.startswith("seccomp=")], f"the worker replaces the default seccomp profile: {opts}"
    for key in ("pid", "ipc", "network_mode", "userns_mode", "cgroup"):
        assert str(worker.get(key, "")) != "host", f"the worker shares the host's {key}"


def test_compose_nothing_but_the_worker_is_privileged():
    for name, svc in compose_services().items():
        if name == "worker":
            continue
        for key in ("cap_add", "security_opt", "privileged", "devices"):
            assert not svc.get(key), f"{name} sets {key}"
        for key in ("pid", "ipc", "network_mode", "userns_mode", "cgroup"):
            assert str(svc.get(key, "")) != "host", f"{name} shares the host's {key}"
        if name in APP_SERVICES:
            user = str(svc.get("user", dockerfile_user(svc["build"]["target"]))).split(":")[0]
            assert user not in ROOT, f"{name} runs as {user}"


def sandbox_branch(body: str, sandbox: str) -> str:
    """The part of a helper's body that applies when config.sandbox is `sandbox`, if it branches on it."""
    start = re.search(r'\{\{-?\s*if\s+eq\s+\.Values\.config\.sandbox\s+"off"\s*-?\}\}', body)
    if not start:
        return body
    depth, middle = 1, None
    for m in _ACTION.finditer(body, start.end()):
        word = m.group(1).split(" ", 1)[0]
        if word in ("if", "with", "range", "define", "block"):
            depth += 1
        elif word == "else" and depth == 1 and middle is None:
            middle = m
        elif word == "end":
            depth -= 1
            if depth == 0:
                assert middle is not None, "the sandbox branch has no else"
                return body[start.end() : middle.start()] if sandbox == "off" else body[middle.end() : m.start()]
    pytest.fail("the sandbox branch is not closed")


def security_contexts(kind: str, component: str, sandbox: str) -> tuple[dict, dict]:
    """(pod securityContext, container securityContext) of one workload under config.sandbox = `sandbox`.

    The rendering stand-in drops `toYaml`/`include` lines, so this follows them
    to their values: the line after each `securityContext:` key, through the
    _helpers.tpl define it includes, if any.
    """
    path, doc, _ = one(kind, component)
    assert len(containers(doc)) == 1, f"{path.name}: one container expected"
    lines = _COMMENT.sub("", path.read_text()).splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.strip() != "securityContext:":
            continue
        following = next(ln.strip() for ln in lines[i + 1 :] if ln.strip())
        action = _ACTION.fullmatch(following)
        assert action, f"{path.name}: securityContext is not taken from values.yaml: {following}"
        expr = action.group(1)
        include = re.match(r'include\s+"([^"]+)"', expr)
        source = sandbox_branch(define_body(include.group(1)), sandbox) if include else expr
        refs = set(re.findall(r"(?:toYaml|:=)\s+\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", source))
        assert len(refs) == 1, f"{path.name}: securityContext from {sorted(refs)}"
        found.append((len(line) - len(line.lstrip()), lookup_values(refs.pop()[1:].split("."))))
    assert len(found) == 2, f"{path.name}: {len(found)} securityContext keys, expected the pod's and the container's"
    (_, pod), (_, container) = sorted(found, key=lambda f: f[0])
    return pod, container


def seccomp_type(pod: dict, container: dict) -> str | None:
    return (container.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")


def assert_unprivileged(where: str, pod: dict, container: dict, uid: int) -> None:
    assert pod.get("runAsNonRoot") is True, f"{where}: runAsNonRoot is not set"
    assert pod.get("runAsUser") == uid != 0, f"{where}: runs as {pod.get('runAsUser')}, the api image as {uid}"
    assert caps((container.get("capabilities") or {}).get("drop")) == {"ALL"}, f"{where}: keeps capabilities"
    assert not (container.get("capabilities") or {}).get("add"), f"{where}: adds capabilities"
    assert container.get("allowPrivilegeEscalation") is False, f"{where}: may escalate privileges"
    assert not container.get("privileged"), f"{where}: privileged"
    assert container.get("readOnlyRootFilesystem") is True, f"{where}: writable root file system"
    assert seccomp_type(pod, container) == "RuntimeDefault", f"{where}: seccomp {seccomp_type(pod, container)}"
    assert "appArmorProfile" not in container, f"{where}: sets an AppArmor profile"


def test_chart_api_and_migrations_run_as_the_api_image_s_non_root_user():
    uid = int(dockerfile_user("api"))
    for kind, component in (("Deployment", "api"), ("Job", "migrations")):
        for sandbox in ("auto", "off"):
            pod, container = security_contexts(kind, component, sandbox)
            assert_unprivileged(f"{kind} {component}", pod, container, uid)


def test_chart_worker_runs_as_root_with_what_the_sandbox_needs():
    pod, container = security_contexts("Deployment", "worker", chart_values()["config"]["sandbox"])
    assert pod.get("runAsUser") == 0 and pod.get("runAsNonRoot") is False, f"the worker pod runs as {pod}"
    assert str(pod.get("runAsGroup", 0)) == "0"
    capabilities = container.get("capabilities") or {}
    assert caps(capabilities.get("drop")) == {"ALL"}, "the worker keeps the runtime's default capabilities"
    assert caps(capabilities.get("add")) == SANDBOX_CAPS, f"worker capabilities {sorted(caps(capabilities.get('add')))}"
    assert not container.get("privileged"), "the worker is privileged"
    # Kubernetes: privilege escalation is always possible with SYS_ADMIN, and the API refuses
    # allowPrivilegeEscalation: false next to CAP_SYS_ADMIN; false would be a claim, not a fact.
    assert container.get("allowPrivilegeEscalation") is not False
    assert container.get("readOnlyRootFilesystem") is True
    # The runtimes' default AppArmor profiles deny mount(), SYS_ADMIN or not.
    assert (container.get("appArmorProfile") or {}).get("type") == "Unconfined"
    # The runtime's default seccomp profile admits unshare/mount with SYS_ADMIN; it is the user
    # code's only syscall filter, so it stays.
    assert seccomp_type(pod, container) == "RuntimeDefault", f"the worker's seccomp: {seccomp_type(pod, container)}"
    # Before Kubernetes 1.30 the AppArmor field does not exist: the pod annotation, for this container.
    text = (TEMPLATES / "worker-deployment.yaml").read_text()
    annotations = text.split("annotations:", 1)[1].split("spec:", 1)[0]
    assert 'include "cispo.workerAppArmorAnnotation"' in annotations, "no AppArmor annotation for clusters before 1.30"
    annotation = define_body("cispo.workerAppArmorAnnotation")
    (c,) = containers(one("Deployment", "worker")[1])
    assert f"container.apparmor.security.beta.kubernetes.io/{c['name']}:" in annotation
    assert '"<1.30-0"' in annotation and '"<1.30-0"' in define_body("cispo.workerContainerSecurityContext")


def test_chart_worker_without_the_sandbox_is_as_strict_as_the_api():
    assert security_contexts("Deployment", "worker", "off") == security_contexts("Deployment", "api", "off")
    annotation = define_body("cispo.workerAppArmorAnnotation")
    assert re.search(r'ne\s+\.Values\.config\.sandbox\s+"off"', annotation), "AppArmor unconfined with the sandbox off"


def _walk(node, path=()):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, path + (i,))


def test_nothing_else_in_the_chart_is_privileged():
    root_contexts = {}
    for kind, component in (("Deployment", "api"), ("Job", "migrations"), ("Deployment", "worker")):
        for sandbox in ("auto", "off"):
            pod, container = security_contexts(kind, component, sandbox)
            if pod.get("runAsUser") == 0 or pod.get("runAsNonRoot") is not True or (container.get("capabilities") or {}).get("add"):
                root_contexts[(kind, component, sandbox)] = pod
    assert set(root_contexts) == {("Deployment", "worker", "auto")}, f"root or capabilities in {sorted(root_contexts)}"
    # values.yaml: root and added capabilities only in the worker's contexts, privileged nowhere
    for path, node in _walk(chart_values()):
        where = ".".join(map(str, path))
        if path and path[-1] == "privileged":
            assert node is not True, f"{where} is true"
        if path and path[-1] == "add":
            assert path[:2] == ("worker", "containerSecurityContext"), f"capabilities added at {where}"
        if path and path[-1] in ("runAsUser", "runAsGroup") and node == 0:
            assert path[:2] == ("worker", "podSecurityContext"), f"{where} is root"
        if path and path[-1] == "hostPath":  # the one host path: node-wide sandbox uid leases
            assert path == ("worker", "sandboxUidLeaseVolume", "hostPath"), f"a host path at {where}"
    # the manifests: no host namespaces, host paths or inline security settings
    for path, doc, _ in manifests():
        if doc["kind"] not in ("Deployment", "Job"):
            continue
        spec = doc["spec"]["template"]["spec"]
        for key in ("hostPID", "hostIPC", "hostNetwork", "hostUsers"):
            assert key not in spec, f"{path.name} sets {key}"
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], f"{path.name} mounts a host path"
    for path in template_files("*.yaml") + template_files("*.tpl"):
        text = _COMMENT.sub("", path.read_text())
        for word in ("privileged: true", "SYS_ADMIN", "hostPath", "Unconfined", "runAsUser: 0"):
            assert word not in text, f"{path.name} writes {word!r} itself; it belongs in values.yaml"


def test_sandbox_setting_is_one_cispo_knows():
    from typing import get_args

    from service.settings import Settings

    known = set(get_args(Settings.model_fields["sandbox"].annotation))
    enum = set(values_schema()["properties"]["config"]["properties"]["sandbox"]["enum"])
    assert {"auto", "off"} <= enum <= known, f"config.sandbox allows {sorted(enum)}, Settings {sorted(known)}"
    assert chart_values()["config"]["sandbox"] == "auto"
    assert re.search(r"^CISPO_SANDBOX:\s*\{\{\s*\.Values\.config\.sandbox\b", define_body("cispo.config"), re.M)
    for name in APP_SERVICES:
        assert service_env(compose_services()[name]).get("CISPO_SANDBOX") == "auto", f"{name}: CISPO_SANDBOX"
