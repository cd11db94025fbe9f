"""The CISPO training loop, top to bottom.

Each trainer step: draw batch_size prompts -> sample group_size completions
each (episodes of up to max_turns turns when the job has an environment) ->
reward -> group-relative advantages -> update_epochs x mini_batches
CISPO optimizer steps on that batch (logp_old frozen at rollout) -> metrics
-> evaluation and checkpoint when due.

With several processes (resources.gpus > 1, under torchrun, see
worker/distributed/) every rank runs this same loop on its share of the
batch's prompts, whole groups each, so advantages need no communication;
metrics, reward-error checks and checkpoints are global (gathered), and a
checkpoint resumes at any number of processes. Every random choice of a step
(each completion's tokens, each episode's seed, the mini-batches) comes from
a stream keyed by the job seed, the step and the prompt's (or sequence's)
index in the whole batch (worker/model/streams.py), never by the rank: a
job samples the same completions at 1 or N processes, and a resumed run
replays the uninterrupted one. Asynchronously (rollout.max_staleness > 0)
rank 0's sampler process samples each whole batch ahead and every rank
trains its share of it (worker/trainer/rank_pipeline.py).

Simplifications, on purpose: rollouts from the spec's engine in the trainer's
process (transformers, or vLLM: worker/rollout/), the LM head applied in chunks for log-probs, the
learning rate set per trainer step from a pure schedule function. A run
resumes from the newest complete checkpoint in its output directory and
reaches the same weights as an uninterrupted run with the same seed.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import torch

from service.job_spec.spec import JobSpec
from worker.checkpoints.checkpoint import (
    Checkpoint,
    capture_rng,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    optimizer_state_dict,
    restore_rng,
    save_checkpoint,
)
from worker.distributed import group
from worker.distributed.shard import unsharded
from worker.distributed.state import full_model_state, full_optimizer_state, load_full_optimizer_state
from worker.trainer.data import PromptSampler, load_splits
from worker.trainer.optimizer import adamw
from worker.trainer.metrics import UpdateStats
from worker.rollout.rollout_state import release_rollout_state
from worker.model.optional_swaps import take_messages
from worker.rollout.static_decode import take_compile_fallbacks
from worker.model import precision
from worker.model.policy import MASTER_PREFIX, REFERENCE, Policy, load_policy
from worker.rewards.engine import ScoringContext
from worker.rewards.errors import EnvironmentErrorRateExceeded, RewardErrorRateExceeded, error_rate_message
from worker.trainer.rewards import RewardFn, Scores, component_metrics
from worker.envs import Environment, describe_environment
from worker.trainer.feedback import Feedback, assign_advantages, batch_reward_std, collect_feedback, feedback_source
from worker.rollout import RolloutEngine, make_engine, refuse_unavailable_engine
from worker.trainer.learning_signal import NoLearningSignal, ZeroVarianceWatch, no_signal_message, preflight_rows
from worker.trainer.policy_jump import PolicyJumpWatch
from worker.trainer.evaluation import EvalRows, eval_rows_metrics, eval_seeds, generate_and_score
from worker.trainer.prompt_filter import retire_solved
from worker.trainer.samples import pick_samples
from worker.trainer import supervised
from worker.trainer.schedule import lr_multiplier
from worker.model.streams import stream_seed
from worker.trainer.update import Updater
from worker.rollout.policy_versions import fresh_sequences
from worker.trainer.callbacks import Callbacks, NoCallbacks, TrainResult
from worker.trainer.pipeline import SerialScorer, pipeline_metrics
from worker.trainer.rank_pipeline import RankPipeline
from worker.trainer.resume_check import resume_mismatch
from worker.trainer.step_state import StepDraw, StepState
from worker.rollout.rollout import Rollout

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _share(items: list, rank: int, world: int) -> list:
    """This rank's contiguous share of a list that divides evenly (the spec checks batch_size)."""
    n = len(items) // world
    return items[rank * n : (rank + 1) * n]


def _concat_ranks(local: dict[str, list]) -> dict[str, list]:
    """Each list concatenated over the ranks, in rank order (the single-process order)."""
    parts = group.gather_objects(local)
    return {k: [x for part in parts for x in part[k]] for k in local}


class Trainer:
    """Composes policy, data, reward, updater and checkpoints for one job."""

    def __init__(self, spec: JobSpec, output_dir: Path, *, reward_fn: RewardFn | None = None, resume: bool = True,
                 scoring: ScoringContext | None = None, environment: Environment | None = None,
                 engine: RolloutEngine | None = None, progress=None, sampler_host=None,
                 own_engine: str | None = None):
        """`reward_fn` / `environment`: trusted in-process stand-ins for the spec's reward or environment.

        `engine`: a rollout engine to use instead of the spec's own (tests share one vLLM engine); the caller
        keeps ownership of it. `progress(message)`: told what the slow parts of starting are doing (loading the
        model, starting the engine), so a job shows more than 0% before its first step. `sampler_host`: where
        rank 0 runs the asynchronous sampler (worker/trainer/pipeline.py; the Ray driver's actor), None: a child.
        `own_engine`: the engine of this trainer's own rollouts (evaluations, pre-flight) when not the job's: 'hf'
        on the Ray ranks of a vLLM job, whose training batches the sampler actor's vLLM makes."""
        self._say = progress or (lambda message: None)
        own = spec if own_engine is None else \
            spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"engine": own_engine})})
        if engine is None:
            refuse_unavailable_engine(own)  # before any sandboxed child starts
        self.sampler_host = sampler_host
        seed_everything(spec.seed)
        self.setup(spec, output_dir, resume=resume, reward_fn=reward_fn, environment=environment, scoring=scoring)
        if self.rank:  # sampling draws from keyed streams; the global RNG is left to dropout masks, per rank
            seed_everything(spec.seed + 1_000_003 * self.rank + self.step)
        self.updater = Updater(self.policy, self.optimizer, spec)
        if engine is None and self.samples():
            self._say(f"Starting the rollout engine ({own.rollout.engine})")
        self.engine: RolloutEngine | None = engine or (make_engine(own, self.policy) if self.samples() else None)
        self._owns_engine = engine is None

    # -- setup ------------------------------------------------------------------

    def setup(self, spec: JobSpec, output_dir: Path, *, resume: bool, reward_fn: RewardFn | None,
              environment: Environment | None, scoring: ScoringContext | None,
              callbacks: Callbacks | None = None) -> None:
        """All a job's trainer holds but its model and rollout engine: the data splits and their sampler, the
        checkpoint it resumes from (checked against the spec), the optimizer, the step, the learning-signal
        watches and the reward or environment. The model comes from load_model, a checkpoint's model and
        optimizer state go back through restore_state: those are what a job alone and a resident job
        (worker/multi/job.py) do differently."""
        self.spec, self.output_dir, self.scoring = spec, Path(output_dir), scoring
        self.checkpoint_root = self.output_dir / "checkpoints"
        self.callbacks: Callbacks = callbacks or NoCallbacks()
        self.supervised = spec.method == "supervised"
        self.pipeline: RankPipeline | None = None  # rollout.max_staleness > 0, while run() runs
        self.train_rows, self.val_rows = load_splits(spec.data, seed=spec.seed, use=spec.method)

        found = latest_checkpoint(self.checkpoint_root) if resume else None
        resumed: Checkpoint | None = load_checkpoint(found) if found else None
        warm = load_checkpoint(Path(spec.init_from)) if spec.init_from and resumed is None else None
        if resumed is not None:
            diffs = resume_mismatch(resumed.state.get("spec", {}), spec)
            if diffs:
                raise ValueError(f"cannot resume from {resumed.path}: the spec changed in {', '.join(diffs)}")

        self.policy, params = self.load_model(resumed, warm)
        self.rank, self.world = group.rank(), group.world_size()
        self.optimizer = adamw(params, spec.optimizer)
        self.sampler = PromptSampler(self.train_rows, seed=spec.seed)
        self._drawn: dict[int, list[int]] = {}  # step -> its prompts' rows, drawn at its start or (async) ahead
        self.step = 0
        if resumed is not None:
            self.restore_state(resumed)
            self.sampler = PromptSampler(self.train_rows, seed=spec.seed, **resumed.state["data"])
            self.step = int(resumed.state["step"])
        # The step-0 eval's per-row rewards: every later eval reports its paired difference to them.
        self.eval_baseline: list[float] | None = resumed.state.get("eval_baseline") if resumed is not None else None
        self.last_checkpoint: Path | None = resumed.path if resumed else None
        self.first_eval = self.last_eval = None
        self.stopped = False  # callbacks.should_stop() ended the run at the last step boundary
        self.watch = ZeroVarianceWatch(spec.training.no_signal_steps)
        self.jumps = PolicyJumpWatch(lr=spec.optimizer.lr, ratio_max=spec.loss.ratio_max,
                                     mini_batches=spec.training.mini_batches,
                                     update_epochs=spec.training.update_epochs)
        self._state: StepState | None = None
        # Last, so that a failure above leaves no sandboxed child behind (the caller has no trainer to close).
        self.environment, self.scorer = feedback_source(spec, reward_fn=reward_fn, environment=environment,
                                                        scoring=scoring)

    def load_model(self, resumed: Checkpoint | None, warm: Checkpoint | None) -> tuple[Policy, list]:
        """The job's own model, from the checkpoint it resumes or warm-starts from (else initialised), and its
        trainable parameters. Rank 0 reads the weights; the other ranks receive them (worker/distributed/state.py)."""
        spec = self.spec
        self._say(f"Loading the model {spec.model}" + (f" and the checkpoint at step {resumed.state['step']}"
                                                       if resumed is not None else ""))
        policy = load_policy(spec, resume_from=resumed, warm_start=warm)
        return policy, policy.trainable_parameters()

    def restore_state(self, resumed: Checkpoint) -> None:
        """What a checkpoint holds besides the weights load_model read, the step and the data position: the
        optimizer's state and the random generators'."""
        load_full_optimizer_state(self.policy.model, self.optimizer, optimizer_state_dict(self.optimizer, resumed))
        restore_rng(resumed.state["rng"], {k[4:]: v for k, v in resumed.tensors.items() if k.startswith("rng.")})

    def samples(self) -> bool:
        """Whether the job ever samples: a supervised job without a reward never does."""
        return self.scorer is not None or self.environment is not None

    # -- phases ---------------------------------------------------------------

    def _episodes(self, seeds: list[int]) -> dict:
        """generate()'s environment arguments: none for a reward-function job."""
        if self.environment is None:
            return {}
        return {"environment": self.environment, "max_turns": self.spec.training.max_turns, "seeds": seeds}

    def eval_rows(self, rows: list[dict], *, first: int = 0) -> EvalRows:
        """Greedy completions of `rows`, scored, in row order (worker/trainer/evaluation.py); `first`: the index
        of rows[0] among the rows evaluated, so rows scored in parts get the episode seeds they get together."""
        seeds = eval_seeds(self.spec.seed + first, len(rows))
        mine = list(range(self.rank, len(rows), self.world))  # the ranks split the rows
        local = {name: [] for name in ("rewards", "errors", "lengths", "turns", "prompts", "completions")}
        with unsharded(self.policy.model):
            if mine:
                local = generate_and_score(self.engine, self.policy, self.scorer, [rows[i] for i in mine],
                                           self.spec.sampling, failure_score=self.spec.training.reward_failure_score,
                                           episodes=self._episodes([seeds[i] for i in mine]),
                                           multi_turn=self.environment is not None)
        every = _concat_ranks(local)
        order = [i for r in range(self.world) for i in range(r, len(rows), self.world)]  # rank-major -> row order
        back = sorted(range(len(order)), key=order.__getitem__)
        return EvalRows(**{k: [v[j] for j in back] if k != "errors" else v for k, v in every.items()})

    def eval_source_rows(self) -> list[dict]:
        """The rows every evaluation runs: the held-out rows, or the first training rows when there are none."""
        return (self.val_rows or self.train_rows)[: self.spec.training.eval_max_rows]

    def eval_prompt_rows(self) -> list[dict]:
        """What an evaluation samples from: eval_source_rows, a supervised job's conversations cut before their
        first assistant turn (the prompt)."""
        rows = self.eval_source_rows()
        if not self.supervised:
            return rows
        return [{**r, "messages": r["messages"][:next(i for i, m in enumerate(r["messages"])
                                                      if m["role"] == "assistant")]} for r in rows]

    def checkpoint_due(self, step: int) -> bool:
        """Whether a scheduled checkpoint follows step `step` (the last step always has one)."""
        tc = self.spec.training
        return step >= tc.steps or bool(tc.checkpoint_interval and step % tc.checkpoint_interval == 0)

    def eval_due(self, step: int) -> bool:
        """Whether an evaluation follows step `step`: every scheduled checkpoint carries one (not a cancel's or
        pause's: those stop promptly), and every eval_interval steps."""
        tc = self.spec.training
        return self.checkpoint_due(step) or bool(tc.eval_interval and step % tc.eval_interval == 0)

    def evaluate(self) -> dict[str, float]:
        """Greedy completions on the held-out rows (or the first training rows when there are none), with the
        interval and the paired difference to the step-0 baseline; a supervised job's eval_loss too."""
        rows = self.eval_source_rows()
        metrics: dict[str, float] = {}
        if self.supervised:
            examples = [supervised.encode_conversation(self.policy.tokenizer, r["messages"]) for r in rows]
            metrics["eval_loss"], _ = supervised.cross_entropy(
                self.policy, examples, micro_batch_size=self.spec.training.micro_batch_size,
                chunk_size=self.spec.training.logprob_chunk_size)
        if self.engine is None:
            return metrics
        every = self.eval_rows(self.eval_prompt_rows())
        if self.step == 0 and self.eval_baseline is None:
            self.eval_baseline = list(every.rewards)
        return {**metrics, **eval_rows_metrics(every, self.eval_baseline)}

    def preflight(self) -> dict[str, float]:
        """Sample `preflight_groups` groups from the starting policy and score them; nothing is trained.

        Its own prompts (worker/trainer/learning_signal.py) and a forked RNG, so the training run that follows
        draws exactly the prompts and samples it would without it."""
        tc = self.spec.training
        rows = preflight_rows(self.train_rows, tc.preflight_groups, self.spec.seed)
        seeds = [(self.spec.seed + 7919 * i) % 2**31 for i in range(len(rows))]
        mine = list(range(self.rank, len(rows), self.world))
        local = {"rewards": [], "zero": [], "errors": []}
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices), unsharded(self.policy.model):
            if mine:
                rollout = self.engine.generate(self.policy, [rows[i] for i in mine], self.spec.sampling,
                                               group_size=tc.group_size, **self._episodes([seeds[i] for i in mine]))
                feedback = collect_feedback(rollout, self.scorer, failure_score=tc.reward_failure_score)
                advantages = assign_advantages(rollout, feedback, self.spec.advantages, tc.group_size)
                local = {"rewards": feedback.rewards.tolist(), "zero": advantages.zero_P.float().tolist(),
                         "errors": feedback.errors}
        every = _concat_ranks(local)
        rewards = torch.tensor(every["rewards"])
        return {
            "preflight_groups": float(len(every["zero"])),
            "preflight_reward_mean": float(rewards.mean()),
            "preflight_reward_std": float(rewards.std(unbiased=False)),
            "preflight_zero_variance_fraction": sum(every["zero"]) / len(every["zero"]),
            "preflight_reward_errors": float(len(every["errors"])),
        }

    def _check_preflight(self, cb: Callbacks) -> None:
        metrics = self.preflight()
        if (report := getattr(cb, "on_preflight", None)) is not None:
            report(metrics)
        if self.spec.training.fail_on_no_signal and metrics["preflight_zero_variance_fraction"] >= 1.0:
            raise NoLearningSignal(
                f"no learning signal: all {int(metrics['preflight_groups'])} pre-flight groups got one reward for "
                f"every completion (baseline reward {metrics['preflight_reward_mean']:.4f}), so every advantage is "
                "zero (training.fail_on_no_signal is set)")

    # -- one step: begin_step -> sample -> take_rollout -> update -> end_step -------------------------------
    # train_step runs these in turn; worker/multi/cycle.py runs each phase for every resident job, the sampling
    # and the update batched across them.

    def train_step(self) -> dict[str, float]:
        draw = self.begin_step()
        if self.supervised:
            return self._supervised_step(self._state.lr, self._state.started)
        if self.pipeline is not None:  # sampled and scored ahead (rank 0's sampler process), this rank's share
            scored = self.pipeline.take(self.step)
            state = self.take_rollout(scored.rollout, scored.sample_s, scored=scored, fallbacks=[])
        else:
            with unsharded(self.policy.model):
                rollout = self.engine.generate(self.policy, draw.rows, self.spec.sampling,
                                               group_size=self.spec.training.group_size,
                                               sampling_seeds=draw.sampling_seeds, **self._episodes(draw.episode_seeds))
            rollout_s = time.perf_counter() - self._state.started
            release_rollout_state(self.policy.model)  # a large model's decode caches and copies
            fallbacks = take_compile_fallbacks()  # this step's and the last evaluation's
            self._warn_fallbacks(self.step + 1)
            state = self.take_rollout(rollout, rollout_s, fallbacks=fallbacks)
        update_started = time.perf_counter()
        stats = self.updater.run(state.rollout, state.advantages.per_token, state.indices, step=self.step)
        update_s = time.perf_counter() - update_started
        self._warn_fallbacks(self.step + 1)
        if self.pipeline is not None:
            self.pipeline.publish(self.step + 1, self.policy.model)
        return self.end_step(stats, update_s)

    def begin_step(self) -> StepDraw | None:
        """Set the step's learning rate; its prompts (this rank's share) and their streams, None when the
        asynchronous pipeline drew them ahead (or a supervised step draws its own)."""
        spec, tc = self.spec, self.spec.training
        started = time.perf_counter()
        lr = spec.optimizer.lr * lr_multiplier(spec.schedule, self.step, tc.steps)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        self._state = StepState(lr=lr, started=started)
        if self.supervised or self.pipeline is not None:
            return None
        rows = _share(self.sampler.next_batch(tc.batch_size), self.rank, self.world)
        self._drawn[self.step] = list(self.sampler.last_indices)
        # Streams keyed by each prompt's index in the whole batch (this rank holds a contiguous share), so
        # the draws are the same at any number of processes. An episode seed is shared by the prompt's group.
        prompts = range(self.rank * len(rows), (self.rank + 1) * len(rows))
        sampling_seeds = [stream_seed("sample", spec.seed, self.step, p) for p in prompts]
        seeds = [stream_seed("episode", spec.seed, self.step, p) % (2**31 - 1) for p in prompts] \
            if self.environment is not None else []
        return StepDraw(rows, sampling_seeds, seeds)

    def take_rollout(self, rollout: Rollout, rollout_s: float, *, scored=None,
                     fallbacks: list | None = None) -> StepState:
        """Score the step's rollout (`scored`: the pipeline's, scored already), stop the job when too many samples
        failed, assign advantages and choose the sequences to train on; record samples. Returns the step so far.
        `fallbacks`: the decode's compile fallbacks, None where the decode is not this trainer's own."""
        spec, tc, state = self.spec, self.spec.training, self._state
        feedback = scored.feedback if scored is not None else \
            collect_feedback(rollout, self.scorer, failure_score=tc.reward_failure_score)
        # Every rank judges the whole step's errors, so all stop together.
        errors = _concat_ranks({"errors": feedback.errors})["errors"]
        self._check_reward_errors(self.step + 1, SimpleNamespace(errors=errors), len(rollout) * self.world)
        adv = spec.advantages
        advantages = assign_advantages(rollout, feedback, adv, tc.group_size, batch_std=batch_reward_std(
            feedback.rewards) if adv.scale == "batch_std" else None)
        keep_P = ~advantages.zero_P if adv.drop_zero_groups else torch.ones_like(advantages.zero_P)
        indices = [i for i in range(len(rollout)) if keep_P[i // tc.group_size]]
        if scored is not None:  # never train on a sample more than max_staleness versions old
            indices = sorted(set(indices) & set(fresh_sequences(scored.versions, self.step,
                                                                spec.rollout.max_staleness).kept))
            every_version = _concat_ranks({"versions": scored.versions})["versions"]
            state.fresh = fresh_sequences(every_version, self.step, spec.rollout.max_staleness)  # the whole batch's
        if (record := getattr(self.callbacks, "on_samples", None)) is not None:
            record(self.step + 1, pick_samples(self.policy.tokenizer, rollout, feedback, advantages.episode_PG,
                                               tc.group_size, multi_turn=self.environment is not None))
        state.rollout, state.rollout_s, state.feedback, state.advantages = rollout, rollout_s, feedback, advantages
        state.errors, state.indices, state.fallbacks, state.scored = errors, indices, fallbacks, scored
        return state

    def end_step(self, stats: UpdateStats, update_s: float) -> dict[str, float]:
        """The step's metrics, over every rank's share; retire solved prompts; the step is done."""
        tc, state = self.spec.training, self._state
        rollout, feedback, advantages = state.rollout, state.feedback, state.advantages
        step_s = time.perf_counter() - state.started
        every = _concat_ranks({
            "rewards": feedback.rewards.tolist(), "advantages": advantages.episode_PG.flatten().tolist(),
            "zero": advantages.zero_P.float().tolist(), "counts": rollout.action_counts, "turns": rollout.turns,
            "truncated": rollout.truncated, "all_tokens": [sum(map(len, rollout.token_ids))],
            "components": [feedback.scores.components] if feedback.scores is not None else [], "stats": [stats],
        })
        rewards, advantages_PG = torch.tensor(every["rewards"]), torch.tensor(every["advantages"])
        sequences = len(every["counts"])
        completion_tokens = sum(every["counts"])
        all_tokens = sum(every["all_tokens"])
        components = {name: [v for c in every["components"] for v in c[name]] for name in
                      (every["components"][0] if every["components"] else {})}
        drawn = self._drawn.pop(self.step, [])
        retired = {} if tc.pass_rate_filter is None else {"retired_prompts": float(retire_solved(
            self.sampler, drawn, rewards.view(-1, tc.group_size), tc.pass_rate_filter))}
        self.step += 1
        self._state = None
        errors = state.errors
        return {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "reward_errors": float(len(errors)),
            "reward_error_fraction": len(errors) / sequences,
            **(component_metrics(SimpleNamespace(components=components)) if every["components"] else {}),
            "advantage_mean": float(advantages_PG.mean()),
            "advantage_std": float(advantages_PG.std(unbiased=False)),
            "zero_advantage_group_fraction": sum(every["zero"]) / len(every["zero"]),
            "completion_length_mean": completion_tokens / sequences,
            "turns_mean": sum(every["turns"]) / sequences,
            "truncated_fraction": sum(every["truncated"]) / sequences,
            "lr": state.lr,
            **UpdateStats.combined(every["stats"]).metrics(),
            **({"decode_compile_fallbacks": float(len(state.fallbacks))} if state.fallbacks is not None else {}),
            "rollout_seconds": state.rollout_s,
            "update_seconds": update_s,
            "step_seconds": step_s,
            "sampled_tokens_per_second": completion_tokens / max(state.rollout_s, 1e-9),
            "tokens_per_second": all_tokens / max(step_s, 1e-9),
            **retired,
            **(pipeline_metrics(state.scored, state.fresh) if state.scored is not None else {}),
        }

    def report_step(self, metrics: dict[str, float]) -> None:
        """Report a finished step's metrics and watch them: a policy jump warns, a run of steps without learning
        signal warns or stops the job."""
        cb, tc = self.callbacks, self.spec.training
        cb.on_step(self.step, metrics)
        if (jump := self.jumps.update(metrics)) and (warn := getattr(cb, "on_warning", None)) is not None:
            warn(self.step, jump)
        if not self.supervised and self.watch.update(metrics["zero_advantage_group_fraction"]):
            if tc.fail_on_no_signal:
                raise NoLearningSignal(f"{no_signal_message(self.step, self.watch.streak)} "
                                       "(training.fail_on_no_signal is set)")
            if (warn := getattr(cb, "on_no_signal", None)) is not None:
                warn(self.step, self.watch.streak)

    def finish_step(self) -> None:
        """After a reported step: evaluate and checkpoint when due, ask the callbacks whether to stop."""
        cb = self.callbacks
        due = self.checkpoint_due(self.step)
        if self.eval_due(self.step):
            self.last_eval = self.evaluate()
            cb.on_eval(self.step, self.last_eval)
        self.stopped = cb.should_stop()
        if due or self.stopped:
            cb.on_checkpoint(self.step, self.save())

    def _supervised_step(self, lr: float, started: float) -> dict[str, float]:
        tc = self.spec.training
        rows = self.sampler.next_batch(tc.batch_size)
        examples = [supervised.encode_conversation(self.policy.tokenizer, r["messages"]) for r in rows]
        stats = supervised.supervised_step(self.policy, self.optimizer, examples, micro_batch_size=tc.micro_batch_size,
                                           chunk_size=tc.logprob_chunk_size,
                                           max_grad_norm=self.spec.optimizer.max_grad_norm)
        self.step += 1
        step_s = time.perf_counter() - started
        return {**stats, "lr": lr, "trained_tokens": stats["sequence_tokens"], "step_seconds": step_s,
                "tokens_per_second": stats["sequence_tokens"] / max(step_s, 1e-9)}

    def _check_reward_errors(self, step: int, scores: Scores | Feedback, samples: int) -> None:
        """Report a step's reward errors; stop the job when more than the threshold's share of samples failed."""
        if not scores.errors:
            return
        report = getattr(self.callbacks, "on_reward_errors", None)
        if report is not None:
            report(step, scores.errors)
        threshold = self.spec.training.reward_error_threshold
        if len(scores.errors) > threshold * samples:
            if self.environment is not None:  # its errors name the failing call ("reset: ...", "step 2: ...")
                raise EnvironmentErrorRateExceeded(error_rate_message(
                    step, len(scores.errors), samples, threshold, scores.errors,
                    environment=describe_environment(self.spec.environment)))
            raise RewardErrorRateExceeded(error_rate_message(step, len(scores.errors), samples, threshold,
                                                             scores.errors))

    def save(self) -> Path:
        """Gather whole weights and optimizer state from every rank (collective); rank 0 writes them."""
        policy, path = self.policy, self.checkpoint_root / checkpoint_name(self.step)
        model_state = full_model_state(policy.model)
        masters = {}
        if not policy.is_lora and precision.is_mixed(policy.compute_dtype):
            # Users get the model in the job's dtype; the trainer state keeps the float32 weights for resume.
            whole = policy.model.state_dict() if model_state is None else model_state
            masters = {MASTER_PREFIX + k: v for k, v in whole.items()}
            model_state = {k: v.to(policy.compute_dtype) if v.is_floating_point() else v for k, v in whole.items()}
        optimizer_state = full_optimizer_state(policy.model, self.optimizer)
        reference_state = None
        if policy.pinned_full_reference:
            reference_state = full_model_state(policy.reference_model) if self.world > 1 \
                else policy.reference_model.state_dict()
        if self.rank:
            self.last_checkpoint = path
            return path
        rng_json, rng_tensors = capture_rng()
        path = save_checkpoint(
            path,
            model=policy.model,
            optimizer=optimizer_state,
            model_state=model_state,
            reference_state=reference_state,
            tokenizer=None if policy.is_lora else policy.tokenizer,
            state={
                "step": self.step,
                "data": self._data_state(),
                "eval_baseline": self.eval_baseline,
                "rng": rng_json,
                "spec": self.spec.model_dump(mode="json"),
            },
            tensors={**{f"rng.{k}": v for k, v in rng_tensors.items()}, **masters},
            reference_adapter=REFERENCE if policy.is_lora and policy.has_pinned_reference else None,
        )
        self.last_checkpoint = path
        return path

    def _data_state(self) -> dict:
        """Where the prompts of the next step to train on start (not those already requested ahead)."""
        ahead = self.pipeline.data_state() if self.pipeline is not None else None
        return ahead if ahead is not None else self.sampler.state()

    def _draw(self, step: int) -> tuple[list[dict], list[int], dict]:
        """The prompts and sampling seeds of trainer step `step` (0-based), for the asynchronous pipeline."""
        before = self.sampler.state()
        rows = self.sampler.next_batch(self.spec.training.batch_size)
        self._drawn[step] = list(self.sampler.last_indices)
        return rows, [stream_seed("sample", self.spec.seed, step, p) for p in range(len(rows))], before

    # -- the loop -------------------------------------------------------------

    def run(self, callbacks: Callbacks | None = None) -> TrainResult:
        try:
            if self.spec.rollout.max_staleness > 0 and self.step < self.spec.training.steps:
                if self.environment is not None and self.spec.environment is None:
                    raise ValueError("an in-process stand-in environment cannot run in the sampler process: "
                                     "set rollout.max_staleness to 0")
                if self.scorer is not None:  # the scoring thread and evaluations share it
                    self.scorer = SerialScorer(self.scorer)
                self.pipeline = RankPipeline(self.spec, self.policy.model, step=self.step, scorer=self.scorer,
                                             draw=self._draw, scoring=self.scoring, sampler_host=self.sampler_host)
            return self._run(callbacks)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the sampler process, sandboxed children, connection pools and the rollout engine this trainer
        started."""
        if self.pipeline is not None:  # first: its scoring thread uses the scorer
            self.pipeline.close()
            self.pipeline = None
        for owner in (self.scorer, self.environment):
            if owner is not None:
                owner.close()
        if self._owns_engine and self.engine is not None:
            self.engine.close()

    def _warn_fallbacks(self, step: int) -> None:
        """A warn event for each optimisation that fell back to the plain path since the last call (once per
        optimisation and model: worker/model/optional_swaps.py)."""
        messages = take_messages()
        if messages and (warn := getattr(self.callbacks, "on_warning", None)) is not None:
            for message in messages:
                warn(step, message)

    def _warn_emulated_bf16(self) -> None:
        from worker.rollout import sampling_dtype

        dtypes = {self.policy.compute_dtype, sampling_dtype(self.spec, self.policy)}
        message = precision.emulated_bf16_warning(dtypes, self.policy.device)
        if message and (warn := getattr(self.callbacks, "on_warning", None)) is not None:
            warn(self.step, message)

    def start(self) -> None:
        """The start of a run: a fresh run's pre-flight and step-0 evaluation."""
        self._warn_emulated_bf16()
        if self.step == 0:
            if self.spec.training.preflight_groups and not self.supervised:
                self._check_preflight(self.callbacks)
            self.first_eval = self.last_eval = self.evaluate()
            self.callbacks.on_eval(0, self.first_eval)

    def _run(self, callbacks: Callbacks | None) -> TrainResult:
        self.callbacks = callbacks or NoCallbacks()
        take_messages()  # fallbacks of models of earlier runs in this process, reported (or not) by those
        self.start()
        while self.step < self.spec.training.steps:
            self.report_step(self.train_step())
            self.finish_step()
            if self.stopped:
                break
        return TrainResult(self.step, self.stopped, self.last_checkpoint, self.first_eval, self.last_eval)


def train(spec: JobSpec, output_dir: Path, *, reward_fn: RewardFn | None = None,
          callbacks: Callbacks | None = None, resume: bool = True,
          scoring: ScoringContext | None = None) -> TrainResult:
    return Trainer(spec, output_dir, reward_fn=reward_fn, resume=resume, scoring=scoring).run(callbacks)
