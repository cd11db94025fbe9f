"""ORM models: the SQL rows that are the truth about projects, files and jobs.

Public ids are random and prefixed like OpenAI's (file-, ftjob-, ftevent-,
ftckpt_); an integer `seq` orders rows and backs the `after` cursors.
Timestamps are Unix seconds, as the public objects show them. These classes
are never returned by the API directly: service/schemas holds the public
shapes.
"""

from __future__ import annotations

import secrets
import time

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Sequence-like integer keys: BIGINT on PostgreSQL, INTEGER on SQLite so it stays the rowid alias.
SeqKey = BigInteger().with_variant(Integer(), "sqlite")


def now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Project(Base):
    __tablename__ = "project"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("proj_"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class ApiKey(Base):
    __tablename__ = "api_key"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("key_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # shown to humans to tell keys apart
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger)
    last_used_at: Mapped[int | None] = mapped_column(BigInteger)


class File(Base):
    __tablename__ = "file"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("file-"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    rows: Mapped[int] = mapped_column(Integer)
    storage_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class RewardFunction(Base):
    __tablename__ = "reward_function"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("rwfn-"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict] = mapped_column(JSON)  # a service.schemas.rewards spec
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class Environment(Base):
    """A registered multi-turn environment (a sandboxed Python class or a remote HTTP one)."""

    __tablename__ = "environment"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("env-"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class Secret(Base):
    """A value (e.g. a remote grader's auth header) that jobs may use and the API never returns.

    Stored encrypted (service/secrets/box.py) and bound to the hosts it may be sent to.
    """

    __tablename__ = "secret"
    __table_args__ = (UniqueConstraint("project_id", "name"),)
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("secret-"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    ciphertext: Mapped[str] = mapped_column(Text)
    hosts: Mapped[list] = mapped_column(JSON)  # host patterns (service.egress.host_matches)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class Job(Base):
    __tablename__ = "job"
    __table_args__ = (
        UniqueConstraint("project_id", "idempotency_key"),
        # The webhook outbox's work list (service/repositories/webhooks.py): only jobs it has not yet
        # turned into deliveries, so a pass never reads the long tail of old finished jobs.
        Index("ix_job_webhooks_pending", "finished_at", postgresql_where=text("webhooks_enqueued_at IS NULL"),
              sqlite_where=text("webhooks_enqueued_at IS NULL")),
    )
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("ftjob-"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(24), index=True)
    model: Mapped[str] = mapped_column(String(512))
    training_file: Mapped[str] = mapped_column(String(40))
    validation_file: Mapped[str | None] = mapped_column(String(40))
    reward_function_id: Mapped[str | None] = mapped_column(String(40), index=True)
    environment_id: Mapped[str | None] = mapped_column(String(40), index=True)
    spec: Mapped[dict] = mapped_column(JSON)  # the resolved JobSpec the worker runs
    method: Mapped[dict] = mapped_column(JSON)  # the request's method, echoed back
    seed: Mapped[int] = mapped_column(BigInteger)
    suffix: Mapped[str | None] = mapped_column(String(64))
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    request_sha256: Mapped[str | None] = mapped_column(String(64))

    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    started_at: Mapped[int | None] = mapped_column(BigInteger)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)
    total_steps: Mapped[int] = mapped_column(Integer)
    steps_done: Mapped[int] = mapped_column(Integer, default=0)
    trained_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    error_param: Mapped[str | None] = mapped_column(String(64))

    # Control requests from the API, honoured by the worker at a step boundary.
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    pause_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # The lease: who runs the job, a fencing epoch, and until when.
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_epoch: Mapped[int] = mapped_column(Integer, default=0)
    lease_expires_at: Mapped[float | None] = mapped_column(Float)
    # Runs that used up an attempt: the current one, and any that crashed or failed transiently
    # (a pause or a worker's graceful shutdown gives its attempt back).
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Set by DELETE /v1/models/{id}: the job stays, its adapter checkpoints are gone.
    model_deleted_at: Mapped[int | None] = mapped_column(BigInteger)
    # What the client sees of progress and results (written by the worker, fenced like metrics).
    estimated_finish: Mapped[int | None] = mapped_column(BigInteger)
    result_file_id: Mapped[str | None] = mapped_column(String(40))  # the metrics CSV (purpose fine-tune-results)
    tensorboard_file_id: Mapped[str | None] = mapped_column(String(40))  # the same metrics as a TensorBoard file
    # The worker's forecast of the reward curve (worker/evals/forecast.py), refit as points arrive; and the kept
    # checkpoint with the best eval (training.keep_best keeps it from being pruned).
    forecast: Mapped[dict | None] = mapped_column(JSON)
    best_checkpoint_id: Mapped[str | None] = mapped_column(String(40))
    # A job queued again after a failed attempt is not claimed before this moment (retry backoff).
    not_before: Mapped[float | None] = mapped_column(Float)
    # A queued job whose broker message could not be sent (the broker was down): the reconciler's next
    # pass sends it. Cleared when a message is sent or the job is claimed.
    enqueue_failed_at: Mapped[float | None] = mapped_column(Float)
    # Since when the object store has failed this job's runs (null: it has not, or a checkpoint was committed
    # since): until the outage deadline, a run it stops gives its attempt back.
    outage_since: Mapped[float | None] = mapped_column(Float)
    # When the webhook outbox made this job's deliveries, for good (null: not yet, or not yet settled).
    webhooks_enqueued_at: Mapped[int | None] = mapped_column(BigInteger)


class JobEvent(Base):
    __tablename__ = "job_event"
    # Pollers page a job's events newest first: (job_id, seq) answers that from the index alone.
    __table_args__ = (Index("ix_job_event_job_id_seq", "job_id", "seq"),)
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("ftevent-"))
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    level: Mapped[str] = mapped_column(String(8))
    type: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict | None] = mapped_column(JSON)


class JobMetric(Base):
    """One value per (job, step, name): a repeated write is harmless."""

    __tablename__ = "job_metric"
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[float] = mapped_column(Float)


class JobSample(Base):
    """A few of a step's completions, for people to read; (job, step, slot) is unique, so a repeat is harmless."""

    __tablename__ = "job_sample"
    __table_args__ = (UniqueConstraint("job_id", "step", "slot"),)
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    slot: Mapped[int] = mapped_column(Integer)  # its place among the step's samples
    prompt: Mapped[str] = mapped_column(Text)
    completion: Mapped[str] = mapped_column(Text)
    reward: Mapped[float | None] = mapped_column(Float)
    advantage: Mapped[float | None] = mapped_column(Float)
    rewards: Mapped[dict] = mapped_column(JSON)  # per component (a multi reward's parts, an episode's turns)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class WebhookEndpoint(Base):
    """Where a project's job outcomes are POSTed, signed with its secret (shown once, at registration)."""

    __tablename__ = "webhook_endpoint"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("whep_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    secret: Mapped[str] = mapped_column(String(100))  # whsec_<base64 key>: needed in clear to sign
    events: Mapped[list] = mapped_column(JSON)  # the event types it receives
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class WebhookDelivery(Base):
    """The outbox: one row per (endpoint, job outcome), sent until the receiver answers 2xx or we give up."""

    __tablename__ = "webhook_delivery"
    __table_args__ = (
        UniqueConstraint("endpoint_id", "job_id"),
        # Delivered and given-up rows stay for the deliveries list, but a send pass never reads them.
        Index("ix_webhook_delivery_pending", "next_attempt_at",
              postgresql_where=text("delivered_at IS NULL AND failed_at IS NULL"),
              sqlite_where=text("delivered_at IS NULL AND failed_at IS NULL")),
    )
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("evt_"))  # the webhook-id
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoint.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)  # when the event happened
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    delivered_at: Mapped[int | None] = mapped_column(BigInteger)
    failed_at: Mapped[int | None] = mapped_column(BigInteger)  # gave up after the last retry
    last_error: Mapped[str | None] = mapped_column(Text)


class Checkpoint(Base):
    __tablename__ = "checkpoint"
    __table_args__ = (UniqueConstraint("job_id", "step"),)
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("ftckpt_"))
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    storage_prefix: Mapped[str] = mapped_column(String(512))
    files: Mapped[dict] = mapped_column(JSON)  # relative path -> {sha256, bytes}
    metrics: Mapped[dict] = mapped_column(JSON)


class EvalRun(Base):
    """An eval run: a model (base, fine-tuned or a checkpoint) scored on a file, run by a worker (worker/evals/)."""

    __tablename__ = "eval_run"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("evalrun_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(24), index=True)  # queued, running, succeeded, failed, cancelled
    model: Mapped[str] = mapped_column(String(512))  # as the request named it
    checkpoint_id: Mapped[str | None] = mapped_column(String(40))  # None: the base model itself
    file_id: Mapped[str] = mapped_column(String(40))
    reward_function_id: Mapped[str | None] = mapped_column(String(40))
    spec: Mapped[dict] = mapped_column(JSON)  # the JobSpec the worker's eval harness runs
    result: Mapped[dict | None] = mapped_column(JSON)  # mean, interval, n, method, errors
    result_file_id: Mapped[str | None] = mapped_column(String(40))  # per-row JSONL (purpose "evals")
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON)
    owner: Mapped[str | None] = mapped_column(String(200))  # the worker running it
    lease_expires_at: Mapped[float | None] = mapped_column(Float)  # renewed by that worker (repositories/leases.py)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)  # honoured between chunks of rows
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    started_at: Mapped[int | None] = mapped_column(BigInteger)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)


# -- the Tinker API (service/api/routes/tinker.py): its requests and futures are rows -----------------------------


class TinkerSession(Base):
    """A Tinker SDK client's session: it heartbeats while alive; its models are released when it stops."""

    __tablename__ = "tinker_session"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("tsess_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    tags: Mapped[list] = mapped_column(JSON)
    user_metadata: Mapped[dict | None] = mapped_column(JSON)
    sdk_version: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)


class TinkerModel(Base):
    """A training client's LoRA model, "<session id>:train:<model seq id>" (the form the SDK's resume path
    builds by itself). Released when its session ends; its saved checkpoints stay."""

    __tablename__ = "tinker_model"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(120), unique=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("tinker_session.id", ondelete="CASCADE"), index=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    lora_config: Mapped[dict] = mapped_column(JSON)  # rank, seed, train_mlp, train_attn, train_unembed
    user_metadata: Mapped[dict | None] = mapped_column(JSON)  # the client's, shown back (the cookbook's renderer)
    worker_id: Mapped[str | None] = mapped_column(String(200))  # the runner that holds its adapter, once claimed
    held_at: Mapped[int | None] = mapped_column(BigInteger)  # that runner's last renewal: a stale hold is a dead one
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    released_at: Mapped[int | None] = mapped_column(BigInteger)
    # The fine-tuned model its sampler weights are (a job of method "tinker"), from its first save on.
    job_id: Mapped[str | None] = mapped_column(ForeignKey("job.id", ondelete="SET NULL"))


class TinkerSampler(Base):
    """A sampling session: a base model, or weights a training client saved for sampling (model_path, set by
    the runner once a snapshot is written)."""

    __tablename__ = "tinker_sampler"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(120), unique=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("tinker_session.id", ondelete="CASCADE"), index=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    model_path: Mapped[str | None] = mapped_column(String(1024))
    source_model_id: Mapped[str | None] = mapped_column(String(120))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class TinkerRequest(Base):
    """One submitted SDK call and its future: pending -> running -> done | failed.

    A training client numbers its calls seq_id 1, 2, ... (create_model, or a resuming load, is seq 0): they run
    per model in that order, and a retried submission of the same (model, seq_id) finds this row instead of
    adding one. Sampling calls are numbered per sampler the same way."""

    __tablename__ = "tinker_request"
    __table_args__ = (UniqueConstraint("model_id", "seq_id"), UniqueConstraint("sampler_id", "seq_id"))
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("treq_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    session_id: Mapped[str | None] = mapped_column(String(40))
    model_id: Mapped[str | None] = mapped_column(String(120))
    sampler_id: Mapped[str | None] = mapped_column(String(120))
    seq_id: Mapped[int | None] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(40))  # create_model, forward_backward, forward, optim_step, ...
    body: Mapped[bytes] = mapped_column(LargeBinary)  # as received
    body_type: Mapped[str] = mapped_column(String(16))  # json | protobuf
    state: Mapped[str] = mapped_column(String(16), index=True)
    result: Mapped[bytes | None] = mapped_column(LargeBinary)
    result_type: Mapped[str | None] = mapped_column(String(16))  # json | protobuf
    error: Mapped[str | None] = mapped_column(Text)
    error_category: Mapped[str | None] = mapped_column(String(16))  # user | server
    worker_id: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)


class TinkerCheckpoint(Base):
    """Saved weights by their tinker:// path ("tinker://<model id>/weights/<name>", ".../sampler_weights/<name>"),
    scoped to a project, and where the runner stored them."""

    __tablename__ = "tinker_checkpoint"
    seq: Mapped[int] = mapped_column(SeqKey, primary_key=True, autoincrement=True)
    path: Mapped[str] = mapped_column(String(1024), unique=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    model_id: Mapped[str] = mapped_column(String(120), index=True)
    kind: Mapped[str] = mapped_column(String(24))  # weights | sampler_weights
    storage_key: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)
