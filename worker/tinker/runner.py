"""The Tinker worker: takes the API's request rows in order, runs them on the resident engines, writes results back.

`cispo tinker` (started by `cispo up`) polls the requests table (service/repositories/tinker.py): the rows
that may run now are claimed in one transaction, per training client in seq_id order. A claim is cut into
waves, the n-th request of each client in the n-th wave, so a client's requests keep their order while
different clients' forward_backward passes on one base run as one engine call (one routed forward and
backward), and their samples as one batched decode. Each result, or the error the SDK will raise, is written
to the request's row, where POST /retrieve_future finds it.

The SQL rows are the truth: an adapter lives in this process, a saved state in the object store. A session
whose heartbeats stopped has its adapters released here; a worker that dies has its running requests failed
by the next worker's start (`fail_running_of`), and their clients resume from their last save_state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from service.db.session import session_factory
from service.repositories import tinker as requests
from service.settings import Settings
from service.storage import open_store
from service.storage_layout import ARCHIVE, MANIFEST, tinker_checkpoint
from worker.checkpoints.artifacts import download_checkpoint, upload_tree
from worker.engine.engine import Engine, lora_spec
from worker.scratch import beside_jobs
from worker.tinker.calls import Call, Calls, Engines, Reply, UserError

log = logging.getLogger(__name__)

# The wait between polls is POLL_MIN_S for HOT_S after the last request ran (a training loop's next call comes
# a round trip after its last result: tens of ms), then doubles while the queue stays empty up to POLL_MAX_S: a
# busy client's next request waits little, an idle worker costs the database a few queries a second.
POLL_MIN_S, POLL_MAX_S, HOT_S = 0.005, 0.5, 1.0
EXPIRE_EVERY_S = 5.0  # well inside the repository's HOLD_TTL_S
CLAIM_LIMIT = 256
BATCHED = ("forward_backward", "forward")


class StoredCheckpoints:
    """Saved states in the object store, their `tinker://` paths recorded per project in SQL."""

    def __init__(self, runner: TinkerRunner):
        self.runner = runner

    def save(self, call: Call, engine: Engine, model_id: str, kind: str, name: str) -> str:
        try:
            path = requests.checkpoint_path(model_id, kind, name)
            prefix = tinker_checkpoint(call.project_id, model_id, kind, name)
        except ValueError as e:
            raise UserError(f"{call.kind}: {e}") from None
        local = Path(tempfile.mkdtemp(dir=self.runner.scratch)) / "state"
        try:
            engine.save_state(model_id, local)
            files = upload_tree(self.runner.store, prefix, local, ARCHIVE)
        finally:
            shutil.rmtree(local.parent, ignore_errors=True)
        ttl = call.json().get("ttl_seconds")
        with self.runner.sessions.begin() as s:
            requests.record_checkpoint(s, path=path, project_id=call.project_id, model_id=model_id, kind=kind,
                                       storage_key=prefix, expires_at=int(time.time() + ttl) if ttl else None)
            if kind == "sampler_weights":
                requests.publish_sampler_weights(s, model_id, path=path, storage_key=prefix, files=files,
                                                 lora=lora_spec(engine.configs[model_id]).model_dump(mode="json"),
                                                 step=engine.steps_taken(model_id))
        return path

    def fetch(self, project_id: str, path: str) -> tuple[Path, str]:
        with self.runner.sessions() as s:
            found = requests.resolve_checkpoint(s, project_id, path)
            model = found and requests.get_model(s, project_id, found.model_id)
            prefix, base = (found.storage_key, model.base_model) if model is not None else (None, None)
        if prefix is None:  # another project's path reads as absent: nothing about it is told
            raise UserError(f"no checkpoint at {path}")
        local = self.runner.scratch / "checkpoints" / prefix.replace("/", "_")
        if not local.exists():
            body = b"".join(self.runner.store.iter_bytes(f"{prefix}/{MANIFEST}"))
            files = {**json.loads(body)["files"], MANIFEST: {"sha256": hashlib.sha256(body).hexdigest()}}
            download_checkpoint(self.runner.store, prefix, files, local)  # every hash checked again on load
        return local, base

    def sampler(self, project_id: str, sampler_id: str) -> dict | None:
        with self.runner.sessions() as s:
            found = requests.get_sampler(s, project_id, sampler_id)
            return None if found is None else {"base_model": found.base_model, "model_path": found.model_path}


def waves(calls: list[Call]) -> list[list[Call]]:
    """The n-th call of each model in the n-th wave (calls come in seq_id order per model); calls of no
    model (samples) all in the first."""
    per_model: dict[str | None, list[Call]] = defaultdict(list)
    for call in calls:
        per_model[call.model_id].append(call)
    out: list[list[Call]] = []
    for model, own in per_model.items():
        if model is None:
            out[:1] = [(out[0] if out else []) + own]
            continue
        for n, call in enumerate(own):
            if n == len(out):
                out.append([])
            out[n].append(call)
    return out


class TinkerRunner:
    def __init__(self, settings: Settings, *, engines: Engines | None = None, worker_id: str | None = None):
        self.sessions = session_factory(settings.resolved_database_url())
        self.store = open_store(settings.resolved_storage_url())
        self.scratch = beside_jobs(settings, "tinker")
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.engines = engines or Engines()
        self.calls = Calls(self.engines, StoredCheckpoints(self))
        # Stable across restarts of this worker, so the next start fails what a dead one left running.
        self.worker_id = worker_id or os.environ.get("CISPO_TINKER_WORKER_ID") or socket.gethostname()
        self.stop = threading.Event()

    def run(self) -> None:
        with self.sessions.begin() as s:  # a worker of this name that died left these running
            requests.fail_running_of(s, self.worker_id, "the worker restarted; resume from your last save_state")
        threading.Thread(target=self.renew_holds, daemon=True, name="tinker-holds").start()
        log.info("tinker worker %s polling", self.worker_id)
        wait, expired_at, ran_at = POLL_MIN_S, 0.0, 0.0
        while not self.stop.is_set():
            if time.time() - expired_at >= EXPIRE_EVERY_S:
                self.release_expired()
                expired_at = time.time()
            if self.cycle():
                wait, ran_at = POLL_MIN_S, time.monotonic()
            else:
                self.stop.wait(wait)
                if time.monotonic() - ran_at >= HOT_S:
                    wait = min(2 * wait, POLL_MAX_S)

    def renew_holds(self) -> None:
        """In a thread of its own, so a long engine call never lets this runner's holds look dead."""
        while not self.stop.wait(EXPIRE_EVERY_S):
            try:
                with self.sessions.begin() as s:
                    requests.renew_holds(s, self.worker_id, time.time())
            except Exception:  # noqa: BLE001 - a database blip: the next renewal comes in EXPIRE_EVERY_S
                log.exception("renewing the holds of %s", self.worker_id)

    def release_expired(self) -> None:
        """End the holds of runners that stopped renewing them, and free the adapters of ended sessions:
        finished, or expired by the reconciler when their heartbeats stopped (worker/jobs/reconciler.py). Their
        saved states stay loadable."""
        with self.sessions.begin() as s:
            released = requests.released_held(s, self.worker_id)
            requests.abandoned_holds(s, time.time())
        for model_id in released:
            self.engines.release(model_id)

    def cycle(self) -> int:
        """One poll: claim what may run, run it. Returns how many requests ran."""
        now = time.time()
        with self.sessions.begin() as s:
            claimed = [Call(r.id, r.project_id, r.kind, r.model_id, r.body, r.session_id)
                       for r in requests.claim_ready(s, self.worker_id, now, CLAIM_LIMIT)]
        for wave in waves(claimed):
            self.run_wave(wave)
        return len(claimed)

    def run_wave(self, wave: list[Call]) -> None:
        batched: dict[int, tuple[Engine, list[Call]]] = {}
        draws: dict[int, tuple[Engine, list[Call], list]] = {}
        for call in wave:
            try:
                if call.kind in BATCHED:
                    engine = self.engines.of(call.model_id)
                    batched.setdefault(id(engine), (engine, []))[1].append(call)
                elif call.kind == "asample":
                    engine, draw = self.calls.draw(call)
                    entry = draws.setdefault(id(engine), (engine, [], []))
                    entry[1].append(call)
                    entry[2].append(draw)
                else:
                    self.finish(call, getattr(self.calls, _handler(call.kind))(call))
            except Exception as e:  # noqa: BLE001 - the request fails, the worker goes on
                self.fail(call, e)
        for engine, calls in batched.values():
            self.run_batch(calls, lambda group: self.calls.forward_backward(engine, group))
        for engine, calls, group_draws in draws.values():
            by_call = dict(zip((c.id for c in calls), group_draws))
            self.run_batch(calls, lambda group: self.calls.sample(engine, group, [by_call[c.id] for c in group]))

    def run_batch(self, calls: list[Call], run) -> None:
        """One engine call for the group; where it fails, each call alone, so one bad request fails alone."""
        try:
            replies = run(calls)
        except Exception as e:  # noqa: BLE001
            if len(calls) == 1:
                return self.fail(calls[0], e)
            for call in calls:
                try:
                    (reply,) = run([call])
                except Exception as e:  # noqa: BLE001
                    reply = e
                self.settle(call, reply)
            return
        for call, reply in zip(calls, replies):
            self.settle(call, reply)

    def settle(self, call: Call, reply: Reply | Exception) -> None:
        """A call's outcome written: its reply, or the error that ended it."""
        if isinstance(reply, Exception):
            self.fail(call, reply)
        else:
            self.finish(call, reply)

    def finish(self, call: Call, reply: Reply) -> None:
        with self.sessions.begin() as s:
            requests.complete(s, call.id, reply.body, "protobuf" if reply.protobuf else "json")

    def fail(self, call: Call, error: BaseException) -> None:
        user = isinstance(error, (UserError, KeyError))
        if not user:
            log.exception("tinker request %s (%s) failed", call.id, call.kind, exc_info=error)
        message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
        with self.sessions.begin() as s:
            requests.fail(s, call.id, message or type(error).__name__, "user" if user else "server")


def _handler(kind: str) -> str:
    if kind not in {"create_model", "unload_model", "optim_step", "save_weights", "save_weights_for_sampler",
                    "load_weights"}:
        raise UserError(f"{kind} is not served by this server")
    return kind


def serve(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT; the requests being run finish and are written first."""
    runner = TinkerRunner(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: runner.stop.set())
    runner.run()
    return 0
