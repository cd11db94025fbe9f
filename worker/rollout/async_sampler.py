"""The sampler process of asynchronous CISPO (rollout.max_staleness > 0).

A spawned child holds its own copy of the model (built from the job spec,
then given the trainer's trainable tensors as version `step`) and runs
worker/rollout/rollout.py's generate with the job's engine: our decode loop
(rollout.engine 'hf'), or a vLLM engine started in the child ('vllm'), which
is given each version as it arrives. Per-token log-probs are always on: they
are logp_old of the samples it produces. A job with an environment runs its episodes here too,
against the child's own instance of the environment (a python environment's
sandbox is started by this child; an http one is called from it). Its inbox
carries, in order:

    ("version", v, tensors)                         the policy after v trainer steps
    ("request", step, rows, seeds, episode_seeds)   trainer step `step`'s prompts (0-based), sampling seeds and
                                                    environment reset seeds (empty without an environment)
    ("stop",)

and it answers on its outbox ("batch", step, version, rollout, sample_s,
update_wait_s) or ("error", traceback). Requests are served in order, each
with the newest version the child holds (rollout.version_policy 'newest') or
with the newest one sent before the request ('fixed_lag': the inbox is read
in order, so timing cannot change what is sampled), and a request for step j waits until
the child holds version j - max_staleness or newer (the wait is
update_wait_s: the sampler idle for want of weights), so no batch is ever
produced more than max_staleness versions behind the step that trains it.

On the Ray backend the same child is started by the job's sampler actor
(worker/ray_driver/sampler_actor.py) rather than by the trainer's rank 0.

The child exits on "stop", when its parent process is gone (checked every
second while idle), or after reporting an error. `SamplerProcess.close()`
stops and joins it on every exit path of the trainer, killing it if it does
not stop in time.
"""

from __future__ import annotations

import queue
import signal
import time
import traceback
from collections import deque

import torch
import torch.multiprocessing as mp

from service.job_spec.spec import JobSpec
from worker.rollout.policy_versions import load_trainable_state

__all__ = ["SamplerProcess", "SamplerDied"]

POLL_S = 1.0


class SamplerDied(RuntimeError):
    """The sampler process ended without being asked to, or reported an error."""


def sampler_spec(spec: JobSpec) -> JobSpec:
    """What the child needs of the spec to build its model: no reference model, no gradient checkpointing."""
    return spec.model_copy(update={
        "loss": spec.loss.model_copy(update={"kl_beta": 0.0}),
        "training": spec.training.model_copy(update={"gradient_checkpointing": False}),
        "init_from": None,
    })


class DecodeLoopSampler:
    """rollout.engine 'hf': our decode loop over the child's own copy of the model."""

    def __init__(self, spec: JobSpec, state: dict[str, torch.Tensor]):
        from worker.model.policy import load_policy
        from worker.rollout import sampling_dtype
        from worker.rollout.rollout import TransformersSampler

        self.policy = load_policy(sampler_spec(spec), resume_from=None, warm_start=None)
        load_trainable_state(self.policy.model, state)
        self.policy.model.eval()
        self.sample = TransformersSampler(self.policy, spec.sampling, dtype=sampling_dtype(spec, self.policy),
                                           logprobs=True)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        load_trainable_state(self.policy.model, state)

    def close(self) -> None:
        pass


class VLLMSampler:
    """rollout.engine 'vllm': a vLLM engine in the child (worker/rollout/vllm_engine.py). Each version goes into
    the child's copy of the policy, then to the engine: a LoRA adapter as a new LoRARequest with the next
    numbered id (the previous one removed), full weights reloaded in place. The copy also gives the tokenizer."""

    def __init__(self, spec: JobSpec, state: dict[str, torch.Tensor]):
        from peft import PeftModel

        from worker.model.policy import load_policy
        from worker.rollout.vllm_engine import VLLMEngine

        self.policy = load_policy(sampler_spec(spec), resume_from=None, warm_start=None)
        self.engine = VLLMEngine(spec, lora=isinstance(self.policy.model, PeftModel))
        self.sample = self.engine.sample  # its log-probs are after temperature: what the trainer scores
        self.load(state)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        load_trainable_state(self.policy.model, state)
        self.engine.sync(self.policy.model)

    def close(self) -> None:
        self.engine.close()


def _build_sampler(spec: JobSpec, state: dict[str, torch.Tensor]) -> DecodeLoopSampler | VLLMSampler:
    return VLLMSampler(spec, state) if spec.rollout.engine == "vllm" else DecodeLoopSampler(spec, state)


def _sampler_main(spec_json: dict, version: int, state: dict, inbox, outbox, max_staleness: int,
                  threads: int, environment_access: tuple) -> None:
    """The child's whole life: build, then serve requests until stopped (see the module docstring)."""
    torch.set_num_threads(threads)  # its share of the cores (worker/rollout/thread_split.py)
    # A Ctrl-C or SIGTERM to the process group is the trainer's to handle (it drains the job and stops us);
    # dying of it here would fail the job instead. close() ends a child that does not stop with SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _serve(JobSpec.model_validate(spec_json), version, state, inbox, outbox, max_staleness, environment_access)
    except BaseException:  # noqa: BLE001 - everything goes to the parent, which raises it
        outbox.put(("error", traceback.format_exc()))


def _serve(spec: JobSpec, version: int, state: dict, inbox, outbox, max_staleness: int,
           environment_access: tuple) -> None:
    from worker.envs import make_environment

    environment = None
    if spec.environment is not None:
        egress, secrets = environment_access
        environment = make_environment(spec.environment, egress=egress, secrets=secrets)
    try:
        _serve_requests(spec, version, state, inbox, outbox, max_staleness, environment)
    finally:
        if environment is not None:
            environment.close()


def _serve_requests(spec: JobSpec, version: int, state: dict, inbox, outbox, max_staleness: int,
                    environment) -> None:
    sampler = _build_sampler(spec, state)
    try:
        _serve_with(sampler, spec, version, inbox, outbox, max_staleness, environment)
    finally:
        sampler.close()


def _serve_with(sampler: DecodeLoopSampler | VLLMSampler, spec: JobSpec, version: int, inbox, outbox,
                max_staleness: int, environment) -> None:
    from worker.rollout.rollout import generate

    parent = mp.parent_process()
    pending: deque[tuple[int, list[dict], list[int], list[int]]] = deque()
    newest: tuple[int, dict] | None = None  # a version received but not loaded yet
    waited = 0.0  # seconds spent waiting for weights since the last batch

    def handle(message) -> bool:
        nonlocal newest
        if message[0] == "stop":
            return False
        if message[0] == "version":
            newest = (message[1], message[2])
        elif message[0] == "request":
            pending.append((message[1], message[2], message[3], message[4]))
        return True

    # 'fixed_lag': read no further than the next request, so it is sampled with the versions sent before it
    # (the trainer sends the request of step j right after version j - max_staleness)
    in_order = spec.rollout.version_policy == "fixed_lag"
    while True:
        while not (in_order and pending):  # 'newest': take everything already sent, the newest version samples
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                break
            if not handle(message):
                return
        if newest is not None and newest[0] > version:
            sampler.load(newest[1])
            version = newest[0]
        newest = None
        if pending and version >= pending[0][0] - max_staleness:
            step, rows, seeds, episode_seeds = pending.popleft()
            episodes = {} if environment is None else {
                "environment": environment, "max_turns": spec.training.max_turns, "seeds": episode_seeds}
            started = time.perf_counter()
            rollout = generate(sampler.policy, rows, spec.sampling, group_size=spec.training.group_size,
                               sampling_seeds=seeds, sampler=sampler.sample, **episodes)
            outbox.put(("batch", step, version, rollout, time.perf_counter() - started, waited))
            waited = 0.0
            continue
        started = time.perf_counter()
        try:
            message = inbox.get(timeout=POLL_S)
        except queue.Empty:
            message = None
        if pending:  # a request is held back until newer weights arrive
            waited += time.perf_counter() - started
        if message is None:
            if parent is not None and not parent.is_alive():
                return
        elif not handle(message):
            return


class SamplerProcess:
    """The parent's handle on the sampler child: send versions and requests, receive batches, stop it."""

    def __init__(self, spec: JobSpec, *, version: int, state: dict[str, torch.Tensor], threads: int,
                 egress=None, secrets: dict[str, str] | None = None):
        """`egress`, `secrets`: what the job's environment may reach and its auth secret (worker/envs/)."""
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked CUDA context, threads or locks
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=_sampler_main, name="cispo-sampler", daemon=True,
            args=(spec.model_dump(mode="json"), version, state, self.inbox, self.outbox,
                  spec.rollout.max_staleness, threads, (egress, dict(secrets or {}))))
        self.process.start()
        self.closed = False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def death(self) -> str:
        """Why it is gone (once alive() is False)."""
        return f"the sampler process exited with code {self.process.exitcode}"

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.inbox.put(("version", version, state))

    def request(self, step: int, rows: list[dict], seeds: list[int], episode_seeds: list[int] = ()) -> None:
        self.inbox.put(("request", step, rows, seeds, list(episode_seeds)))

    def receive(self, timeout: float):
        """The child's next message, or None after `timeout`; SamplerDied when it reported an error or is gone."""
        try:
            message = self.outbox.get(timeout=timeout)
        except queue.Empty:
            if not self.process.is_alive():
                raise SamplerDied(f"the sampler process exited with code {self.process.exitcode}") from None
            return None
        if message[0] == "error":
            raise SamplerDied(f"the sampler process failed:\n{message[1]}")
        return message

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child and wait for it; terminate, then kill, one that does not stop in `timeout` s."""
        if self.closed:
            return
        self.closed = True
        try:
            self.inbox.put(("stop",))
        except (ValueError, OSError):
            pass
        self.process.join(timeout)
        for end in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                end()
                self.process.join(5.0)
        for q in (self.inbox, self.outbox):  # never block on a feeder thread whose reader is gone
            q.cancel_join_thread()
            q.close()
