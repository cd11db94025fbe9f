"""SQL of the Tinker API: sessions, models, samplers, checkpoints, and the request rows that are its futures.

A submitted call is a row (pending -> running -> done | failed) until its result is fetched and after: a result
survives an API restart. The API writes rows (`submit`) and reads them (`get_request`); the runner
(worker/tinker/) claims ready rows (`claim_ready`) and ends them (`complete`, `fail`).

Order: a training client numbers its calls seq_id 1, 2, ... per model, and create_model (or the load that
creates a model) is its seq 0. A model's request may run once every lower seq_id of that model has ended. The
SDK sends a large forward_backward as concurrent chunks with consecutive seq_ids, the first chunk last, so a
lower seq_id may not have arrived yet: the request waits for it, but only GAP_GRACE_S after it arrived itself
(a client that died between chunks must not stall its model forever); a late chunk then runs after the ones that
went ahead. Requests of no model (sampling, create_session) are ready at once.

Retries: the same (model, seq_id) or (sampler, seq_id) submitted again finds the first row (a unique key; a
racing insert that loses reads the winner's row) and answers its request id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import and_, delete, exists, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from service.db.models import (Checkpoint, Job, Project, TinkerCheckpoint, TinkerModel, TinkerRequest, TinkerSampler,
                               TinkerSession, now)
from service.repositories.inserts import upsert
from service.repositories.jobs import add_event

GAP_GRACE_S = 2.0
# A runner renews its holds every few seconds (renew_holds); one not renewed for this long is a dead runner's,
# and another runner may end it (abandoned_holds).
HOLD_TTL_S = 60
# An ended request keeps its result, not its body (a forward_backward chunk is up to ~5 MB): the row still
# dedupes a late retry and answers its future.
ENDED_BODY = b""
OPEN = ("pending", "running")
CREATE_SEQ_ID = 0  # create_model's (or a creating load's) place in its model's order


@dataclass(frozen=True)
class RequestRow:
    """A request as plain values, so nothing ORM-bound outlives the transaction that read it."""

    id: str
    project_id: str
    session_id: str | None
    model_id: str | None
    sampler_id: str | None
    seq_id: int | None
    kind: str
    body: bytes
    body_type: str
    state: str
    result: bytes | None
    result_type: str | None
    error: str | None
    error_category: str | None
    worker_id: str | None


def _plain(row: TinkerRequest) -> RequestRow:
    return RequestRow(id=row.id, project_id=row.project_id, session_id=row.session_id, model_id=row.model_id,
                      sampler_id=row.sampler_id, seq_id=row.seq_id, kind=row.kind, body=bytes(row.body),
                      body_type=row.body_type, state=row.state,
                      result=bytes(row.result) if row.result is not None else None, result_type=row.result_type,
                      error=row.error, error_category=row.error_category, worker_id=row.worker_id)


# -- sessions ------------------------------------------------------------------


def create_session(session: Session, project_id: str, *, tags: list[str], user_metadata: dict | None,
                   sdk_version: str) -> str:
    row = TinkerSession(project_id=project_id, tags=tags, user_metadata=user_metadata, sdk_version=sdk_version,
                        heartbeat_at=time.time())
    session.add(row)
    session.flush()
    return row.id


def get_session(session: Session, project_id: str, session_id: str) -> TinkerSession | None:
    return session.scalar(select(TinkerSession).where(TinkerSession.id == session_id,
                                                      TinkerSession.project_id == project_id))


def heartbeat(session: Session, project_id: str, session_id: str) -> bool | None:
    """Renew a live session; False when it has finished (or expired), None when the project has no such one."""
    done = session.execute(update(TinkerSession)
                           .where(TinkerSession.id == session_id, TinkerSession.project_id == project_id,
                                  TinkerSession.finished_at.is_(None))
                           .values(heartbeat_at=time.time()).execution_options(synchronize_session=False))
    if done.rowcount == 1:
        return True
    return False if get_session(session, project_id, session_id) is not None else None


def _drop_pending_of(session: Session, session_ids: list[str], why: str) -> None:
    """Fail the requests of ended sessions that no runner took yet: nobody waits for them any more."""
    session.execute(update(TinkerRequest)
                    .where(TinkerRequest.session_id.in_(session_ids), TinkerRequest.state == "pending")
                    .values(state="failed", error=why, error_category="user", finished_at=time.time(),
                            body=ENDED_BODY)
                    .execution_options(synchronize_session=False))


def finish_session(session: Session, project_id: str, session_id: str) -> bool:
    """End a session and release its models (their saved checkpoints stay); its requests not yet taken fail.
    False when the project has no such session. Finishing twice is harmless."""
    if get_session(session, project_id, session_id) is None:
        return False
    t = now()
    session.execute(update(TinkerSession).where(TinkerSession.id == session_id, TinkerSession.finished_at.is_(None))
                    .values(finished_at=t).execution_options(synchronize_session=False))
    session.execute(update(TinkerModel).where(TinkerModel.session_id == session_id, TinkerModel.released_at.is_(None))
                    .values(released_at=t).execution_options(synchronize_session=False))
    _drop_pending_of(session, [session_id], "the session ended before this request ran")
    return True


def expire_sessions(session: Session, now_s: float, timeout_s: float) -> list[str]:
    """Finish the sessions whose heartbeats stopped `timeout_s` before `now_s`; returns the models that released
    (the runner may drop their adapters). Saved checkpoints stay; their requests not yet taken fail."""
    stale = list(session.scalars(select(TinkerSession.id).where(TinkerSession.finished_at.is_(None),
                                                                TinkerSession.heartbeat_at < now_s - timeout_s)))
    if not stale:
        return []
    released = list(session.scalars(select(TinkerModel.id).where(TinkerModel.session_id.in_(stale),
                                                                 TinkerModel.released_at.is_(None))))
    t = int(now_s)
    session.execute(update(TinkerSession).where(TinkerSession.id.in_(stale), TinkerSession.finished_at.is_(None))
                    .values(finished_at=t).execution_options(synchronize_session=False))
    session.execute(update(TinkerModel).where(TinkerModel.id.in_(released), TinkerModel.released_at.is_(None))
                    .values(released_at=t).execution_options(synchronize_session=False))
    _drop_pending_of(session, stale, "the session stopped sending heartbeats before this request ran")
    return released


def released_held(session: Session, worker_id: str) -> list[str]:
    """The runner: models it holds whose session ended (a finish, or the reconciler's expiry); it drops their
    adapters, and they are held by nobody from here on."""
    released = list(session.scalars(select(TinkerModel.id).where(TinkerModel.worker_id == worker_id,
                                                                 TinkerModel.released_at.is_not(None))))
    if released:
        session.execute(update(TinkerModel).where(TinkerModel.id.in_(released)).values(worker_id=None)
                        .execution_options(synchronize_session=False))
    return released


# -- models and samplers ---------------------------------------------------------


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The id the SDK itself derives when it resumes a training client from a saved state."""
    return f"{session_id}:train:{model_seq_id}"


def add_model(session: Session, project_id: str, session_id: str, model_seq_id: int, *, base_model: str,
              lora_config: dict, user_metadata: dict | None = None) -> str:
    """The model row of a create_model (or of a load that creates the model); the same call again is harmless."""
    model_id = model_id_for(session_id, model_seq_id)
    if session.scalar(select(TinkerModel.id).where(TinkerModel.id == model_id)) is None:
        session.add(TinkerModel(id=model_id, session_id=session_id, project_id=project_id, base_model=base_model,
                                lora_config=lora_config, user_metadata=user_metadata))
        session.flush()
    return model_id


def get_model(session: Session, project_id: str, model_id: str) -> TinkerModel | None:
    return session.scalar(select(TinkerModel).where(TinkerModel.id == model_id,
                                                    TinkerModel.project_id == project_id))


def last_request_at(session: Session, model_id: str) -> float | None:
    """When the model's newest request arrived."""
    return session.scalar(select(func.max(TinkerRequest.created_at)).where(TinkerRequest.model_id == model_id))


def live_models(session: Session, project_id: str) -> int:
    """The project's training clients that have not been released (the training-client quota counts these),
    under the project row's lock (as jobs.active_count), so two concurrent creates cannot both take the last
    place."""
    session.execute(select(Project.id).where(Project.id == project_id).with_for_update())
    return session.scalar(select(func.count()).select_from(TinkerModel)
                          .where(TinkerModel.project_id == project_id, TinkerModel.released_at.is_(None)))


def sampler_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    """A sampling session's id; an unnamed save_weights_for_sampler of a model of `session_id` makes this one."""
    return f"{session_id}:sample:{sampling_session_seq_id}"


def add_sampler(session: Session, project_id: str, session_id: str, sampling_session_seq_id: int, *,
                base_model: str, model_path: str | None = None, source_model_id: str | None = None) -> str:
    """A sampling session "<session>:sample:<n>"; the same call again answers the same id."""
    sampler_id = sampler_id_for(session_id, sampling_session_seq_id)
    if session.scalar(select(TinkerSampler.id).where(TinkerSampler.id == sampler_id)) is None:
        session.add(TinkerSampler(id=sampler_id, session_id=session_id, project_id=project_id,
                                  base_model=base_model, model_path=model_path, source_model_id=source_model_id))
        session.flush()
    return sampler_id


def get_sampler(session: Session, project_id: str, sampler_id: str) -> TinkerSampler | None:
    return session.scalar(select(TinkerSampler).where(TinkerSampler.id == sampler_id,
                                                      TinkerSampler.project_id == project_id))


def set_sampler_weights(session: Session, sampler_id: str, model_path: str) -> None:
    """The runner: the weights a snapshot sampler samples with, once they are written."""
    session.execute(update(TinkerSampler).where(TinkerSampler.id == sampler_id).values(model_path=model_path)
                    .execution_options(synchronize_session=False))


# -- checkpoints -------------------------------------------------------------------


CHECKPOINT_KINDS = ("weights", "sampler_weights")


def checkpoint_path(model_id: str, kind: str, name: str) -> str:
    """The tinker:// path of a model's saved state ("weights") or of weights saved for sampling."""
    if kind not in CHECKPOINT_KINDS:
        raise ValueError(f"kind must be one of {CHECKPOINT_KINDS}, not {kind!r}")
    return f"tinker://{model_id}/{kind}/{name}"


def record_checkpoint(session: Session, *, path: str, project_id: str, model_id: str, kind: str, storage_key: str,
                      expires_at: int | None = None) -> None:
    """The runner: weights saved under a tinker:// path; saving the same path again (overwrite) replaces it."""
    upsert(session, TinkerCheckpoint, [{"path": path, "project_id": project_id, "model_id": model_id, "kind": kind,
                                        "storage_key": storage_key, "created_at": now(), "expires_at": expires_at}],
           keys=["path"])


def publish_sampler_weights(session: Session, model_id: str, *, path: str, storage_key: str, files: dict,
                            lora: dict, step: int) -> Checkpoint:
    """The runner, after a save_weights_for_sampler: the training client's adapter is an ordinary fine-tuned
    model of its project (a succeeded job of method "tinker", suffix "tinker"), these weights its checkpoint at
    `step` (the optimizer steps behind them), so /v1/models, chat.completions, evals and checkpoint downloads
    take it as they take a job's. A later save at another step is a further checkpoint (the latest is the
    model); one at the same step replaces it."""
    model = session.scalar(select(TinkerModel).where(TinkerModel.id == model_id))
    job = model.job_id and session.scalar(select(Job).where(Job.id == model.job_id))
    t = now()
    if job is None or job.model_deleted_at is not None:  # a deleted model's later saves are a model anew
        job = Job(project_id=model.project_id, status="succeeded", model=model.base_model, training_file="",
                  spec={"model": model.base_model, "lora": lora},
                  method={"type": "tinker", "tinker": {"model_id": model.id, "lora_config": model.lora_config}},
                  seed=int((model.lora_config or {}).get("seed") or 0), suffix="tinker", total_steps=0,
                  started_at=model.created_at, finished_at=t, webhooks_enqueued_at=t)
        session.add(job)
        session.flush()
        model.job_id = job.id
        add_event(session, job.id, f"Tinker training client {model.id}: its weights saved for sampling are "
                  "this fine-tuned model's checkpoints")
    checkpoint = session.scalar(select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == step))
    if checkpoint is None:
        checkpoint = Checkpoint(job_id=job.id, step=step)
        session.add(checkpoint)
    checkpoint.created_at, checkpoint.storage_prefix, checkpoint.files = t, storage_key, files
    checkpoint.metrics = {"tinker_path": path}
    job.steps_done = job.total_steps = step
    job.finished_at = t
    add_event(session, job.id, f"Checkpoint at step {step}: {path}", data={"step": step, "path": path})
    session.flush()
    return checkpoint


def resolve_checkpoint(session: Session, project_id: str, path: str, *, now_s: float | None = None
                       ) -> TinkerCheckpoint | None:
    """The project's checkpoint at a tinker:// path; None for another project's path, an unknown or an expired
    one (the caller cannot tell those apart)."""
    t = int(now_s if now_s is not None else time.time())
    return session.scalar(select(TinkerCheckpoint).where(
        TinkerCheckpoint.path == path, TinkerCheckpoint.project_id == project_id,
        or_(TinkerCheckpoint.expires_at.is_(None), TinkerCheckpoint.expires_at > t)))


def saved_checkpoints(session: Session, project_id: str, *, now_s: float | None = None) -> int:
    """The project's unexpired saved checkpoints (the saved-state quota counts these)."""
    t = int(now_s if now_s is not None else time.time())
    return session.scalar(select(func.count()).select_from(TinkerCheckpoint).where(
        TinkerCheckpoint.project_id == project_id,
        or_(TinkerCheckpoint.expires_at.is_(None), TinkerCheckpoint.expires_at > t)))


# -- requests: the API's side --------------------------------------------------------


def _existing(session: Session, model_id: str | None, sampler_id: str | None, seq_id: int | None) -> str | None:
    if seq_id is None or (model_id is None and sampler_id is None):
        return None
    key = TinkerRequest.model_id == model_id if model_id is not None else TinkerRequest.sampler_id == sampler_id
    return session.scalar(select(TinkerRequest.id).where(key, TinkerRequest.seq_id == seq_id))


def submit(session: Session, project_id: str, *, kind: str, body: bytes, body_type: str,
           session_id: str | None = None, model_id: str | None = None, sampler_id: str | None = None,
           seq_id: int | None = None, result: bytes | None = None, result_type: str | None = None) -> tuple[str, bool]:
    """Add a pending request; returns (request id, whether it is new). A retry of the same (model, seq_id) or
    (sampler, seq_id) answers the first row's id and adds nothing. `result` given: a request answered at once
    (done), for calls with nothing to run.

    The insert runs in a savepoint, so losing a race with a concurrent retry leaves the caller's transaction
    usable; the winner's row is then read back."""
    if (found := _existing(session, model_id, sampler_id, seq_id)) is not None:
        return found, False
    t = time.time()
    row = TinkerRequest(project_id=project_id, session_id=session_id, model_id=model_id, sampler_id=sampler_id,
                        seq_id=seq_id, kind=kind, body=body, body_type=body_type, created_at=t,
                        state="pending" if result is None else "done", result=result, result_type=result_type,
                        finished_at=None if result is None else t)
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        if (found := _existing(session, model_id, sampler_id, seq_id)) is not None:
            return found, False
        raise
    return row.id, True


def get_request(session: Session, project_id: str, request_id: str) -> RequestRow | None:
    """The project's request; None for another project's or an unknown id."""
    row = session.scalar(select(TinkerRequest).where(TinkerRequest.id == request_id,
                                                     TinkerRequest.project_id == project_id))
    return _plain(row) if row is not None else None


def ended_among(session: Session, request_ids: list[str]) -> set[str]:
    """Which of the requests have ended (done or failed): what held retrieve_future polls wait for."""
    return set(session.scalars(select(TinkerRequest.id).where(TinkerRequest.id.in_(request_ids),
                                                              TinkerRequest.state.in_(("done", "failed")))))


# -- requests: the runner's side -------------------------------------------------------


def _ready(t: float):
    """A pending request that may run now: of no model, or with every lower seq_id of its model ended and none
    missing (or missing for longer than the grace)."""
    lower = aliased(TinkerRequest)
    earlier = and_(lower.model_id == TinkerRequest.model_id, lower.seq_id < TinkerRequest.seq_id)
    none_open = ~exists().where(earlier, lower.state.in_(OPEN))
    arrived = select(func.count()).select_from(lower).where(earlier).scalar_subquery()
    no_gap = or_(arrived == TinkerRequest.seq_id - CREATE_SEQ_ID, TinkerRequest.created_at <= t - GAP_GRACE_S)
    return and_(TinkerRequest.state == "pending",
                or_(TinkerRequest.model_id.is_(None), TinkerRequest.seq_id.is_(None), and_(none_open, no_gap)))


def _held_elsewhere(worker_id: str):
    """A request of a model whose adapter another runner holds: only that runner may run it (a dead runner's
    hold keeps others off until abandoned_holds ends it, so its model's requests fail rather than run on a
    runner that never had the adapter)."""
    return exists().where(TinkerModel.id == TinkerRequest.model_id, TinkerModel.worker_id.is_not(None),
                          TinkerModel.worker_id != worker_id)


def renew_holds(session: Session, worker_id: str, now_s: float) -> None:
    """The runner, every few seconds: it is alive, and so are the adapters it holds."""
    session.execute(update(TinkerModel).where(TinkerModel.worker_id == worker_id).values(held_at=int(now_s))
                    .execution_options(synchronize_session=False))


def abandoned_holds(session: Session, now_s: float, ttl_s: float = HOLD_TTL_S) -> list[str]:
    """Runners that stopped renewing (died, or lost their machine): each one's holds end as fail_running_of
    ends them, so its clients get a server error and resume from their last saved state. Returns the
    requests failed."""
    stale = list(session.scalars(select(TinkerModel.worker_id).distinct().where(
        TinkerModel.worker_id.is_not(None), TinkerModel.held_at < now_s - ttl_s)))
    lost: list[str] = []
    for worker_id in stale:
        lost += fail_running_of(session, worker_id, f"the worker holding this training client ({worker_id}) "
                                "stopped; resume from the last saved state")
    return lost


def claim_ready(session: Session, worker_id: str, now_s: float, limit: int = 32) -> list[RequestRow]:
    """Take up to `limit` ready requests for this runner: they turn running under `worker_id`, in (model,
    seq_id) order, oldest first otherwise. At most one request per model: the next becomes ready when this one
    ends. A model's first claim makes this runner its holder; later requests of it go to no other runner.

    Each row is taken by a conditional UPDATE (still pending), so two runners never take the same row; on
    PostgreSQL the candidates are read FOR UPDATE SKIP LOCKED, so they do not queue behind each other."""
    candidates = (select(TinkerRequest.id, TinkerRequest.model_id)
                  .where(_ready(now_s), ~_held_elsewhere(worker_id))
                  .order_by(TinkerRequest.created_at, TinkerRequest.seq).limit(limit * 4))
    if session.get_bind().dialect.name == "postgresql":
        candidates = candidates.with_for_update(skip_locked=True, of=TinkerRequest)
    taken: list[str] = []
    models: set[str] = set()
    for request_id, model_id in session.execute(candidates).all():
        if len(taken) >= limit:
            break
        if model_id is not None and model_id in models:
            continue
        won = session.execute(update(TinkerRequest)
                              .where(TinkerRequest.id == request_id, TinkerRequest.state == "pending")
                              .values(state="running", worker_id=worker_id, started_at=now_s)
                              .execution_options(synchronize_session=False))
        if won.rowcount != 1:
            continue
        taken.append(request_id)
        if model_id is not None:
            models.add(model_id)
    if models:
        session.execute(update(TinkerModel).where(TinkerModel.id.in_(models), TinkerModel.worker_id.is_(None))
                        .values(worker_id=worker_id, held_at=int(now_s)).execution_options(synchronize_session=False))
    rows = {r.id: r for r in session.scalars(select(TinkerRequest).where(TinkerRequest.id.in_(taken)))}
    return sorted((_plain(rows[i]) for i in taken), key=lambda r: (r.model_id or "", r.seq_id or 0))


def complete(session: Session, request_id: str, result: bytes, result_type: str) -> bool:
    """running -> done with its result (json or protobuf bytes, as the SDK reads them); False when the request
    is not running (already ended, or failed by a sweep)."""
    done = session.execute(update(TinkerRequest).where(TinkerRequest.id == request_id,
                                                       TinkerRequest.state == "running")
                           .values(state="done", result=result, result_type=result_type, finished_at=time.time(),
                                   body=ENDED_BODY)
                           .execution_options(synchronize_session=False))
    return done.rowcount == 1


def fail(session: Session, request_id: str, message: str, category: str) -> bool:
    """An open request -> failed; `category` "user" (the request is wrong: the SDK will not retry) or "server"."""
    if category not in ("user", "server"):
        raise ValueError(f"category must be 'user' or 'server', not {category!r}")
    done = session.execute(update(TinkerRequest).where(TinkerRequest.id == request_id,
                                                       TinkerRequest.state.in_(OPEN))
                           .values(state="failed", error=message, error_category=category, finished_at=time.time(),
                                   body=ENDED_BODY)
                           .execution_options(synchronize_session=False))
    return done.rowcount == 1


def fail_running_of(session: Session, worker_id: str, message: str) -> list[str]:
    """A runner that died: its running requests fail (a server error), and so do the pending ones of the models
    it held, whose adapters died with it; those models are held by nobody now. Returns the failed request ids."""
    held = select(TinkerModel.id).where(TinkerModel.worker_id == worker_id)
    lost = list(session.scalars(select(TinkerRequest.id).where(
        or_(and_(TinkerRequest.state == "running", TinkerRequest.worker_id == worker_id),
            and_(TinkerRequest.state == "pending", TinkerRequest.model_id.in_(held))))))
    if lost:
        session.execute(update(TinkerRequest).where(TinkerRequest.id.in_(lost), TinkerRequest.state.in_(OPEN))
                        .values(state="failed", error=message, error_category="server", finished_at=time.time(),
                                body=ENDED_BODY)
                        .execution_options(synchronize_session=False))
    session.execute(update(TinkerModel).where(TinkerModel.worker_id == worker_id).values(worker_id=None, held_at=None)
                    .execution_options(synchronize_session=False))
    return lost


def request_for_runner(session: Session, request_id: str) -> RequestRow | None:
    row = session.scalar(select(TinkerRequest).where(TinkerRequest.id == request_id))
    return _plain(row) if row is not None else None


def prune_ended(session: Session, finished_before: float) -> int:
    """Delete requests that ended before `finished_before` (their futures were long since read, and the SDK
    retries a submission for minutes, not days); returns how many went."""
    gone = session.execute(delete(TinkerRequest).where(TinkerRequest.state.in_(("done", "failed")),
                                                       TinkerRequest.finished_at < finished_before)
                           .execution_options(synchronize_session=False))
    return gone.rowcount
