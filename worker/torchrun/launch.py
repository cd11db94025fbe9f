"""The job-runner side of multi-process training: start torchrun for a job and relay rank 0's callbacks.

The lease, heartbeat and every SQL or object-store write stay in the job
runner's process (its callbacks). Rank 0 sends each callback over a Unix
socket as one JSON line and waits for the answer, so the order of steps,
evaluations and checkpoint uploads is the trainer's, and `should_stop` (cancel,
pause, a lost lease) reaches every rank at the same step boundary. The job's
secrets travel to rank 0 over the same socket, never in argv or the environment.

A rank that fails sends its error first when it can; an error of a known kind
is raised here as that kind (so the job fails with the same code as in one
process). Ranks that stop answering a stop request for `stop_grace_s`, or die,
are killed as a process group.

On a CUDA worker each rank takes its own GPU, so a job asking for more GPUs
than the worker sees is refused before torchrun starts (TooFewGPUs, a
ValueError: the job fails as invalid and is not retried); on a CPU-only
worker the ranks share the CPU over gloo, whatever their number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from service.models.engine_check import EngineUnsupported
from service.job_spec.spec import JobSpec
from worker.checkpoints.checkpoint import CheckpointError
from worker.rewards.engine import ScoringContext
from worker.rewards.errors import EnvironmentErrorRateExceeded, RewardErrorRateExceeded
from worker.trainer.data import DataError
from worker.trainer.learning_signal import NoLearningSignal

CHANNEL_ENV = "CISPO_RANK0_SOCKET"
NO_RESUME = "--no-resume"  # the ranks' flag for a run that ignores the checkpoints in its directory
RANKS_LOG = "ranks.log"
# Each rank's error, written before it exits: when another rank's exit makes torchrun kill rank 0 before it
# reports its own, the launcher still raises the known kind (a bad warm start fails every rank alike).
RANK_ERRORS = "rank-errors"
# Errors that mean the same in every process; anything else arrives as RankFailed.
KNOWN_ERRORS = {cls.__name__: cls for cls in (EnvironmentErrorRateExceeded, RewardErrorRateExceeded, CheckpointError,
                                              DataError, ValueError, NoLearningSignal, EngineUnsupported)}


class RankFailed(RuntimeError):
    """The training processes failed or died; the message says how."""


class TooFewGPUs(ValueError):
    """The job asks for more GPUs than this worker sees."""


def visible_gpus() -> int | None:
    """How many CUDA devices this process sees; None without CUDA (the ranks then run on the CPU over gloo)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def refuse_too_few_gpus(gpus: int, visible: int | None) -> None:
    """Raise TooFewGPUs naming resources.gpus when `gpus` ranks would not each get a device of their own."""
    if visible is not None and visible < gpus:
        devices = f"{visible} CUDA device{'' if visible == 1 else 's'}"
        raise TooFewGPUs(f"resources.gpus is {gpus}, but this worker sees {devices} (one per training process is "
                         f"needed): ask for at most {visible}, or run the job on a worker with {gpus} GPUs")


def run_training(spec: JobSpec, run_dir: Path, callbacks, *, scoring: ScoringContext | None = None):
    """Train the job in this process, or across spec.resources.gpus processes; returns its TrainResult.
    (A job for the Ray cluster, spec.resources.on_ray, goes to worker/ray_driver instead.)"""
    if spec.resources.gpus > 1:
        return run_distributed(spec, run_dir, callbacks, scoring=scoring)
    from worker.trainer.loop import Trainer  # torch loads here, not at worker import

    trainer = Trainer(spec, run_dir, scoring=scoring, progress=lambda message: _event(callbacks, message))
    if trainer.step:
        _event(callbacks, f"Resumed from the checkpoint at step {trainer.step}")
    return trainer.run(callbacks)


def run_distributed(spec: JobSpec, run_dir: Path, callbacks, *, scoring: ScoringContext | None = None,
                    processes: int | None = None, startup_timeout_s: float = 600.0, stop_grace_s: float = 60.0,
                    resume: bool = True):
    """torchrun with one process per GPU (gloo processes on CPU) for the job; blocks until they finish.

    `resume`: whether the ranks resume from the newest checkpoint in run_dir (as Trainer's own flag)."""
    from worker.trainer.callbacks import TrainResult

    refuse_too_few_gpus(processes or spec.resources.gpus, visible_gpus())  # before any rank starts
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "job_spec.json"
    spec_path.write_text(spec.model_dump_json())
    shutil.rmtree(run_dir / RANK_ERRORS, ignore_errors=True)  # an earlier attempt's
    sock_dir = tempfile.mkdtemp(prefix="cispo-ranks-")  # short: Unix socket paths are limited to ~100 bytes
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(os.path.join(sock_dir, "rank0.sock"))
    server.listen(1)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={processes or spec.resources.gpus}",
               "-m", "worker.torchrun.rank", str(spec_path), str(run_dir), *([] if resume else [NO_RESUME])]
    log_path = run_dir / RANKS_LOG
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, env={**os.environ, CHANNEL_ENV: os.path.join(sock_dir, "rank0.sock")},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group, killed as one
    try:
        conn = _accept(server, proc, startup_timeout_s, log_path)
        with conn:
            _send(conn, scoring_wire(scoring))
            result = _serve(conn, proc, callbacks, stop_grace_s, log_path)
        try:
            proc.wait(timeout=60)  # the ranks leave the process group and exit
        except subprocess.TimeoutExpired:
            pass
        return TrainResult(result["steps_done"], result["stopped"],
                           Path(result["last_checkpoint"]) if result["last_checkpoint"] else None,
                           result["first_eval"], result["last_eval"])
    finally:
        server.close()
        _stop(proc)
        shutil.rmtree(sock_dir, ignore_errors=True)


def scoring_wire(scoring: ScoringContext | None) -> dict:
    scoring = scoring or ScoringContext()
    return {"secrets": dict(scoring.secrets), "egress": dataclasses.asdict(scoring.egress),
            "judge": dataclasses.asdict(scoring.judge) if scoring.judge is not None else None}


def _accept(server: socket.socket, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> socket.socket:
    server.settimeout(1.0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn, _ = server.accept()
            return conn
        except TimeoutError:
            if proc.poll() is not None:
                raise _failure(f"the training processes exited ({proc.returncode}) before rank 0 connected",
                               log_path) from None
    raise RankFailed(f"rank 0 did not connect within {timeout_s:.0f} s")


def _serve(conn: socket.socket, proc: subprocess.Popen, callbacks, stop_grace_s: float, log_path: Path) -> dict:
    """Answer rank 0's requests until it reports the result; raise what it reports as its error."""
    conn.settimeout(1.0)
    buffer, stop_since = b"", None
    while True:
        try:
            chunk = conn.recv(1 << 16)
        except TimeoutError:
            if proc.poll() is not None:
                raise _failure(f"the training processes exited ({proc.returncode})", log_path) from None
            if callbacks.should_stop():  # cancel or lost lease while a step runs: a grace period, then a kill
                stop_since = stop_since or time.monotonic()
                if time.monotonic() - stop_since > stop_grace_s:
                    raise RankFailed(f"the training processes did not stop within {stop_grace_s:.0f} s of a "
                                     "stop request; killed") from None
            continue
        if not chunk:
            proc.wait(timeout=30)
            raise _failure(f"rank 0 hung up (exit {proc.returncode})", log_path)
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            message = json.loads(line)
            kind = message.pop("kind")
            if kind == "done":
                return message
            if kind == "error":
                raise _known(message) or RankFailed(f"{message['type']}: {message['message']}")
            _send(conn, dispatch_rank_message(callbacks, kind, message))


def _failure(what: str, log_path: Path) -> Exception:
    """The error of ranks that ended without rank 0 reporting one: a known kind a rank wrote (the lowest rank's),
    else RankFailed with the log's tail."""
    errors = sorted(log_path.parent.glob(f"{RANK_ERRORS}/rank*.json"), key=lambda p: int(p.stem[len("rank"):]))
    for path in errors:
        try:
            error = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if known := _known(error):
            return known
    return RankFailed(f"{what}; {_tail(log_path)}")


def _known(error: dict) -> Exception | None:
    """A rank's reported error ({"type", "message"}) as its own class, if it is one that means the same here."""
    cls = KNOWN_ERRORS.get(error.get("type"))
    return cls(error["message"]) if cls else None


def write_rank_error(run_dir: Path, rank: int, error: BaseException) -> None:
    """Record this rank's error for the launcher (atomically: a rank killed mid-write leaves no half file)."""
    folder = Path(run_dir) / RANK_ERRORS
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".rank{rank}.json.partial"
    partial.write_text(json.dumps({"type": type(error).__name__, "message": str(error)}))
    os.replace(partial, folder / f"rank{rank}.json")


def dispatch_rank_message(callbacks, kind: str, m: dict) -> dict:
    if kind == "should_stop":
        return {"stop": bool(callbacks.should_stop())}
    if kind == "step":
        callbacks.on_step(m["step"], m["metrics"])
    elif kind == "eval":
        callbacks.on_eval(m["step"], m["metrics"])
    elif kind == "checkpoint":
        callbacks.on_checkpoint(m["step"], Path(m["path"]))
    elif kind == "reward_errors":
        report = getattr(callbacks, "on_reward_errors", None)
        if report is not None:
            report(m["step"], m["errors"])
    elif kind == "samples":
        record = getattr(callbacks, "on_samples", None)
        if record is not None:
            record(m["step"], m["samples"])
    elif kind in ("preflight", "no_signal"):
        report = getattr(callbacks, f"on_{kind}", None)
        if report is not None:
            report(*([m["metrics"]] if kind == "preflight" else [m["step"], m["steps"]]))
    elif kind == "event":
        _event(callbacks, m["message"])
    else:
        raise RankFailed(f"rank 0 sent an unknown request {kind!r}")
    return {}


def _event(callbacks, message: str) -> None:
    event = getattr(callbacks, "event", None)  # the job runner's reporter has it; plain callbacks may not
    if event is not None:
        event(message)


def _send(conn: socket.socket, message: dict) -> None:
    conn.settimeout(None)
    conn.sendall(json.dumps(message).encode() + b"\n")
    conn.settimeout(1.0)


def _stop(proc: subprocess.Popen) -> None:
    """End the whole process group (torchrun and its ranks): SIGTERM, then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(log_path: Path, chars: int = 1500) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return "no log"
    return f"last output: {text[-chars:]}"
