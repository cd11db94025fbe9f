"""Static checks that the deployments give the worker's sandbox what its code uses, and wire the newer settings.

Like test_manifests.py (whose parsing helpers this reuses), nothing here runs
docker, helm or Kubernetes: the files are cross-checked against the code. The
sandbox needs a uid range no one else owns, node-wide uid leases under /run,
and a writable cgroup (the worker entrypoint's job); the API needs its
/metrics token as a secret.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from service.sandbox import cgroup as sandbox_cgroup, uids as sandbox_uids
from service.settings import Settings
from tests.deploy.test_manifests import (
    APP_SERVICES,
    COMPOSE,
    REPO,
    TEMPLATES,
    _COMMENT,
    chart_values,
    compose_services,
    containers,
    define_body,
    docker_ignored,
    dockerfile_stages,
    exec_form,
    one,
    service_env,
    stage_chain,
    values_schema,
)

ENTRYPOINT = REPO / "docker" / "worker-entrypoint.sh"
SANDBOX_MODULES = ("service/sandbox/launch.py", "service/sandbox/probe.py", "service/sandbox/cgroup.py",
                   "service/sandbox/uids.py", "service/sandbox/spawn.py")
SECRET_SETTINGS = ("CISPO_METRICS_TOKEN", "CISPO_JUDGE_API_KEY")
# Settings a deployment may leave at their defaults, and why.
DEFAULTS_SUFFICE = {
    "tracking_file_roots": "mlflow integrations log to http(s) servers only",
    "wandb_entities": "W&B runs go to the worker key's default entity",
    "hf_hub_offline": "Hugging Face's HF_HUB_OFFLINE, read by the workers' transformers too",
    "hf_hub_cache": "Hugging Face's HF_HUB_CACHE: HF_HOME/hub",
    "hf_home": "Hugging Face's HF_HOME: ~/.cache/huggingface",
    "max_request_bytes": "4 MiB JSON bodies",
    "max_attempts": "3 attempts per job",
    "work_dir": "HOME/work, on the worker's CISPO_HOME volume",
    "retry_backoff_s": "10 s before a job's 2nd run, doubling",
    "broker_timeout_s": "5 s socket timeout on Redis",
    "api_threads": "40 threads, with the pool and admission sized to match",
    "db_pool_size": "10 connections per API process",
    "rate_limit_per_s": "20 requests/s per key",
    "rate_limit_burst": "bursts of 100",
    "max_active_jobs": "10 queued or running jobs per project",
    "max_active_evals": "4 queued or running eval runs per project",
    "scoring_timeout_s": "60 s per reward test",
    "scoring_per_project": "2 reward tests at once per project",
    "scoring_total": "8 reward tests at once in all",
    "limits_timeout_s": "0.25 s on the limits' Redis, then each replica's own limits",
    "model_hub_url": "the Hugging Face hub, for dry runs' config checks",
    "serve_models": "set on the serving deployments only (chart serving.models, compose CISPO_SERVE_MODEL)",
    "serve_base_models": "no base model served to every project; each its own jobs' bases",
    "serve_accept_timeout_s": "10 s for a serving worker to take a request, then 503",
    "serve_reply_timeout_s": "5 min between a serving worker's messages",
    "serve_adapters_cached": "8 adapters loaded per serving worker",
    "serve_max_tokens": "4096 tokens per completion",
    "serve_max_waiting": "256 chat requests waiting per API process, on threads of their own",
    "serve_max_waiting_per_project": "64 of them per project",
    "tinker_max_body_bytes": "16 MiB per Tinker request body (the SDK sends up to about 5 MB)",
    "tinker_session_timeout_s": "a Tinker session ends 120 s after its last heartbeat",
    "tinker_poll_hold_s": "a future's poll is held 25 s",
    "tinker_request_retention_s": "ended Tinker requests are kept a day",
    "tinker_max_training_clients": "8 live Tinker training clients per project",
    "tinker_max_saved_states": "200 saved Tinker checkpoints per project",
    "model_dirs": "hub ids only: a hosted service takes no paths on its hosts",
    "auth_cache_s": "a checked key is trusted for 1 s",
    "poll_cache_s": "a job's GET and event pages are reused for 1 s",
    "max_upload_line_bytes": "8 MiB per JSONL row",
    "body_timeout_s": "30 min for one request body",
    "body_min_bytes_per_s": "16 KiB/s on average after the grace",
    "body_grace_s": "10 s before a body must keep the minimum rate",
    "uploads_per_project": "4 uploads in flight per project and API process",
    "uploads_total": "64 uploads in flight per API process",
    "judge_max_tokens": "1024 tokens per reply of the service's judge",
    "judge_tokens_per_project_hour": "200 000 judge tokens per project and hour for reward tests",
    "worker_concurrency": "one job per worker: compose and the chart give each worker one GPU",
    "outage_deadline_s": "30 min of object-store outage before a job's failed runs use attempts",
}


def lease_dir_with_writable_run(monkeypatch) -> Path:
    """Where the worker keeps its uid leases in a container whose /run is writable (as the deployments make it)."""
    real_access = os.access
    monkeypatch.setattr(sandbox_uids.os, "access", lambda p, m: str(p) == "/run" or real_access(p, m))
    return sandbox_uids.lease_dir()


def raw_compose_env(service: str) -> dict:
    """A compose service's environment before interpolation (anchors merged by the YAML loader)."""
    return yaml.safe_load(COMPOSE.read_text())["services"][service]["environment"]


def settings_from(env: dict[str, str], monkeypatch) -> Settings:
    for key in list(os.environ):
        if key.startswith("CISPO_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings()


def assert_uid_range_is_safe(where: str, first: int, count: int) -> None:
    uids = range(first, first + count)
    assert 0 not in uids, f"{where}: the sandbox uid range includes root"
    for taken, who in ((10001, "the api image's user"), (65534, "nobody, which host daemons share")):
        assert taken not in uids, f"{where}: the sandbox uid range includes {taken} ({who})"
    assert (first, count) == (100000, 1000), (
        f"{where}: sandbox uids {first}-{first + count - 1}, the documented range is 100000-100999")


# -- the code the deployments must serve ------------------------------------------


def test_sandbox_code_never_chowns_so_the_deployments_grant_neither_chown_nor_fowner():
    for module in SANDBOX_MODULES:
        text = (REPO / module).read_text()
        assert not re.search(r"\b(?:l|f)?chown\(", text), f"{module} chowns: the worker would need CHOWN (and FOWNER)"
    launcher = (REPO / "service/sandbox/launch.py").read_text()
    assert re.search(r"uid=\{config\['uid'\]\}", launcher), "the workdir tmpfs is no longer mounted owned by the uid"


# -- the worker entrypoint (cgroups) ------------------------------------------------


def test_worker_image_runs_the_cgroup_entrypoint_under_tini():
    chain = stage_chain(dockerfile_stages(), "worker")
    entrypoint = exec_form([rest for instr, rest in chain if instr == "ENTRYPOINT"][-1])
    assert entrypoint[:2] == ["/usr/bin/tini", "--"], "tini must stay PID 1 (SIGTERM forwarding, reaping)"
    assert entrypoint[2:] == ["/bin/sh", "/app/docker/worker-entrypoint.sh"], entrypoint
    assert not docker_ignored("docker/worker-entrypoint.sh"), ".dockerignore leaves the entrypoint out"
    runs = " ".join(rest for instr, rest in chain if instr == "RUN")
    assert "sh -n /app/docker/worker-entrypoint.sh" in runs, "the worker build does not check the entrypoint parses"
    assert re.search(r"apt-get install[^&]*\bmount\b", runs), "the worker image may lack `mount` for the remount"
    api_entry = [rest for instr, rest in stage_chain(dockerfile_stages(), "api") if instr == "ENTRYPOINT"][-1]
    assert "worker-entrypoint" not in api_entry, "the api image needs no cgroup"


def test_entrypoint_parses_and_hands_over_the_exact_command():
    subprocess.run(["sh", "-n", str(ENTRYPOINT)], check=True)
    argv = ["printf", "[%s]", "a b", "$HOME", "--pool", "prefork"]
    run = subprocess.run(["sh", str(ENTRYPOINT), *argv], env={"PATH": os.environ["PATH"], "CISPO_SANDBOX": "off"},
                         capture_output=True, text=True, timeout=10)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout == "[a b][$HOME][--pool][prefork]"  # exec "$@": no word splitting, no expansion, no shell left


def test_entrypoint_prepares_the_cgroup_layout_service_sandbox_cgroup_expects():
    script = ENTRYPOINT.read_text()
    code = [ln for ln in script.splitlines() if not ln.lstrip().startswith("#")]
    body = "\n".join(code)
    assert 'leaf="$root/' + sandbox_cgroup.WORKER_LEAF + '"' in body, "the leaf is not sandbox_cgroup.WORKER_LEAF"
    wanted = " ".join("+" + c for c in sandbox_cgroup.CONTROLLERS)
    assert f'echo "{wanted}" > "$root/cgroup.subtree_control"' in body, (
        "it does not delegate sandbox_cgroup.CONTROLLERS")
    # Only at the root of a cgroup namespace that is not the host's real root (cgroup.type exists
    # on every cgroup but that one): the host's own processes must never be moved.
    assert '[ -f "$root/cgroup.type" ]' in body and '"$(cat /proc/self/cgroup)" = "0::/"' in body
    assert re.search(r'"\$\{CISPO_SANDBOX:-auto\}" != "off"', body), "the cgroup is touched even with the sandbox off"
    assert "mount -o remount,bind,rw" in body, "remount the mount only: the superblock is the host's"
    assert code[-1] == 'exec "$@"', "the entrypoint must end by exec'ing the command (tini's child, signals reach it)"


# -- docker compose -------------------------------------------------------------


def test_compose_worker_gets_a_private_cgroup_namespace_and_host_wide_uid_leases(monkeypatch):
    worker = compose_services()["worker"]
    assert worker.get("cgroup") == "private", "the entrypoint's remount would reach the host's cgroup tree"
    leases = str(lease_dir_with_writable_run(monkeypatch))
    assert leases == "/run/cispo-sandbox-uids"
    binds = [v for v in worker.get("volumes", []) if isinstance(v, str) and v.count(":") >= 1]
    assert f"{leases}:{leases}" in binds, f"the uid leases are not the host's {leases}: {binds}"
    assert "read_only" not in worker or worker["read_only"] is False, "a read-only root leaves /run unwritable"
    for name, svc in compose_services().items():
        if name != "worker":
            assert not any("/run/" in str(v) for v in svc.get("volumes", [])), f"{name} mounts a host /run path"


def test_compose_sandbox_uid_range_reaches_settings(monkeypatch):
    services = compose_services()
    for name in APP_SERVICES:
        env = service_env(services[name])
        settings = settings_from({k: v for k, v in env.items() if k.startswith("CISPO_")}, monkeypatch)
        assert_uid_range_is_safe(name, settings.sandbox_uid, settings.sandbox_uid_count)
    assert "65534" not in COMPOSE.read_text(), "a comment still says the sandbox runs as 65534"


def test_compose_metrics_token_is_a_secret_of_the_api_only(monkeypatch):
    services = compose_services()
    api = service_env(services["api"])
    assert "CISPO_METRICS_TOKEN" in api, "the API cannot be given a /metrics token"
    assert api["CISPO_METRICS_TOKEN"] == "", "with no token set, /metrics must stay off"
    assert settings_from({"CISPO_METRICS_TOKEN": api["CISPO_METRICS_TOKEN"]}, monkeypatch).metrics_token == ""
    for name in ("migrate", "worker"):
        assert "CISPO_METRICS_TOKEN" not in service_env(services[name]), f"{name} gets the /metrics token"
    for service in APP_SERVICES:
        raw = raw_compose_env(service)
        for key in SECRET_SETTINGS:
            if key in raw:
                assert re.fullmatch(r"\$\{" + key + r":-\}", str(raw[key])), (
                    f"{service}: {key} must come from the environment or .env, not the file: {raw[key]!r}")
    assert "/metrics" in COMPOSE.read_text() and "Bearer" in COMPOSE.read_text(), "no scrape job documented"


# -- helm -------------------------------------------------------------------------


def test_chart_config_and_secret_wire_the_newer_settings(monkeypatch):
    config = define_body("cispo.config")
    secret = define_body("cispo.secretData")
    wiring = {"CISPO_SANDBOX_UID": r"\.Values\.config\.sandboxUid\b",
              "CISPO_SANDBOX_UID_COUNT": r"\.Values\.config\.sandboxUidCount\b",
              "CISPO_EGRESS_ALLOW": r"\.Values\.config\.egressAllow\b",
              "CISPO_JUDGE_BASE_URL": r"\.Values\.config\.judgeBaseUrl\b"}
    for key, ref in wiring.items():
        assert re.search(rf"^{key}:\s*\{{\{{\s*{ref}", config, re.M), f"the ConfigMap does not set {key} from {ref}"
    for key, value in (("CISPO_METRICS_TOKEN", "metricsToken"), ("CISPO_JUDGE_API_KEY", "judgeApiKey")):
        assert key not in config, f"{key} is a secret, not config"
        # Only when set: an empty key in the Secret would still turn nothing on, but hides existingSecret's.
        only_when_set = (r"\{\{-?\s*with\s+\.Values\.secrets\." + value + r"\s*\}\}\s*\n"
                         + key + r":\s*\{\{\s*\.\s*\|\s*b64enc")
        assert re.search(only_when_set, secret), f"the Secret does not carry {key} from secrets.{value} when it is set"
    values = chart_values()
    settings = settings_from({"CISPO_SANDBOX_UID": str(values["config"]["sandboxUid"]),
                              "CISPO_SANDBOX_UID_COUNT": str(values["config"]["sandboxUidCount"]),
                              "CISPO_EGRESS_ALLOW": values["config"]["egressAllow"],
                              "CISPO_JUDGE_BASE_URL": values["config"]["judgeBaseUrl"]}, monkeypatch)
    assert_uid_range_is_safe("values.yaml", settings.sandbox_uid, settings.sandbox_uid_count)
    assert values["secrets"]["metricsToken"] == "" and values["secrets"]["judgeApiKey"] == ""
    text = "\n".join(p.read_text() for p in [TEMPLATES.parent / "values.yaml", *TEMPLATES.iterdir()])
    assert "65534" not in text, "the chart still says the sandbox runs as 65534"


def test_every_setting_is_deployed_or_fine_at_its_default():
    compose_env = set(service_env(compose_services()["api"])) | set(service_env(compose_services()["worker"]))
    chart_keys = set(re.findall(r"^([A-Z][A-Z0-9_]*):", define_body("cispo.config") + define_body("cispo.secretData"),
                                re.M))
    for name, field in Settings.model_fields.items():
        if name in DEFAULTS_SUFFICE:
            continue
        names = {f"CISPO_{name.upper()}"} | set(getattr(field.validation_alias, "choices", ()) or ())
        assert names & compose_env, f"docker-compose.yml does not set {sorted(names)} (or add it to DEFAULTS_SUFFICE)"
        assert names & chart_keys, f"the chart does not set {sorted(names)} (or add it to DEFAULTS_SUFFICE)"


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda v: v["config"].update(sandboxUid=0), id="sandbox-uid-root"),
    pytest.param(lambda v: v["config"].update(sandboxUidCount=0), id="no-sandbox-uids"),
    pytest.param(lambda v: v["config"].update(sandboxUid="100000"), id="sandbox-uid-as-string"),
    pytest.param(lambda v: v["config"]["extraEnv"].update(CISPO_METRICS_TOKEN="t"), id="metrics-token-in-configmap"),
    pytest.param(lambda v: v["config"].update(judgeBaseUrl="judge:8000"), id="judge-url-without-scheme"),
    pytest.param(lambda v: v["worker"].update(sandboxUidLeaseVolume={"emptyDir": {}}), id="per-pod-uid-leases"),
    pytest.param(lambda v: v["metrics"].update(scrape="yes"), id="scrape-not-boolean"),
])
def test_schema_refuses_wrong_sandbox_and_metrics_values(mutate):
    import copy

    values = copy.deepcopy(chart_values())
    jsonschema.Draft7Validator(values_schema()).validate(values)
    mutate(values)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(values_schema()).validate(values)


def test_chart_worker_has_a_writable_run_and_node_wide_uid_leases(monkeypatch):
    _, doc, _ = one("Deployment", "worker")
    (c,) = containers(doc)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
    leases = str(lease_dir_with_writable_run(monkeypatch))
    assert "/run" in mounts and "emptyDir" in volumes[mounts["/run"]], "/run is not writable under the read-only root"
    assert leases in mounts, f"the uid leases ({leases}) are per pod"
    volume = chart_values()["worker"]["sandboxUidLeaseVolume"]
    assert volume == {"hostPath": {"path": leases, "type": "DirectoryOrCreate"}}, volume
    text = _COMMENT.sub("", (TEMPLATES / "worker-deployment.yaml").read_text())
    block = text.split("- name: sandbox-uids")[-1].split("{{- end }}", 1)[0]  # the volume, after the mount
    assert "toYaml .Values.worker.sandboxUidLeaseVolume" in block
    # With the sandbox off the worker gets the API's strict contexts: then no host path either.
    for part in text.split("- name: sandbox-uids")[:-1]:
        assert re.search(r'\{\{-\s*if\s+ne\s+\.Values\.config\.sandbox\s+"off"\s*\}\}(?:\s*#[^\n]*)*\s*$', part), (
            "the uid lease volume is mounted even with config.sandbox off")


def test_chart_metrics_scrape_annotations_and_notes():
    text = _COMMENT.sub("", (TEMPLATES / "api-deployment.yaml").read_text())
    annotations = text.split("annotations:", 1)[1].split("spec:", 1)[0]
    block = re.search(r"\{\{-\s*if\s+\.Values\.metrics\.scrape\s*\}\}(.*?)\{\{-\s*end\s*\}\}", annotations, re.S)
    assert block, "the prometheus.io annotations are not behind metrics.scrape"
    found = dict(re.findall(r"^\s*(prometheus\.io/\w+):\s*(.+?)\s*$", block.group(1), re.M))
    assert found == {"prometheus.io/scrape": '"true"', "prometheus.io/path": "/metrics",
                     "prometheus.io/port": "{{ .Values.api.port | quote }}"}, found
    assert chart_values()["metrics"]["scrape"] is False
    notes = (TEMPLATES / "NOTES.txt").read_text()
    assert "metrics_path: /metrics" in notes and "type: Bearer" in notes and "CISPO_METRICS_TOKEN" in notes
    sources = "\n".join(p.read_text() for p in (REPO / "service" / "api").rglob("*.py"))
    assert '"/metrics"' in sources, "no /metrics route in service/api"
