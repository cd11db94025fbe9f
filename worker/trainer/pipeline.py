"""The trainer's side of asynchronous rollouts (rollout.max_staleness = s > 0).

While the trainer updates step k, the sampler process (worker/rollout/
async_sampler.py) already produces the batches of steps k+1..k+s, and a
thread of the trainer's process scores each batch as it arrives (the job's
own scorer, sandboxed as ever), so rewards are ready beside sampling, not
after it. The trainer then:

    take(k)       the scored batch of step k (the wait is rollout_wait_s)
    publish(k+1)  after the update: the new trainable tensors as version k+1,
                  then the request for step k+1+s

Prompts are still drawn by the trainer's PromptSampler, in step order, so the
batches are the synchronous loop's; a checkpoint records the data position
before the oldest batch not yet trained on: a resumed run discards what was
in flight and requests it again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from service.job_spec.spec import JobSpec
from worker.rollout.async_sampler import SamplerDied, SamplerProcess
from worker.rollout.policy_versions import Freshness
from worker.rollout.thread_split import split_threads
from worker.trainer.feedback import Feedback, collect_feedback
from worker.rewards.engine import ScoringContext
from worker.trainer.rewards import Scorer, Scores
from worker.model.streams import stream_seed
from worker.rollout.rollout import Rollout

DEAD_GRACE_S = 5.0  # after the sampler died, how long take() leaves the scoring thread to report it

# draw(step) -> (rows, sampling seeds, the data sampler's state before drawing them)
Draw = Callable[[int], tuple[list[dict], list[int], dict]]
# host(spec, version=, state=, egress=, secrets=) -> a sampler with SamplerProcess's methods (publish, request,
# receive, alive, death, close, pid), running elsewhere on cores of its own (the Ray sampler actor)
SamplerHost = Callable[..., Any]


@dataclass
class ScoredBatch:
    step: int  # 0-based trainer step it was requested for
    rollout: Rollout
    feedback: Feedback
    versions: list[int]  # the policy version that produced each sequence
    sample_s: float  # the sampler's time generating it
    update_wait_s: float  # the sampler's time waiting for weights before it
    rollout_wait_s: float = 0.0  # the trainer's time waiting for it (set by take)


class SerialScorer:
    """A scorer shared by the scoring thread and the trainer's evaluations: one call at a time."""

    def __init__(self, scorer: Scorer):
        self.scorer, self._lock = scorer, threading.Lock()

    def score(self, completions: list[str], rows: list[dict], *, failure_score: float) -> Scores:
        with self._lock:
            return self.scorer.score(completions, rows, failure_score=failure_score)

    def close(self) -> None:
        self.scorer.close()


class RolloutPipeline:
    def __init__(self, spec: JobSpec, state: dict[str, torch.Tensor], *, step: int, scorer: Scorer | None,
                 draw: Draw, scoring: ScoringContext | None = None, sampler_host: SamplerHost | None = None):
        """`state`: the trainable tensors after `step` steps (worker/rollout/policy_versions.py); `scorer` None:
        an environment job (its episodes' rewards come with the rollout); `scoring`: the egress policy and
        secrets the sampler's instance of the environment gets; `sampler_host`: where the sampler runs (None: a
        child process of this one)."""
        self.spec = spec
        self.max_staleness, self.steps = spec.rollout.max_staleness, spec.training.steps
        self.failure_score = spec.training.reward_failure_score
        self.scorer, self.draw = scorer, draw
        self._threads = torch.get_num_threads()
        access = {"egress": scoring.egress if scoring else None, "secrets": scoring.secrets if scoring else None}
        if sampler_host is None:
            # The trainer and the sampler each on cores of their own; close() gives the trainer all of them back.
            trainer_threads, sampler_threads = split_threads(self._threads)
            self.sampler = SamplerProcess(spec, version=step, state=state, threads=sampler_threads, **access)
            torch.set_num_threads(trainer_threads)
        else:  # elsewhere, on its own cores: the trainer keeps all of this process's
            self.sampler = sampler_host(spec, version=step, state=state, **access)
        self._next_request = step
        self._data_states: dict[int, dict] = {}  # requested, not yet taken: the data position before each
        self._ready: dict[int, ScoredBatch] = {}
        self._error: BaseException | None = None
        self._closing = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._receive_and_score, name="rollout-scoring", daemon=True)
        self._thread.start()
        try:
            self._top_up(step)
        except BaseException:
            self.close()
            raise

    def _top_up(self, version: int) -> None:
        """Request every step the sampler may produce with `version` (up to version + max_staleness)."""
        while self._next_request <= min(version + self.max_staleness, self.steps - 1):
            rows, seeds, state = self.draw(self._next_request)
            self._data_states[self._next_request] = state
            self.sampler.request(self._next_request, rows, seeds, episode_seeds(self.spec, self._next_request,
                                                                                len(rows)))
            self._next_request += 1

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Send the trainable tensors after `version` trainer steps, then the request they newly allow."""
        self.sampler.publish(version, state)
        self._top_up(version)

    def take(self, step: int) -> ScoredBatch:
        started = time.perf_counter()
        dead_since = None
        with self._changed:
            while step not in self._ready and self._error is None:
                self._changed.wait(timeout=1.0)
                # The scoring thread reports a dead sampler; should it hang on a message cut short, this does.
                if self.sampler.alive():
                    continue
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > DEAD_GRACE_S:
                    raise SamplerDied(self.sampler.death())
            if step not in self._ready:
                raise self._error
            batch = self._ready.pop(step)
        self._data_states.pop(step, None)
        batch.rollout_wait_s = time.perf_counter() - started
        return batch

    def data_state(self) -> dict | None:
        """The data sampler's state before the oldest batch requested but not trained on (None: none is)."""
        return self._data_states[min(self._data_states)] if self._data_states else None

    @property
    def sampler_pid(self) -> int | None:
        return self.sampler.pid

    def _receive_and_score(self) -> None:
        try:
            while not self._closing.is_set():
                message = self.sampler.receive(timeout=0.5)
                if message is None or message[0] != "batch":
                    continue
                _, step, version, rollout, sample_s, update_wait_s = message
                feedback = collect_feedback(rollout, self.scorer, failure_score=self.failure_score)
                batch = ScoredBatch(step, rollout, feedback, [version] * len(rollout), sample_s, update_wait_s)
                with self._changed:
                    self._ready[step] = batch
                    self._changed.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread by take()
            if not self._closing.is_set():
                with self._changed:
                    self._error = e
                    self._changed.notify_all()

    def close(self) -> None:
        """Stop the scoring thread and the sampler process (joined, killed if it must be)."""
        self._closing.set()
        try:
            self.sampler.close()
        finally:
            self._thread.join(timeout=10.0)
            torch.set_num_threads(self._threads)


def episode_seeds(spec: JobSpec, step: int, prompts: int) -> list[int]:
    """Each prompt's environment reset seed at trainer step `step`: the synchronous loop's (worker/trainer/loop.py)."""
    if spec.environment is None:
        return []
    return [stream_seed("episode", spec.seed, step, p) % (2**31 - 1) for p in range(prompts)]


def pipeline_metrics(scored: ScoredBatch, fresh: Freshness) -> dict[str, float]:
    """How far behind the trained samples were, and who waited for whom (asynchronous rollouts only)."""
    return {"policy_lag_mean": fresh.lag_mean, "policy_lag_max": float(fresh.lag_max),
            "stale_dropped": float(fresh.dropped), "rollout_wait_s": scored.rollout_wait_s,
            "update_wait_s": scored.update_wait_s}
