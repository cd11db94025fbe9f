"""One job resident on a shared base: the Trainer of worker/trainer/loop.py, its model being one adapter of many.

A subclass so that the job's pre-flight, evaluations, reward-error checks and
checkpoint contents are the trainer's own code; a job with an environment
runs its episodes in the shared rollout (worker/multi/rollout.py), its
environment called as alone. What differs: the model is
the shared base with this job's adapter (`name`), sampling and the update of
a step run for all resident jobs at once (worker/multi/cycle.py calls
`begin_step`, `take_rollout` and `end_step` in turn), and a checkpoint saves
this job's adapter only (worker/multi/checkpoints.py). The per-step
random streams are the trainer's (keyed by the job seed, step and prompt), so
a job samples what it samples alone.

Not restored from a checkpoint: torch's global RNG, which the resident jobs
share; jobs here draw every sample from keyed streams, and LoRA dropout is the
only other user of that RNG.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch

from service.job_spec.spec import JobSpec
from worker.envs import Environment
from worker.checkpoint import capture_rng, checkpoint_name, latest_checkpoint, load_checkpoint, save_checkpoint
from worker.multi.checkpoints import AdapterView, restore
from worker.multi.engine import JobEngine
from worker.multi.lora import SharedBase
from worker.multi.rollout import RolloutRequest
from worker.multi.support import refusal
from worker.multi.update import JobUpdate
from worker.rewards.engine import ScoringContext
from worker.rollout.rollout import Rollout
from worker.trainer.callbacks import Callbacks, NoCallbacks
from worker.trainer.data import PromptSampler, load_splits
from worker.trainer.evaluation import eval_seeds
from worker.trainer.feedback import assign_advantages, batch_reward_std, collect_feedback, feedback_source
from worker.trainer.learning_signal import NoLearningSignal, ZeroVarianceWatch, no_signal_message
from worker.trainer.policy_jump import PolicyJumpWatch
from worker.trainer.loop import Trainer
from worker.trainer.optimizer import adamw
from worker.trainer.metrics import UpdateStats
from worker.model.policy import Policy
from worker.trainer.prompt_filter import retire_solved
from worker.trainer.resume_check import resume_mismatch
from worker.trainer.rewards import RewardFn, component_metrics
from worker.trainer.samples import pick_samples
from worker.trainer.schedule import lr_multiplier
from worker.model.streams import stream_seed


class ResidentJob(Trainer):
    def __init__(self, spec: JobSpec, output_dir: Path, shared: SharedBase, tokenizer, device: torch.device, *,
                 name: str, reward_fn: RewardFn | None = None, scoring: ScoringContext | None = None,
                 environment: Environment | None = None, resume: bool = True, callbacks: Callbacks | None = None):
        """`reward_fn` / `environment`: trusted in-process stand-ins for the spec's reward or environment."""
        # Trainer.__init__ is not called: it would load a model of the job's own.
        if (problem := refusal(spec)) is not None:
            raise ValueError(f"this job cannot share a base model: {problem}")
        if spec.rollout.engine == "vllm":
            _use_vllm(shared, spec)
        self.spec, self.output_dir, self.name, self.shared = spec, Path(output_dir), name, shared
        self.checkpoint_root = self.output_dir / "checkpoints"
        self.callbacks = callbacks or NoCallbacks()
        self.pipeline, self.supervised = None, False
        self.train_rows, self.val_rows = load_splits(spec.data, seed=spec.seed, use=spec.method)
        found = latest_checkpoint(self.checkpoint_root) if resume else None
        resumed = load_checkpoint(found) if found else None
        if resumed is not None and (diffs := resume_mismatch(resumed.state.get("spec", {}), spec)):
            raise ValueError(f"cannot resume from {resumed.path}: the spec changed in {', '.join(diffs)}")
        # The adapter starts as the job's own would: PEFT's initialisation from torch's RNG seeded with the job seed.
        with torch.random.fork_rng():
            torch.manual_seed(spec.seed)
            self.params = shared.add(name, spec.lora)
        self.policy = Policy(shared.model, tokenizer, device, compute_dtype=next(shared.base.parameters()).dtype)
        self.rank, self.world = 0, 1
        self.optimizer = adamw(self.params, spec.optimizer)
        self.sampler = PromptSampler(self.train_rows, seed=spec.seed)
        self.step = 0
        if resumed is not None:
            restore(shared, name, resumed, self.optimizer)
            self.sampler = PromptSampler(self.train_rows, seed=spec.seed, **resumed.state["data"])
            self.step = int(resumed.state["step"])
        self.eval_baseline = resumed.state.get("eval_baseline") if resumed is not None else None
        self.engine = JobEngine(shared, name, tokenizer, device, kind=spec.rollout.engine)
        self._owns_engine = True
        self.last_checkpoint = resumed.path if resumed is not None else None
        self.watch = ZeroVarianceWatch(spec.training.no_signal_steps)
        self.jumps = PolicyJumpWatch(lr=spec.optimizer.lr, ratio_max=spec.loss.ratio_max,
                                     mini_batches=spec.training.mini_batches, update_epochs=spec.training.update_epochs)
        self.first_eval = self.last_eval = None
        self.stopped = False  # callbacks.should_stop() ended the run at the last step boundary
        self._step_state: SimpleNamespace | None = None
        # As Trainer.__init__ (feedback_source). Last, so that a
        # failure above leaves no sandboxed child behind (the runner has no job to close then).
        self.environment, self.scorer = feedback_source(spec, reward_fn=reward_fn, environment=environment,
                                                        scoring=scoring)

    @property
    def done(self) -> bool:
        return self.step >= self.spec.training.steps

    # -- before the first cycle: the trainer's own start of run ----------------

    def start(self) -> None:
        """The pre-flight and the step-0 evaluation of a fresh run (Trainer._run's start)."""
        self._warn_emulated_bf16()
        if self.step == 0:
            if self.spec.training.preflight_groups:
                self._check_preflight(self.callbacks)
            self.first_eval = self.last_eval = self.evaluate()
            self.callbacks.on_eval(0, self.first_eval)

    def evaluation_may_lead(self) -> bool:
        """Whether start()'s step-0 evaluation may be decoded before the rest of its start (beside other starting
        jobs'): a fresh run whose pre-flight, if any, runs no environment episodes (those keep their order)."""
        return self.step == 0 and not (self.spec.training.preflight_groups and self.environment is not None)

    # -- one cycle: Trainer.train_step split around the shared rollout and update --

    def begin_step(self) -> RolloutRequest:
        spec, tc = self.spec, self.spec.training
        self.engine.forget()  # an evaluation decoded for the last weights, never asked for (its job stopped early)
        lr = spec.optimizer.lr * lr_multiplier(spec.schedule, self.step, tc.steps)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        rows = self.sampler.next_batch(tc.batch_size)
        prompts = range(len(rows))
        seeds = [stream_seed("sample", spec.seed, self.step, p) for p in prompts]
        # Trainer.train_step's episode seeds: an environment's reset gets what it gets alone.
        episode_seeds = [stream_seed("episode", spec.seed, self.step, p) % (2**31 - 1) for p in prompts] \
            if self.environment is not None else []
        self._step_state = SimpleNamespace(lr=lr, started=time.perf_counter())
        return RolloutRequest(self.name, rows, spec.sampling, tc.group_size, sampling_seeds=seeds,
                              engine=spec.rollout.engine, **self._episodes(episode_seeds))

    def take_rollout(self, rollout: Rollout, rollout_s: float) -> JobUpdate:
        """Score the job's rollout and say what it trains on (raises its reward-error failure)."""
        spec, tc, state = self.spec, self.spec.training, self._step_state
        feedback = collect_feedback(rollout, self.scorer, failure_score=tc.reward_failure_score)
        self._check_reward_errors(self.step + 1, feedback, len(rollout))
        adv = spec.advantages
        advantages = assign_advantages(rollout, feedback, adv, tc.group_size, batch_std=batch_reward_std(
            feedback.rewards) if adv.scale == "batch_std" else None)
        keep_P = ~advantages.zero_P if adv.drop_zero_groups else torch.ones_like(advantages.zero_P)
        indices = [i for i in range(len(rollout)) if keep_P[i // tc.group_size]]
        if (record := getattr(self.callbacks, "on_samples", None)) is not None:
            record(self.step + 1, pick_samples(self.policy.tokenizer, rollout, feedback, advantages.episode_PG,
                                               tc.group_size, multi_turn=self.environment is not None))
        state.rollout, state.feedback, state.advantages, state.rollout_s = rollout, feedback, advantages, rollout_s
        return JobUpdate(self.name, spec, self.optimizer, self.params, rollout, advantages.per_token, indices,
                         self.step)

    def end_step(self, stats: UpdateStats, update_s: float) -> dict[str, float]:
        """The step's metrics (the trainer's names), reported, and the learning signal watched; finish_step
        follows (after the due evaluations of all jobs are decoded together)."""
        tc, state = self.spec.training, self._step_state
        rollout, feedback, advantages = state.rollout, state.feedback, state.advantages
        rewards, sequences = feedback.rewards, len(rollout)
        step_s = time.perf_counter() - state.started
        completion_tokens = sum(rollout.action_counts)
        retired = {} if tc.pass_rate_filter is None else {"retired_prompts": float(retire_solved(
            self.sampler, rewards.view(-1, tc.group_size), tc.pass_rate_filter))}
        self.step += 1
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "reward_errors": float(len(feedback.errors)),
            "reward_error_fraction": len(feedback.errors) / sequences,
            **(component_metrics(feedback.scores) if feedback.scores is not None else {}),
            "advantage_mean": float(advantages.episode_PG.mean()),
            "advantage_std": float(advantages.episode_PG.std(unbiased=False)),
            "zero_advantage_group_fraction": float(advantages.zero_P.float().mean()),
            "completion_length_mean": completion_tokens / sequences,
            "turns_mean": sum(rollout.turns) / sequences,
            "truncated_fraction": sum(rollout.truncated) / sequences,
            "lr": state.lr,
            **stats.metrics(),
            "rollout_seconds": state.rollout_s,  # the shared rollout's: every resident job's rows
            "update_seconds": update_s,
            "step_seconds": step_s,
            "sampled_tokens_per_second": completion_tokens / max(state.rollout_s, 1e-9),
            "tokens_per_second": sum(map(len, rollout.token_ids)) / max(step_s, 1e-9),
            **retired,
        }
        self._step_state = None
        cb = self.callbacks
        cb.on_step(self.step, metrics)  # Trainer._run's end of a step, up to its evaluation (finish_step)
        if (jump := self.jumps.update(metrics)) and (warn := getattr(cb, "on_warning", None)) is not None:
            warn(self.step, jump)
        if self.watch.update(metrics["zero_advantage_group_fraction"]):
            if tc.fail_on_no_signal:
                raise NoLearningSignal(f"{no_signal_message(self.step, self.watch.streak)} "
                                       "(training.fail_on_no_signal is set)")
            if (warn := getattr(cb, "on_no_signal", None)) is not None:
                warn(self.step, self.watch.streak)
        return metrics

    def finish_step(self) -> None:
        """The rest of Trainer._run's end of a step: evaluate and checkpoint when due, ask whether to stop."""
        cb = self.callbacks
        due = self.checkpoint_due(self.step)
        if self.eval_due(self.step):
            self.last_eval = self.evaluate()
            cb.on_eval(self.step, self.last_eval)
        self.stopped = cb.should_stop()
        if due or self.stopped:
            cb.on_checkpoint(self.step, self.save())

    def evaluation_request(self) -> RolloutRequest:
        """What this job's next evaluation decodes (Trainer.eval_rows' call of the engine), for worker/multi/engine.py
        to decode beside other jobs' evaluations."""
        rows = self.eval_source_rows()
        return RolloutRequest(self.name, rows, self.spec.sampling, 1, greedy=True, engine=self.spec.rollout.engine,
                              **self._episodes(eval_seeds(self.spec.seed, len(rows))))

    def save(self) -> Path:
        """This job's adapter, optimizer and data position, in the format a job alone writes."""
        rng_json, rng_tensors = capture_rng()
        path = save_checkpoint(
            self.checkpoint_root / checkpoint_name(self.step), model=AdapterView(self.shared, self.name),
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
        self.shared.remove(self.name)


def _use_vllm(shared: SharedBase, spec: JobSpec) -> None:
    """Refuse as a job alone would (no vllm here, a model it cannot run), else make sure the base has its vLLM
    engine (started at the first rollout)."""
    from worker.multi.vllm_engine import SharedVLLM
    from worker.rollout import refuse_unavailable_engine, refuse_unsupported_model

    refuse_unavailable_engine(spec)
    refuse_unsupported_model(shared.base.config.to_dict(), cuda=torch.cuda.is_available())
    if shared.vllm is None:
        shared.vllm = SharedVLLM(spec, shared.slots)
