"""Multi-turn (environment) jobs on a shared base: each job's rollout is driven once, its turns decoded beside the
other jobs' rows, and it yields what it yields alone, its environment called exactly as alone (reset once per
episode, step once per episode and turn, release once).

Rollouts: tokens, masks and turn rewards equal the job's own generate() on a model of its own (the decode's
bound, tests/worker/multi/test_shared_decode.py). Whole jobs: the adapter within the batched update's bound,
1e-3 * lr per optimizer step (tests/worker/multi/test_resident_jobs.py).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from service.job_spec.sampling import SamplingSpec
from service.job_spec.spec import JobSpec
from tests.specs import job_spec
from worker.envs.protocol import Outcome
from worker.multi.cycle import run_cycle
from worker.multi.job import ResidentJob
from worker.multi.lora import SharedBase
from worker.multi.rollout import RolloutRequest, generate_jobs
from worker.model.policy import Policy
from worker.model.streams import stream_seed
from worker.rollout.rollout import generate, TransformersSampler
from worker.toy.__main__ import toy_spec
from worker.toy.task import reward as toy_reward
from worker.toy.two_turn import environment_spec, plain_chat_model
from worker.trainer.loop import Trainer

from tests.worker.multi.conftest import LORAS, alone, shared_with_adapters, toy_tokenizer
from tests.worker.multi.test_resident_jobs import Recorder, _adapter

CPU = torch.device("cpu")


class Letters:
    """An in-process stand-in of worker/toy/two_turn.py's environment that logs every call it gets.

    Turn 1 asks for a letter (reward 0.25 if it is one of a-f); turn 2 shows the row's word, reward 1 for its
    last letter. `fail_at`: the step call (1-based, over the environment's life) that raises instead."""

    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple[str, list]] = []
        self.words: dict[str, str] = {}
        self.turn: Counter = Counter()
        self.fail_at = fail_at

    def reset(self, episodes):
        self.calls.append(("reset", [(eid, seed) for eid, seed, _row in episodes]))
        out = []
        for eid, _seed, row in episodes:
            assert eid not in self.words, f"episode {eid} reset twice"
            self.words[eid] = row["prompt"].rstrip("=")
            out.append(Outcome(observation="letter?"))
        return out

    def step(self, actions):
        self.calls.append(("step", list(actions)))
        if self.fail_at is not None and sum(kind == "step" for kind, _ in self.calls) == self.fail_at:
            raise RuntimeError("the environment broke")
        out = []
        for eid, action in actions:
            self.turn[eid] += 1
            if self.turn[eid] == 1:
                out.append(Outcome(observation=f"{self.words[eid]}=", reward=0.25 * (action.strip()[:1] in "abcdef")))
            else:
                out.append(Outcome(reward=float(action.strip() == self.words[eid][-1]), terminated=True))
        return out

    def release(self, ids):
        self.calls.append(("release", list(ids)))

    def close(self):
        pass

    def shape(self) -> list[tuple[str, list]]:
        """The calls without the episode ids (a run's uuid tag): what was asked, in order."""
        return [(kind, [x[1:] if isinstance(x, tuple) else None for x in args]) for kind, args in self.calls]

    def assert_each_once(self):
        """Every episode reset once, stepped once per turn (at most two), released once."""
        resets = Counter(eid for kind, args in self.calls if kind == "reset" for eid, _ in args)
        steps = Counter(eid for kind, args in self.calls if kind == "step" for eid, _ in args)
        released = Counter(eid for kind, args in self.calls if kind == "release" for eid in args)
        assert set(resets.values()) == {1} and resets == released
        assert set(steps) <= set(resets) and set(steps.values()) <= {1, 2}
        for kind, args in self.calls:  # no episode twice in one call
            ids = [a[0] if isinstance(a, tuple) else a for a in args]
            assert len(ids) == len(set(ids)), kind


def _rows(toy_dir, start: int, n: int) -> list[dict]:
    lines = (toy_dir / "train.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[start : start + n]]


MULTI = SamplingSpec(temperature=1.0, max_output_tokens=3, max_model_len=64)
SINGLE = SamplingSpec(temperature=0.8, top_k=6, max_output_tokens=5, max_model_len=32)


@pytest.fixture(scope="module")
def shared(toy_dir) -> SharedBase:
    return shared_with_adapters(toy_dir, LORAS)


def _alone(toy_dir, shared, tokenizer, req: RolloutRequest, environment=None):
    policy = Policy(alone(toy_dir, shared, req.name).eval(), tokenizer, CPU)
    return generate(policy, req.rows, req.sampling, group_size=req.group_size, greedy=req.greedy,
                    sampler=TransformersSampler(policy, req.sampling), sampling_seeds=req.sampling_seeds,
                    environment=environment, max_turns=req.max_turns, seeds=req.seeds)


def _request(name, rows, sampling, group_size, k, environment=None):
    n = len(rows)
    return RolloutRequest(name, rows, sampling, group_size,
                          sampling_seeds=[stream_seed("sample", k, 0, p) for p in range(n)],
                          **({"environment": environment, "max_turns": 2, "seeds": [k * 10 + p for p in range(n)]}
                             if environment is not None else {}))


def test_environment_jobs_beside_a_single_turn_job_sample_what_they_sample_alone(toy_dir, tokenizer, shared):
    """Two environment jobs (different adapters and lengths) and a single-turn job in one shared rollout: each
    equals its own generate(), and each environment gets the very calls it gets alone."""
    envs = {"job-a": Letters(), "job-c": Letters()}
    requests = [_request("job-a", _rows(toy_dir, 0, 3), MULTI, 2, 1, envs["job-a"]),
                _request("job-b", _rows(toy_dir, 5, 2), SINGLE, 3, 2),
                _request("job-c", _rows(toy_dir, 9, 2), MULTI.model_copy(update={"max_output_tokens": 5}), 3, 3,
                         envs["job-c"])]
    together = generate_jobs(shared, tokenizer, CPU, requests)
    for req, got in zip(requests, together):
        assert not isinstance(got, Exception), got
        env = Letters() if req.environment is not None else None
        want = _alone(toy_dir, shared, tokenizer, req, env)
        assert got.token_ids == want.token_ids, req.name
        assert got.action_mask == want.action_mask and got.action_turns == want.action_turns
        assert got.turns == want.turns and got.turn_rewards == want.turn_rewards and got.errors == want.errors
        assert got.completions == want.completions and got.truncated == want.truncated
        if env is not None:
            assert req.environment.shape() == env.shape(), req.name  # the same calls, in the same order
            req.environment.assert_each_once()
            assert max(got.turns) == 2  # some episodes really took a second turn, decoded after job-b was done
    assert len(together[1]) == 6 and set(together[1].turns) == {1}


def test_an_environment_that_fails_fails_its_own_job_only(toy_dir, tokenizer, shared):
    broken = Letters(fail_at=1)
    requests = [_request("job-a", _rows(toy_dir, 0, 2), MULTI, 2, 1, broken),
                _request("job-b", _rows(toy_dir, 5, 2), SINGLE, 2, 2),
                _request("job-d", _rows(toy_dir, 3, 2), MULTI, 2, 4, Letters())]
    together = generate_jobs(shared, tokenizer, CPU, requests)
    assert isinstance(together[0], RuntimeError) and "broke" in str(together[0])
    assert [kind for kind, _ in broken.calls] == ["reset", "step"]  # never called again
    for req, got in zip(requests[1:], together[1:]):
        env = Letters() if req.environment is not None else None
        assert got.token_ids == _alone(toy_dir, shared, tokenizer, req, env).token_ids


# -- whole jobs -------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_model(toy_dir, tmp_path_factory):
    """The toy model with a chat template that renders only the contents (worker/toy/two_turn.py)."""
    return plain_chat_model(toy_dir / "model", tmp_path_factory.mktemp("plain") / "model")


def _environment_spec(toy_dir, model, **training) -> JobSpec:
    return job_spec(toy_spec(toy_dir), reward=None, model=str(model), seed=5,
                    environment=environment_spec(),  # its stand-in (Letters) is what runs
                    optimizer={"lr": 5e-3}, sampling={"temperature": 1.0, "max_output_tokens": 3, "max_model_len": 64},
                    training={"steps": 3, "batch_size": 2, "group_size": 4, "mini_batches": 2, "micro_batch_size": 4,
                              "eval_interval": 2, "eval_max_rows": 3, "checkpoint_interval": 2, "preflight_groups": 1,
                              "max_turns": 2, **training})


def _single_turn_spec(toy_dir, model) -> JobSpec:
    return job_spec(toy_spec(toy_dir), model=str(model), optimizer={"lr": 3e-3},
                    lora={"r": 4, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
                    training={"steps": 2, "batch_size": 2, "group_size": 2, "mini_batches": 1, "micro_batch_size": 4,
                              "eval_interval": 0, "eval_max_rows": 2, "checkpoint_interval": 0, "preflight_groups": 0})


def test_an_environment_job_beside_a_single_turn_job_ends_where_it_ends_alone(toy_dir, plain_model, tmp_path):
    spec, other = _environment_spec(toy_dir, plain_model), _single_turn_spec(toy_dir, plain_model)
    shared = SharedBase(AutoModelForCausalLM.from_pretrained(plain_model, dtype=torch.float32))
    tokenizer = toy_tokenizer(plain_model.parent)
    env = Letters()
    jobs = [ResidentJob(spec, tmp_path / "shared-env", shared, tokenizer, CPU, name="env", environment=env,
                        callbacks=Recorder()),
            ResidentJob(other, tmp_path / "shared-single", shared, tokenizer, CPU, name="single",
                        reward_fn=toy_reward, callbacks=Recorder())]
    start = {k: v.clone() for k, v in shared.adapter_state("env").items()}
    for job in jobs:
        job.start()
    while live := [job for job in jobs if not job.done]:
        assert run_cycle(shared, live, device=CPU) == {}
    env.assert_each_once()

    mine = jobs[0].callbacks
    alone_env, alone = Letters(), Recorder()
    result = Trainer(spec, tmp_path / "alone", environment=alone_env).run(alone)
    # The same calls in the same order: evaluations and steps exactly; the pre-flight (its first episodes) with
    # the same resets, its samples drawn from torch's global RNG, which resident jobs share (worker/multi/job.py).
    preflight = [kind for kind, _ in env.calls].index("release") + 1
    assert env.shape()[:1] == alone_env.shape()[:1]
    assert [kind for kind, _ in env.calls[:preflight]] == [kind for kind, _ in alone_env.calls[:preflight]]
    assert env.shape()[preflight:] == alone_env.shape()[preflight:]
    assert [s for s, _ in mine.steps] == [s for s, _ in alone.steps] == [1, 2, 3]
    for (_, got), (_, want) in zip(mine.steps, alone.steps):
        for key in ("reward_mean", "completion_length_mean", "turns_mean", "truncated_fraction"):
            assert got[key] == want[key], key
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7)
    assert max(m["turns_mean"] for _, m in mine.steps) > 1  # episodes of two turns were trained on
    assert [(s, m["eval_reward_mean"]) for s, m in mine.evals] == [(s, m["eval_reward_mean"]) for s, m in alone.evals]
    got, want = _adapter(jobs[0].last_checkpoint), _adapter(result.last_checkpoint)
    diff = max(float((got[k] - want[k]).abs().max()) for k in got)
    print(f"environment job: max |shared - alone| = {diff:.2e}")
    assert diff <= 1e-3 * spec.optimizer.lr * spec.training.steps * spec.training.mini_batches
    assert max(float((got[k] - start[k]).abs().max()) for k in got) > 100 * diff + 1e-5  # it trained
