"""A worker that keeps one base model resident and trains up to CISPO_WORKER_JOBS LoRA jobs of it at once.

The Celery task of a job (worker/celery_app.py) comes here when the setting is
above 1. The job's base model is loaded once; between cycles, while slots are
free, queued jobs of the same base (the job row's model, the precision it is
held in) are claimed from SQL, the source of truth, in fair-share order
between projects (service/fair_share.py) and only while the next one's
estimated memory fits beside the resident jobs (worker/multi/memory.py; one
that does not waits, and so do those behind it): jobs of one base meet on
the worker that holds it, and their own broker messages, delivered later,
find the lease taken and are dropped (as any duplicate is). A job that cannot
share (worker/multi/support.py) runs the ordinary way.

Every job keeps what it has alone, by the steps every run goes through
(worker/jobs/lifecycle/): its claim and lease epoch, its fenced reporter
(heartbeat, metrics, events, checkpoints, samples), its scratch directory,
its attempts, retries and end. Cancel, pause, a lost lease, a failure or the
job's end removes that job at the cycle boundary; the others go on. A worker
that dies stops heartbeating for all its jobs: the reconciler queues each
again, and each resumes from its own checkpoint.

A cancel is honoured at the next cycle boundary, not mid-batch as alone: the
interrupt that stops sandboxed user code is process-wide and would stop every
resident job's scoring (ResidentReporter).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service.job_spec.spec import JobSpec
from service.repositories import job_queue, jobs
from service.sandbox.channel import INTERRUPT
from service.settings import Settings
from service.storage import ObjectStore
from worker import scratch
from worker.jobs import job_runner
from worker.jobs.drain import DRAIN
from worker.jobs.job_reporter import JobReporter
from worker.jobs.lifecycle import end as run_end
from worker.jobs.lifecycle import start as run_start
from worker.jobs.lifecycle.failures import LeaseLost, ending_of
from worker.multi import memory
from worker.multi.support import base_key, refusal
from worker.rewards.engine import ScoringContext

log = logging.getLogger(__name__)


class ResidentReporter(JobReporter):
    """A job reporter that leaves the process-wide interrupt alone: a cancel stops the job at the cycle boundary."""

    interrupts_on_cancel = False


@dataclass
class Resident:
    job_id: str
    claimed: run_start.Claimed
    reporter: ResidentReporter
    work: Path
    job: object | None = None  # its ResidentJob, once admitted
    started: bool = False  # its pre-flight and step-0 evaluation done (start_admitted)


class SharedWorker:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session], store: ObjectStore, owner: str,
                 model: str, key: tuple[str, str, str], slots: int):
        self.settings, self.sessions, self.store, self.owner = settings, sessions, store, owner
        self.model, self.key, self.slots = model, key, slots
        self.residents: dict[str, Resident] = {}
        self.outcomes: dict[str, str | None] = {}
        self.shared = self.tokenizer = self.device = self.autocast = None
        # Memory admission (worker/multi/memory.py), set when the base is loaded.
        self.shape: memory.BaseShape | None = None
        self.base_bytes = self.base_parameters = self.budget = 0
        self.estimates: dict[str, memory.MemoryEstimate] = {}  # of the resident jobs
        self.told_waiting: set[str] = set()  # jobs told once that they wait for room

    # -- the base, loaded once ------------------------------------------------

    def _load_base(self, spec: JobSpec) -> None:
        import torch
        from transformers import AutoTokenizer

        from worker.model import precision
        from worker.model.loading import load_causal_lm
        from worker.multi.lora import SharedBase
        from worker.model.policy import pick_device

        self.device = pick_device()
        precision.enable_fast_matmul(self.device)
        dtype = precision.compute_dtype(spec.dtype, spec.model, self.device)
        tokenizer = AutoTokenizer.from_pretrained(spec.model)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        base = load_causal_lm(spec.model, dtype=dtype).to(self.device)
        # the base, and the cast copies its decode runs on where its jobs sample in another dtype (base_key)
        self.shape = memory.BaseShape.of(base)
        self.base_bytes = memory.model_bytes(base) + memory.cast_copies(base, spec)
        self.base_parameters = sum(p.numel() for p in base.parameters())
        gib = self.settings.worker_memory_gib
        self.budget = int(gib * 2**30) if gib is not None else memory.default_budget(self.device)
        self.shared, self.tokenizer = SharedBase(base, slots=self.slots), tokenizer
        self.autocast = lambda: precision.autocast(self.device, dtype)
        torch.set_grad_enabled(True)

    # -- joining and leaving --------------------------------------------------

    def admit(self, job_id: str) -> None:
        """Claim the job and set it up beside the others (start_admitted starts it); a job whose set-up fails
        ends at once, alone."""
        claimed = run_start.claim_run(self.sessions, job_id, self.owner, self.settings)
        if not isinstance(claimed, run_start.Claimed):
            self.outcomes[job_id] = claimed
            return
        reporter = run_start.make_reporter(self.sessions, self.store, job_id, claimed, self.settings,
                                            kind=ResidentReporter)
        resident = Resident(job_id, claimed, reporter, scratch.run_dir(self.settings, job_id, claimed.epoch))
        self.residents[job_id] = resident
        reporter.start()
        try:
            if refusal(claimed.spec) or base_key(claimed.spec) != self.key:  # its spec changed since we peeked
                self._end(resident, "queued", None)
                return
            run_start.start_trackers(reporter, job_id, claimed, self.settings)
            if self.shared is None:
                self._load_base(claimed.spec)
            self.estimates[job_id] = memory.estimate(claimed.spec, self.shape)
            from worker.multi.job import ResidentJob

            local_spec, run_dir = run_start.prepare_run(claimed, self.store, resident.work, reporter)
            reporter.event(f"Training beside the other jobs of {self.model} on this worker "
                           f"({len(self.residents)} of {self.slots} slots)")
            resident.job = ResidentJob(local_spec, run_dir, self.shared, self.tokenizer, self.device, name=job_id,
                                       scoring=ScoringContext.from_settings(self.settings, claimed.secrets),
                                       callbacks=reporter)
        except Exception as e:  # noqa: BLE001 - this job's set-up; the others go on
            self._fail(resident, e)

    def start_admitted(self) -> None:
        """Start the jobs admitted since the last cycle: their step-0 evaluations decoded together, then each
        job's pre-flight and evaluation (worker/multi/job.py); a job whose start fails ends at once, alone."""
        from worker.multi.cycle import start_jobs

        starting = [r for r in self.residents.values() if r.job is not None and not r.started]
        failures = start_jobs(self.shared, [r.job for r in starting], device=self.device)
        for resident in starting:
            resident.started = True
            if resident.job_id in failures:
                self._fail(resident, failures[resident.job_id])
                continue
            try:
                if resident.job.done or resident.reporter.should_stop():  # resumed at its last step, or stopped
                    self._finish(resident)
            except Exception as e:  # noqa: BLE001 - this job's end; the others go on
                self._fail(resident, e)

    def fill(self) -> None:
        """Take queued jobs of this base into the free slots, in fair-share order, while they fit in memory."""
        free = self.slots - len(self.residents)
        if free <= 0 or DRAIN.is_set():
            return
        with self.sessions.begin() as s:
            waiting = job_queue.waiting_of_base(s, self.model, self.settings.project_weights, limit=4 * free + 16)
        for job_id, raw in waiting:
            if len(self.residents) >= self.slots:
                break
            try:
                spec = JobSpec.model_validate(raw)
            except Exception:  # noqa: BLE001 - its own run reports that
                continue
            if refusal(spec) is not None or base_key(spec) != self.key or job_id in self.residents:
                continue  # it runs elsewhere: a worker of its own, or of its base
            if not self._fits(job_id, spec):
                break  # no later job passes it: that would starve it and make queue positions lie
            self.admit(job_id)

    def _fits(self, job_id: str, spec: JobSpec) -> bool:
        """Whether the job's estimated peak fits beside the resident jobs; if not, tell it once why it waits."""
        if self.shape is None:  # nothing resident holds the base: the job comes as it would alone
            return True
        new, engine = memory.estimate(spec, self.shape), self._engine(spec)
        need = self.base_bytes + memory.together([*self.estimates.values(), new], engine)
        if need <= self.budget:
            return True
        if job_id not in self.told_waiting:
            self.told_waiting.add(job_id)
            beside = f"the {len(self.estimates)} resident jobs" + (
                f", the vLLM engine ({memory.gib(engine.held)})" if engine is not None else "")
            with self.sessions.begin() as s:
                jobs.add_event(s, job_id, (
                    f"Waiting for memory on a shared worker of {self.model}: its estimated peak "
                    f"{memory.gib(new.peak)} (adapter {memory.gib(new.adapter)}, optimizer "
                    f"{memory.gib(new.optimizer)}, activations {memory.gib(new.activations)}, KV cache "
                    f"{memory.gib(new.kv_cache)}) beside {beside} and the base needs "
                    f"{memory.gib(need)} of the worker's {memory.gib(self.budget)} (CISPO_WORKER_MEMORY_GIB)"),
                    level="warn", data={"reason": "memory", "needed_bytes": need, "budget_bytes": self.budget})
        return False

    def _engine(self, joining: JobSpec) -> memory.EngineMemory | None:
        """The vLLM engine the resident jobs and the joining one need: the running one's configuration if any."""
        running = [self.shared.vllm.spec] if self.shared is not None and self.shared.vllm is not None else []
        resident = [r.claimed.spec for r in self.residents.values()]
        return memory.engine_memory([*running, *resident, joining], self.device, self.base_parameters)

    def _finish(self, resident: Resident) -> None:
        try:
            status, error = run_end.run_outcome(resident.reporter, resident.job.step,
                                                   resident.claimed.spec.training.steps)
        except LeaseLost:
            self._lost(resident)
            return
        self._end(resident, status, error)

    def _fail(self, resident: Resident, e: BaseException) -> None:
        status, error = ending_of(e, lost=resident.reporter.lost, what=f"job {resident.job_id} on the shared worker")
        if status is None:
            self._lost(resident)
        else:
            self._end(resident, status, error)

    def _release(self, resident: Resident) -> None:
        del self.residents[resident.job_id]
        self.estimates.pop(resident.job_id, None)
        resident.reporter.stop()
        if resident.job is not None:
            try:
                resident.job.close()  # its scorer's children; its adapter leaves the base
            except Exception:  # noqa: BLE001
                log.exception("job %s: closing it failed", resident.job_id)

    def _lost(self, resident: Resident) -> None:
        self._release(resident)
        run_end.abandon(self.sessions, self.store, resident.job_id, resident.claimed, resident.reporter,
                           resident.work)
        self.outcomes[resident.job_id] = None

    def _end(self, resident: Resident, status: str, error) -> None:
        self._release(resident)
        self.outcomes[resident.job_id] = run_end.conclude(
            self.sessions, self.store, resident.job_id, resident.claimed, self.settings, resident.reporter,
            resident.work, status, error)

    # -- cycles ---------------------------------------------------------------

    def run(self) -> None:
        from worker.multi.cycle import run_cycle

        try:
            while self.residents:
                self.fill()
                self.start_admitted()
                live = [r for r in self.residents.values() if r.job is not None]
                if not live:
                    break
                failures = run_cycle(self.shared, [r.job for r in live], device=self.device,
                                     autocast=self.autocast)
                INTERRUPT.clear()
                for resident in live:
                    if resident.job_id in failures:
                        self._fail(resident, failures[resident.job_id])
                    elif resident.reporter.lost or resident.job.done or resident.job.stopped:
                        self._finish(resident)
        finally:
            if self.shared is not None:
                self.shared.close()  # a vLLM engine: a later job in this process may start its own


def run_shared(job_id: str, settings: Settings, *, owner: str | None = None, slots: int | None = None) -> str | None:
    """Run the job, and with it other queued jobs of its base, in this process; returns the job's end status."""
    sessions, store = run_start.connect(settings)
    with sessions.begin() as s:
        job = jobs.get_for_worker(s, job_id)
        spec = JobSpec.model_validate(job.spec) if job is not None else None
        model = job.model if job is not None else None
        alone = refusal(spec) if spec is not None else None
        if alone is not None and job.status == "queued":  # say why, once per run (not for a duplicate message)
            jobs.add_event(s, job_id, f"Running alone, not beside other jobs of {model}: {alone}",
                           data={"reason": "cannot_share"})
    if spec is None or alone is not None:
        return job_runner.run_job(job_id, settings, owner=owner)
    worker = SharedWorker(settings, sessions, store, run_start.worker_owner(owner), model, base_key(spec),
                          slots or settings.worker_jobs)
    worker.admit(job_id)
    worker.run()
    return worker.outcomes.get(job_id)
