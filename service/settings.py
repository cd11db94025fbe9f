"""The one settings object, read from the environment once.

Every knob is a CISPO_* variable; DATABASE_URL, BROKER_URL and STORAGE_URL
are also read without the prefix, as deployment tools expect. The embedded
defaults (SQLite, a server-less broker, a local directory) need no servers.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _alias(name: str) -> AliasChoices:
    return AliasChoices(f"CISPO_{name}", name)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CISPO_", extra="ignore")

    home: Path = Field(Path(".cispo"), description="Where embedded state lives (database, broker, objects).")
    database_url: str = Field("", validation_alias=_alias("DATABASE_URL"))
    broker_url: str = Field("", validation_alias=_alias("BROKER_URL"))
    storage_url: str = Field("", validation_alias=_alias("STORAGE_URL"))

    max_upload_bytes: int = Field(512 * 1024 * 1024, gt=0)
    max_request_bytes: int = Field(4 * 1024 * 1024, gt=0, description="JSON bodies.")
    max_upload_line_bytes: int = Field(8 * 1024 * 1024, gt=0, description="One row of an uploaded JSONL file; "
                                       "a longer line is refused (400) without being read whole.")
    # Request bodies are received before the request takes an admission place (service/api/body_spool.py).
    body_timeout_s: float = Field(1800.0, gt=0, description="Wall time for one request body to arrive (408).")
    body_min_bytes_per_s: int = Field(16384, gt=0, description="A body slower than this on average, after "
                                      "body_grace_s, is refused (408).")
    body_grace_s: float = Field(10.0, ge=0, description="Seconds a body may send nothing at first.")
    uploads_per_project: int = Field(4, ge=1, description="File uploads a project may have in flight at once "
                                     "(per API process; more: 429).")
    uploads_total: int = Field(64, ge=1, description="File uploads in flight at once in one API process.")
    lease_ttl_s: float = Field(90.0, gt=0)
    heartbeat_s: float = Field(15.0, gt=0)
    max_attempts: int = Field(3, ge=1, description="Runs a job may use up; pauses and graceful shutdowns are free.")
    retry_backoff_s: float = Field(10.0, ge=0, description="Wait before the 2nd run (doubling each time, max 6 min).")
    outage_deadline_s: float = Field(1800.0, ge=0, description="How long a job waits out an unreachable object "
                                     "store (runs again with backoff, using no attempt); after it, failed runs "
                                     "count again.")
    ray_address: str = Field("", description="Address of the Ray cluster that runs jobs with resources.nodes "
                             "above 1 or resources.backend 'ray' (e.g. ray://raycluster-head:10001 or "
                             "head:6379); empty: such jobs are refused at create (400). Needs the `ray` extra.")
    ray_gang_timeout_s: float = Field(300.0, gt=0, description="How long a Ray job waits for its whole "
                                      "placement group (all its GPUs at once); then it goes back to queued, "
                                      "using no attempt, with the reason in its events.")
    broker_timeout_s: float = Field(5.0, gt=0, description="Socket timeout on the broker: a stalled Redis "
                                    "fails a send or a ping instead of hanging the API.")
    work_dir: Path | None = Field(None, description="Worker scratch space (default HOME/work).")
    worker_concurrency: int = Field(1, ge=1, le=64, description="Jobs a prefork worker runs at once, one per "
                                    "GPU: pool child i sees only the worker's GPU i (`cispo worker --concurrency`).")
    worker_jobs: int = Field(1, ge=1, le=64, description="LoRA jobs of one base model a worker (each pool child) "
                             "trains at once on one resident copy of the base (worker/multi/); 1: a job owns its "
                             "worker, today's path unchanged.")
    project_weights: dict[str, float] = Field(
        default_factory=dict, description="Fair share of shared workers' slots (CISPO_WORKER_JOBS > 1), JSON "
        "{project name: weight}, e.g. {\"research\": 2}; absent projects weigh 1 (equal weights: projects take "
        "turns). A project of weight 2 gets two slots of a base to another's one (service/fair_share.py).")
    worker_memory_gib: float | None = Field(
        None, gt=0, description="Memory a shared worker may fill with its base and its jobs (GiB); a job whose "
        "estimated peak does not fit beside the resident ones waits, queued. Default: 90% of the GPU's memory, "
        "or of the host's on a CPU (worker/multi/memory.py).")
    sandbox: Literal["auto", "namespaces", "off"] = Field("auto", description="User code: 'off' refuses it.")
    sandbox_uid: int = Field(100000, ge=1, description="The first of the uids sandboxes run as, one per live "
                             "sandbox (host-wide); no host user may own them.")
    sandbox_uid_count: int = Field(1000, ge=1, description="How many uids from sandbox_uid: live sandboxes at most.")
    egress_allow: str = Field(
        "", description="Comma-separated hosts, IPs or CIDRs that remote rewards and environments may reach "
        "even though they are not public addresses (e.g. an in-cluster grader), each optionally with :port "
        "(IPv6 in brackets: [fd00::1]:8000); without a port every port of that host is reachable."
    )
    judge_base_url: str = Field(
        "", description="OpenAI-compatible base URL (…/v1) that score_model graders call, e.g. an in-cluster "
        "vLLM server; empty: such graders must name their own base_url."
    )
    judge_api_key: str = Field("", description="Bearer key for judge_base_url; never shown by the API.")
    # The operator's judge is paid for by the operator: tenants may ask it only for listed models, for
    # short replies, and (in reward tests and grader runs) within a token budget; its text is never shown.
    judge_models: str = Field("", description="Comma-separated models score_model graders may ask "
                              "judge_base_url for; empty: none (such graders must name their own base_url).")
    judge_max_tokens: int = Field(1024, ge=1, le=65536, description="max_tokens of one judge reply from "
                                  "judge_base_url (a grader asking more is refused; one asking none gets this).")
    judge_tokens_per_project_hour: int = Field(200_000, ge=0, description="Tokens of judge_base_url a project's "
                                               "reward tests and grader runs may use per hour (per API process); "
                                               "past it: 429.")
    metrics_token: str = Field(
        "", description="Bearer token Prometheus sends to scrape GET /metrics; empty: /metrics is off (404)."
    )
    model_hub_url: str = Field("https://huggingface.co", description="Where a dry run fetches the config.json "
                               "of a hub model not in the cache (an unreachable hub fails that check: no worker "
                               "could download it); empty: never fetch (the check is a warning).")

    # Capacity: every API worker thread can hold a database connection, so a burst of pollers waits in
    # the threadpool (fair, bounded) instead of timing out on the connection pool.
    api_threads: int = Field(40, ge=1, le=1000, description="Threads that run the API's blocking routes.")
    db_pool_size: int = Field(10, ge=1, description="Connections the API keeps open (more open on demand, "
                              "up to api_threads + 4).")
    # Polling: many clients asking after one job each second. Both caches are per API process.
    auth_cache_s: float = Field(1.0, ge=0, le=1, description="Seconds an API key's lookup is reused; a revoked "
                                "key is refused within this bound. 0: every request looks the key up.")
    poll_cache_s: float = Field(1.0, ge=0, le=1, description="Seconds a job's GET and events pages are reused "
                                "(per project and job); 0: every poll queries the database.")
    # Tenancy limits: shared by all API replicas in Redis when the broker is Redis, else per API process
    # (service/api/ratelimit.py).
    rate_limit_per_s: float = Field(20.0, gt=0, description="Sustained requests per second per API key.")
    rate_limit_burst: int = Field(100, ge=1, description="Requests an API key may send at once.")
    max_active_jobs: int = Field(10, ge=1, description="Queued plus running jobs per project.")
    max_active_evals: int = Field(4, ge=1, description="Queued plus running eval runs per project: evals share "
                                  "the jobs' workers, so one project's evals cannot fill the queue.")
    scoring_timeout_s: float = Field(60.0, gt=0, le=3600, description="Wall time of one reward test or "
                                     "grader run.")
    scoring_per_project: int = Field(2, ge=1, description="Concurrent reward tests / grader runs per project.")
    scoring_total: int = Field(8, ge=1, description="Concurrent reward tests / grader runs in all (in one API "
                               "process without Redis).")
    limits_timeout_s: float = Field(0.25, gt=0, le=5, description="Socket timeout on the Redis that holds the "
                                    "limits: past it a request is checked against this replica's own limits.")
    model_dirs: str = Field("", description="Comma-separated directories under which jobs may name a local "
                            "model; empty: only hub ids are accepted.")
    # Hugging Face's own variables, read here so the API knows what its workers can load (same cache, same mode).
    hf_hub_offline: bool = Field(False, validation_alias=AliasChoices("CISPO_HF_HUB_OFFLINE", "HF_HUB_OFFLINE"),
                                 description="The workers download nothing: a hub id must be in the model cache.")
    hf_hub_cache: Path | None = Field(None, validation_alias=AliasChoices("CISPO_HF_HUB_CACHE", "HF_HUB_CACHE"),
                                      description="The model cache; default: HF_HOME/hub.")
    hf_home: Path = Field(Path("~/.cache/huggingface"), validation_alias=AliasChoices("CISPO_HF_HOME", "HF_HOME"))
    # Serving (POST /v1/chat/completions, /v1/completions; service/serving, worker/serving).
    serve_base_models: str = Field("", description="Comma-separated base models served as they are to every "
                                   "project (a project may always call the bases its own jobs trained on).")
    serve_models: str = Field("", description="Comma-separated bases `cispo serve` keeps resident when given no "
                              "--model; empty: whichever base a request names, loaded on first use.")
    serve_accept_timeout_s: float = Field(10.0, gt=0, le=600, description="Seconds a serving worker has to "
                                          "take a request before the API answers 503.")
    serve_reply_timeout_s: float = Field(300.0, gt=0, description="Seconds the API waits for a serving "
                                         "worker's next message (loading a base, a token) before giving up.")
    serve_adapters_cached: int = Field(8, ge=1, description="LoRA adapters a serving worker keeps loaded on "
                                       "its resident base (least recently used are dropped).")
    serve_max_tokens: int = Field(4096, ge=1, description="The most tokens one completion may ask for.")
    serve_max_waiting: int = Field(256, ge=1, description="Chat and completion requests one API process waits on "
                                   "serving workers for at once, each on a thread of a pool of their own (not the "
                                   "API's: waiting chats never slow its other routes); one more is a 429.")
    serve_max_waiting_per_project: int = Field(64, ge=1, description="Of those, the most one project may hold; "
                                               "one more is a 429 (code serving_quota_exceeded).")
    tracking_file_roots: str = Field("", description="Comma-separated directories under which a job's mlflow "
                                     "integration may name a file: store; empty: only http(s) servers.")
    wandb_entities: str = Field("", description="Comma-separated W&B entities a job's wandb integration may "
                                "name (runs log with the worker's key); empty: none, runs go to the key's default "
                                "entity. Every project's runs go to W&B projects named <project id>-<name>.")
    # The Tinker API (service/api/routes/tinker.py): the SDK's training clients and samplers, run by worker/tinker/.
    tinker_base_models: str = Field("", description="Comma-separated base models Tinker training clients and "
                                    "samplers may name (get_server_capabilities lists them); empty: those of "
                                    "serve_base_models. A local directory under model_dirs is accepted as well.")
    tinker_max_body_bytes: int = Field(16 * 1024 * 1024, gt=0, description="A protobuf request body of the Tinker "
                                       "API (a forward_backward chunk: the SDK sends up to about 5 MB).")
    tinker_session_timeout_s: float = Field(120.0, gt=0, description="A Tinker session whose heartbeats (the SDK "
                                            "sends one every 10 s) stopped this long ago ends; its models are "
                                            "released, their saved checkpoints stay.")
    tinker_poll_hold_s: float = Field(25.0, ge=0, le=40, description="How long POST /api/v1/retrieve_future holds "
                                      "a poll for a request that has not ended before it answers try_again "
                                      "(the SDK reads for 45 s).")
    tinker_request_retention_s: float = Field(86400.0, gt=0, description="How long an ended Tinker request "
                                              "(its future's result) is kept before the reconciler deletes it.")
    tinker_max_training_clients: int = Field(8, ge=1, description="Live Tinker training clients (LoRA models) "
                                             "per project.")
    tinker_max_saved_states: int = Field(200, ge=1, description="Unexpired saved Tinker checkpoints (weights and "
                                         "sampler weights) per project.")
    secret_key: str = Field("", description="Fernet key that encrypts project secrets at rest; empty: a key "
                            "file HOME/secret.key (mode 0600) is created and used.")

    @field_validator("egress_allow")
    @classmethod
    def _allow_list_parses(cls, v: str) -> str:
        from service.egress import EgressPolicy  # fail at start-up on a typo, not at the first remote call

        EgressPolicy.from_setting(v)
        return v

    @field_validator("worker_memory_gib", mode="before")
    @classmethod
    def _empty_memory_is_the_default(cls, v):
        # docker-compose passes an unset CISPO_WORKER_MEMORY_GIB through as "" (${CISPO_WORKER_MEMORY_GIB:-}).
        return None if v == "" else v

    @field_validator("project_weights")
    @classmethod
    def _positive_weights(cls, v: dict[str, float]) -> dict[str, float]:
        if bad := [name for name, weight in v.items() if not 0 < weight < float("inf")]:
            raise ValueError(f"project weights must be positive numbers: {', '.join(bad)}")
        return v

    @field_validator("database_url")
    @classmethod
    def _psycopg3(cls, v: str) -> str:
        # SQLAlchemy picks psycopg2 for plain postgresql:// URLs; we ship psycopg 3.
        for plain in ("postgresql://", "postgres://"):
            if v.startswith(plain):
                return "postgresql+psycopg://" + v[len(plain) :]
        return v

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'cispo.db').resolve()}"

    def resolved_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{(self.home / 'broker.db').resolve()}"

    def resolved_storage_url(self) -> str:
        return self.storage_url or str((self.home / "objects").resolve())

    def resolved_judge_models(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.judge_models.split(",") if m.strip())

    def resolved_serve_base_models(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.serve_base_models.split(",") if m.strip())

    def resolved_tinker_base_models(self) -> tuple[str, ...]:
        listed = tuple(m.strip() for m in self.tinker_base_models.split(",") if m.strip())
        return listed or self.resolved_serve_base_models()

    def resolved_serve_models(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.serve_models.split(",") if m.strip())

    def resolved_model_dirs(self) -> tuple[Path, ...]:
        return tuple(Path(d.strip()).resolve() for d in self.model_dirs.split(",") if d.strip())

    def resolved_hf_hub_cache(self) -> Path:
        return (self.hf_hub_cache or self.hf_home / "hub").expanduser()

    def resolved_tracking_file_roots(self) -> tuple[Path, ...]:
        return tuple(Path(d.strip()).resolve() for d in self.tracking_file_roots.split(",") if d.strip())

    def resolved_wandb_entities(self) -> tuple[str, ...]:
        return tuple(e.strip() for e in self.wandb_entities.split(",") if e.strip())

    def resolved_work_dir(self) -> Path:
        return (self.work_dir or self.home / "work").resolve()


@lru_cache
def get_settings() -> Settings:
    return Settings()
