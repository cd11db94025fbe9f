"""One job resident on a shared base: the Trainer of worker/trainer/loop.py, its model being one adapter of many.

A subclass so that the job's setup (Trainer.setup), pre-flight, evaluations,
step phases and metrics are the trainer's own code; a job with an environment
runs its episodes in the shared rollout (worker/multi/rollout.py), its
environment called as alone. What differs: the model is
the shared base with this job's adapter (`name`; load_model, restore_state),
beside it, frozen, the adapter a warm-started job (init_from) pins as its
reference, as alone; sampling and the update of a step run for all resident
jobs at once (worker/multi/cycle.py calls `begin_step`, `take_rollout` and
`end_step` in turn, the update being worker/trainer/plan.py's plan), and a
checkpoint saves this job's adapters only (worker/multi/checkpoints.py). The per-step
random streams are the trainer's (keyed by the job seed, step and prompt), so
a job samples what it samples alone.

Asynchronous sampling (rollout.max_staleness = s > 0): alone, a sampler process
samples step j's batch with an older policy version while the trainer updates
(worker/trainer/pipeline.py); 'fixed_lag' makes it exactly version
max(start, j - s), start being the step the run started or resumed at. Here a
cycle samples between updates, nothing in flight, so the job keeps that version
itself: a frozen sampling copy of its adapter (`name` + SAMPLING_SUFFIX) on the
shared base, which its rollout rows are routed through, loaded at each step
from the snapshots of its last s + 1 versions. The batch is then taken as the
pipeline's is (the sampler's log-probs as logp_old, every sequence tagged with
its version, stale ones dropped, the lag metrics), so the job samples and trains
what it does alone. 'newest' (timing decides alone) samples the same way: the
timing of a sampler that is always ahead, reproducible here. Only the rollout
is stale: pre-flight and evaluations sample the current adapter, as alone.

A job with its own rollout.dtype (bfloat16 sampling for a float32 job) samples,
rollouts, pre-flight and evaluations alike, on copies of the base's weights
cast to it, its adapter in float32 on them, as alone (worker/multi/rollout.py);
the jobs of one worker share that dtype (worker/multi/support.py's base_key).

Not restored from a checkpoint: torch's global RNG, which the resident jobs
share; jobs here draw every sample from keyed streams, and LoRA dropout is the
only other user of that RNG.
"""

from __future__ import annotations

from pathlib import Path

import torch

from service.job_spec.spec import JobSpec
from worker.envs import Environment
from worker.checkpoints.checkpoint import Checkpoint, capture_rng, checkpoint_name, save_checkpoint
from worker.multi.checkpoints import AdapterView, restore, restore_adapter
from worker.multi.engine import JobEngine
from worker.multi.lora import BASE_ONLY, SharedBase
from worker.multi.rollout import RolloutRequest
from worker.multi.support import refusal
from worker.multi.update import JobUpdate
from worker.rewards.engine import ScoringContext
from worker.rollout.rollout import Rollout
from worker.trainer.callbacks import Callbacks
from worker.trainer.evaluation import eval_seeds
from worker.trainer.feedback import collect_feedback
from worker.trainer.loop import Trainer
from worker.trainer.metrics import UpdateStats
from worker.trainer.pipeline import ScoredBatch
from worker.model.policy import REFERENCE, Policy, pinned_reference_dir
from worker.model.precision import rollout_dtype
from worker.trainer.rewards import RewardFn


REFERENCE_SUFFIX = "~reference"  # a job's pinned reference adapter on the shared base: its name and this
SAMPLING_SUFFIX = "~sampling"  # an asynchronous job's stale sampling copy of its adapter: its name and this


class ResidentJob(Trainer):
    def __init__(self, spec: JobSpec, output_dir: Path, shared: SharedBase, tokenizer, device: torch.device, *,
                 name: str, reward_fn: RewardFn | None = None, scoring: ScoringContext | None = None,
                 environment: Environment | None = None, resume: bool = True, callbacks: Callbacks | None = None):
        """`reward_fn` / `environment`: trusted in-process stand-ins for the spec's reward or environment."""
        # Not Trainer.__init__: it would load a model of the job's own and start a rollout engine.
        if (problem := refusal(spec)) is not None:
            raise ValueError(f"this job cannot share a base model: {problem}")
        if spec.rollout.engine == "vllm":
            _use_vllm(shared, spec)
        self.name, self.shared, self._tokenizer, self._device = name, shared, tokenizer, device
        # asynchronous sampling: the adapter its rollouts sample with, and its recent versions (version -> weights)
        self.sampling_adapter = f"{name}{SAMPLING_SUFFIX}" if spec.rollout.max_staleness > 0 else name
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._sampled_version: int | None = None  # the version this step's rollout samples with
        self.setup(spec, output_dir, resume=resume, reward_fn=reward_fn, environment=environment, scoring=scoring,
                   callbacks=callbacks)
        self.engine = JobEngine(shared, name, tokenizer, device, kind=spec.rollout.engine) if self.samples() else None
        self._owns_engine = True

    def load_model(self, resumed: Checkpoint | None, warm: Checkpoint | None) -> tuple[Policy, list]:
        """The shared base with this job's adapter added, holding the adapter it warm-starts from (a resumed job's
        weights follow in restore_state), and the adapter it pins as its reference, frozen, as alone
        (worker/model/policy.py's pinned_reference_dir)."""
        # The adapter starts as the job's own would: PEFT's initialisation from torch's RNG seeded with the job seed.
        with torch.random.fork_rng():
            torch.manual_seed(self.spec.seed)
            sampled_in = rollout_dtype(self.spec)
            self.params = self.shared.add(self.name, self.spec.lora, head_float32=self.spec.training.lm_head_float32,
                                          rollout_dtype=sampled_in)
            if self.sampling_adapter != self.name:  # its weights are set before each rollout (_stale_sampling)
                self.shared.add(self.sampling_adapter, self.spec.lora, trainable=False,
                                head_float32=self.spec.training.lm_head_float32, rollout_dtype=sampled_in)
        if warm is not None:
            restore_adapter(self.shared, self.name, warm)
        self.reference = BASE_ONLY  # the adapter of its reference policy's rows (a KL term): the base alone
        if (pinned := pinned_reference_dir(resumed, warm)) is not None:
            self.reference = f"{self.name}{REFERENCE_SUFFIX}"
            self.shared.load(self.reference, str(pinned))
        policy = Policy(self.shared.model, self._tokenizer, self._device,
                        compute_dtype=next(self.shared.base.parameters()).dtype,
                        lm_head_float32=self.spec.training.lm_head_float32)
        return policy, self.params

    def restore_state(self, resumed: Checkpoint) -> None:
        """The checkpoint's adapter and optimizer state (not torch's global RNG, which the resident jobs share)."""
        restore(self.shared, self.name, resumed, self.optimizer)

    @property
    def done(self) -> bool:
        return self.step >= self.spec.training.steps

    def evaluation_may_lead(self) -> bool:
        """Whether start()'s step-0 evaluation may be decoded before the rest of its start (beside other starting
        jobs'): a fresh run whose pre-flight, if any, runs no environment episodes (those keep their order)."""
        return self.engine is not None and self.step == 0 and \
            not (self.spec.training.preflight_groups and self.environment is not None)

    # -- one cycle: Trainer's phases of a step, its sampling and update shared with the other jobs --------------

    def begin_step(self) -> RolloutRequest | None:
        """Trainer.begin_step, as the request of this job's rows in the shared rollout (None: a supervised step,
        which samples nothing)."""
        if self.engine is not None:
            self.engine.forget()  # an evaluation decoded for the last weights, never asked for (its job stopped early)
        draw = super().begin_step()
        if draw is None:
            return None
        asynchronous = self.sampling_adapter != self.name
        if asynchronous:
            self._stale_sampling()
        return RolloutRequest(self.sampling_adapter, draw.rows, self.spec.sampling, self.spec.training.group_size,
                              sampling_seeds=draw.sampling_seeds, engine=self.spec.rollout.engine,
                              logprobs=asynchronous, **self._episodes(draw.episode_seeds))

    def _stale_sampling(self) -> None:
        """Load the version this step samples with into the sampling copy: max(start, step - max_staleness), the
        version a job alone sends before this step's request (worker/rollout/async_sampler.py's 'fixed_lag')."""
        self._versions[self.step] = {k: v.clone() for k, v in self.shared.adapter_state(self.name).items()}
        version = max(min(self._versions), self.step - self.spec.rollout.max_staleness)
        copy = self.shared.adapter_state(self.sampling_adapter)  # detached views of its (frozen) parameters
        with torch.no_grad():
            for key, weights in self._versions[version].items():
                copy[key].copy_(weights)
        self._sampled_version = version
        # the next step samples version step + 1 - max_staleness or newer
        for old in [v for v in self._versions if v <= self.step - self.spec.rollout.max_staleness]:
            del self._versions[old]

    def supervised_step(self) -> dict[str, float]:
        """A supervised job's step: Trainer.train_step's (worker/trainer/supervised.py), every forward through this
        job's adapter (it samples nothing, so it shares no batch), its gradient checkpointed as alone; reported and
        watched as Trainer._run does (finish_step follows, as end_step's)."""
        with self.shared.router.only(self.name), \
                self.shared.checkpointing(self.spec.training.gradient_checkpointing):
            metrics = self.train_step()
        self.report_step(metrics)
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Trainer.evaluate; a supervised job's eval-loss forwards through this job's adapter (its sampling routes
        its own rows)."""
        with self.shared.router.only(self.name):
            return super().evaluate()

    def take_rollout(self, rollout: Rollout, rollout_s: float) -> JobUpdate:
        """Trainer.take_rollout (raises the job's reward-error failure), and this job's share of the update; an
        asynchronous job's rollout taken as the pipeline's scored batch of its sampled version."""
        scored = None
        if self.sampling_adapter != self.name:
            feedback = collect_feedback(rollout, self.scorer, failure_score=self.spec.training.reward_failure_score)
            scored = ScoredBatch(self.step, rollout, feedback, [self._sampled_version] * len(rollout),
                                 sample_s=rollout_s, update_wait_s=0.0)
        state = super().take_rollout(rollout, rollout_s, scored=scored)
        return JobUpdate(self.name, self.spec, self.optimizer, self.params, rollout, state.advantages.per_token,
                         state.indices, self.step, reference=self.reference)

    def end_step(self, stats: UpdateStats, update_s: float) -> dict[str, float]:
        """Trainer.end_step's metrics, reported and watched as Trainer._run does; finish_step follows (after the
        due evaluations of all jobs are decoded together). `rollout_seconds`: the shared rollout's."""
        metrics = super().end_step(stats, update_s)
        self.report_step(metrics)
        return metrics

    def evaluation_request(self) -> RolloutRequest:
        """What this job's next evaluation decodes (Trainer.eval_rows' call of the engine), for worker/multi/engine.py
        to decode beside other jobs' evaluations."""
        rows = self.eval_prompt_rows()
        return RolloutRequest(self.name, rows, self.spec.sampling, 1, greedy=True, engine=self.spec.rollout.engine,
                              **self._episodes(eval_seeds(self.spec.seed, len(rows))))

    def save(self) -> Path:
        """This job's adapter, optimizer and data position, in the format a job alone writes."""
        rng_json, rng_tensors = capture_rng()
        path = save_checkpoint(
            self.checkpoint_root / checkpoint_name(self.step),
            model=AdapterView(self.shared, self.name, reference=self.reference),
            reference_adapter=REFERENCE if self.reference is not BASE_ONLY else None,
            optimizer=self.optimizer.state_dict(),
            state={"step": self.step, "data": self.sampler.state(), "eval_baseline": self.eval_baseline,
                   "rng": rng_json, "spec": self.spec.model_dump(mode="json")},
            tensors={f"rng.{k}": v for k, v in rng_tensors.items()})
        self.last_checkpoint = path
        return path

    def close(self) -> None:
        """Stop the job's scorer or environment; take its adapter off the shared base and the vLLM engine."""
        super().close()
        if self.shared.vllm is not None:
            self.shared.vllm.forget(self.name)
            self.shared.vllm.forget(self.sampling_adapter)
        self.shared.remove(self.name)
        self.shared.remove(self.sampling_adapter)  # an asynchronous job's (no-op otherwise: gone already)
        self._versions.clear()
        if self.reference is not BASE_ONLY:
            self.shared.remove(self.reference)


def _use_vllm(shared: SharedBase, spec: JobSpec) -> None:
    """Refuse as a job alone would (no vllm here, a model it cannot run), else make sure the base has its vLLM
    engine (started at the first rollout)."""
    from worker.multi.vllm_engine import SharedVLLM
    from worker.rollout import refuse_unavailable_engine, refuse_unsupported_model

    refuse_unavailable_engine(spec)
    refuse_unsupported_model(shared.base.config.to_dict(), cuda=torch.cuda.is_available())
    if shared.vllm is None:
        shared.vllm = SharedVLLM(spec, shared.slots)
