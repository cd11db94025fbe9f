"""Asynchronous CISPO's policy versions on the tiny model: what the sampler process samples with is exactly what the
trainer sent (LoRA adapter or every weight), environment episodes in the sampler, the two processes split the
cores, and the toy task still learns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from service.job_spec.spec import JobSpec
from tests.specs import job_spec
from service.sandbox.spawn import sandbox_level
from tests.worker.rollout.test_multi_turn import Scripted
from tests.worker.trainer.learning import learning_gains
from tests.worker.trainer.test_async_rollouts import Recorder, assert_gone, async_spec, sampler_children  # noqa: F401
from worker.rollout.async_sampler import SamplerProcess
from worker.rollout.policy_versions import trainable_state
from worker.rollout.thread_split import split_threads
from worker.toy.__main__ import toy_spec
from worker.toy.two_turn import environment_spec, plain_chat_model
from worker.trainer.loop import Trainer, train
from worker.model.policy import load_policy
from worker.trainer.update import Updater


def test_split_threads_gives_each_process_its_share():
    assert split_threads(2) == (1, 1)  # this machine: one core each
    assert split_threads(1) == (1, 1)  # never zero threads
    assert split_threads(3) == (2, 1)
    assert split_threads(16) == (8, 8)


def full_or_lora_spec(toy_dir: Path, tuning: str, **training) -> JobSpec:
    spec = async_spec(toy_dir, 1, "fixed_lag", **training)
    return spec if tuning == "lora" else job_spec(spec.model_dump(mode="json"), lora=None)


def next_batch(sampler: SamplerProcess):
    while True:
        message = sampler.receive(timeout=5.0)
        if message is not None and message[0] == "batch":
            return message


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_the_sampler_samples_with_each_published_version(toy_dir, tuning):
    """Versions of far-apart weights are published in turn: the sampler's log-probs of its own samples are the
    trainer's under the same weights (to float rounding), so every trainable tensor, the whole model under full
    fine-tuning, reached it. Sent and not loaded, they would differ by whole nats."""
    assert_sampler_follows_versions(full_or_lora_spec(toy_dir, tuning), toy_dir, tuning)


def assert_sampler_follows_versions(spec: JobSpec, toy_dir: Path, tuning: str, atol: float = 1e-4) -> None:
    """Publish 3 versions of far-apart weights; each batch's sampler log-probs are the trainer's under them."""
    policy = load_policy(spec, resume_from=None, warm_start=None)
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    if tuning == "full":
        assert sum(p.numel() for p in trainable) == sum(p.numel() for p in policy.model.parameters())
    updater = Updater(policy, torch.optim.SGD(trainable, lr=0.0), spec)
    rows = [json.loads(line) for line in (toy_dir / "train.jsonl").read_text().splitlines()[:4]]
    generator = torch.Generator().manual_seed(0)

    def perturb() -> None:
        with torch.no_grad():
            for p in trainable:
                p.add_(torch.randn(p.shape, generator=generator) * (0.3 if tuning == "lora" else 0.05))

    perturb()
    sampler = SamplerProcess(spec, version=0, state=trainable_state(policy.model), threads=1)
    try:
        for step in range(3):
            if step:
                perturb()
                sampler.publish(step, trainable_state(policy.model))
            sampler.request(step, rows, [1, 2, 3, 4])
            _, got_step, version, rollout, *_ = next_batch(sampler)
            assert (got_step, version) == (step, step)
            indices = list(range(len(rollout)))
            trainer_logprobs = updater._frozen_logprobs(rollout, indices, reference=False)
            for i in indices:
                torch.testing.assert_close(torch.tensor(rollout.sampler_logprobs[i]), trainer_logprobs[i],
                                           atol=atol, rtol=0)
    finally:
        sampler.close()
    assert_gone(sampler.process)


def test_full_fine_tuning_runs_asynchronously_within_the_bound(toy_dir, tmp_path):
    spec = full_or_lora_spec(toy_dir, "full", steps=3)
    cb = Recorder()
    assert Trainer(spec, tmp_path).run(cb).steps_done == 3
    # Step 2's batch was requested with step 1's, before any update: sampled by version 0, one behind.
    assert cb.metrics[0]["policy_lag_max"] == 0 and cb.metrics[1]["policy_lag_max"] == 1
    assert all(m["policy_lag_max"] <= 1 for m in cb.metrics)
    assert all(m["stale_dropped"] == 0 and m["trained_tokens"] > 0 for m in cb.metrics)


def test_trainer_keeps_its_share_of_threads_while_the_sampler_runs(toy_dir, tmp_path, monkeypatch):
    # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op once it has bound its threads:
    # where a vLLM test ran before in this process (pytest-xdist), put torch's own back for this test.
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    threads = torch.get_num_threads()
    seen = []

    class Threads(Recorder):
        def on_step(self, step, metrics):
            super().on_step(step, metrics)
            seen.append(torch.get_num_threads())

    try:
        torch.set_num_threads(2)
        Trainer(async_spec(toy_dir, 1, steps=2), tmp_path).run(Threads())
        assert seen == [1, 1] and torch.get_num_threads() == 2  # given back when the run ends
    finally:
        torch.set_num_threads(threads)


def environment_job(toy_dir: Path, model: Path, max_staleness: int) -> JobSpec:
    raw = toy_spec(toy_dir)
    raw.pop("reward")
    raw["model"] = str(model)
    raw["environment"] = environment_spec()
    raw["sampling"] = {"temperature": 1.0, "max_output_tokens": 2, "max_model_len": 64}
    raw["rollout"] = {"max_staleness": max_staleness, "version_policy": "fixed_lag"}  # step 1 by version 0
    raw["training"].update({"steps": 2, "batch_size": 2, "group_size": 4, "mini_batches": 2, "micro_batch_size": 8,
                            "eval_interval": 0, "eval_max_rows": 2, "checkpoint_interval": 0, "max_turns": 2,
                            "preflight_groups": 0})
    return JobSpec.model_validate(raw)


@pytest.mark.skipif(sandbox_level() != "namespaces", reason="this host cannot sandbox user code")
def test_environment_episodes_run_in_the_sampler_process(toy_dir, tmp_path, sampler_children):
    """A sandboxed two-turn environment job at max_staleness 1: the sampler process runs the episodes against its
    own environment, with the synchronous loop's seeds, so step 1 (version 0 on both sides) is the same batch."""
    started, taken = sampler_children
    model = plain_chat_model(toy_dir / "model", tmp_path / "model")
    runs = {}
    for s in (0, 1):
        cb = Recorder()
        assert Trainer(environment_job(toy_dir, model, s), tmp_path / f"run{s}").run(cb).steps_done == 2
        runs[s] = cb.metrics
    assert len(started) == 1
    assert_gone(started[0])
    assert [step for step, _ in taken] == [0, 1] and all(v == [0] * 8 for _, v in taken)
    for m in runs[1]:
        assert m["turns_mean"] == 2 and m["reward_errors"] == 0
    for key in ("reward_mean", "completion_length_mean", "turns_mean"):
        assert runs[1][0][key] == runs[0][0][key]


def test_a_stand_in_environment_is_refused_asynchronously(toy_dir, tmp_path):
    """An in-process environment object cannot cross into the sampler process: refused, not silently dropped."""
    with pytest.raises(ValueError, match="stand-in environment"):
        Trainer(async_spec(toy_dir, 1), tmp_path, environment=Scripted(lambda turn, action, row: None)).run(Recorder())


@pytest.mark.slow
def test_cispo_learns_the_toy_task_with_stale_rollouts(toy_dir, tmp_path):
    """test_trainer.py's learning test at max_staleness 1 (most batches sampled one version behind) with the spec's
    defaults, which give a stale job the off-policy sequence mask (STALE_BATCH_MASK), over 3 seeds.

    Measured (bench/async_learning.py, bench/README.md): seeds 1-3 gained eval +0.42, +0.75, +0.75 (synchronous
    +0.41, +0.41, +0.75). Without the mask seed 0 collapsed (train reward 0.01 within 5 steps, entropy to ln V), and
    seeds 1-5 gained -0.25..+0.75, a mean below this test's threshold."""
    gains, eval_gains = [], []
    for seed in (0, 1, 2):
        spec = JobSpec.model_validate({**toy_spec(toy_dir), "seed": seed, "rollout": {"max_staleness": 1}})
        rewards = []

        class Collect(Recorder):
            def on_step(self, step, metrics):
                rewards.append(metrics["reward_mean"])
                assert metrics["policy_lag_max"] <= 1

        result = train(spec, tmp_path / str(seed), callbacks=Collect())
        gain, eval_gain = learning_gains(f"seed {seed}", rewards, result)
        gains.append(gain)
        eval_gains.append(eval_gain)
    assert sum(gains) / 3 > 0.08
    assert sum(eval_gains) / 3 >= 0.3


@pytest.mark.parametrize("policy, served, loaded", [("fixed_lag", [(1, 0), (2, 1)], [1, 2]),
                                                    ("newest", [(1, 2), (2, 2)], [2])])
def test_the_version_policy_decides_which_version_samples_a_request(toy_dir, monkeypatch, policy, served, loaded):
    """What a slow-to-wake sampler finds in its inbox (the race a loaded machine makes): the request of step 1
    (sent after version 0), version 1, the request of step 2, version 2. 'fixed_lag' samples each request with
    the version sent before it, whatever else is already queued, so timing changes nothing; 'newest' samples both
    with version 2, the newest it holds."""
    import queue
    import threading

    import worker.rollout.rollout as rollout_module
    from worker.rollout.async_sampler import _serve_with

    class Loads:
        policy, sample = None, None

        def __init__(self):
            self.loaded = []

        def load(self, state):
            self.loaded.append(state["v"])

    monkeypatch.setattr(rollout_module, "generate", lambda *args, **kwargs: "rollout")
    spec = async_spec(toy_dir, 1, policy)
    inbox, outbox, sampler = queue.Queue(), queue.Queue(), Loads()
    for message in [("request", 1, [], [], []), ("version", 1, {"v": 1}), ("request", 2, [], [], []),
                    ("version", 2, {"v": 2})]:
        inbox.put(message)
    batches = []

    def stop_after_two():
        batches.extend(outbox.get(timeout=30) for _ in range(2))
        inbox.put(("stop",))

    stopper = threading.Thread(target=stop_after_two)
    stopper.start()
    _serve_with(sampler, spec, 0, inbox, outbox, 1, None)
    stopper.join()
    assert [(b[1], b[2]) for b in batches] == served
    assert sampler.loaded == loaded  # 'newest' never loads version 1: version 2 was already there


def test_the_version_policy_is_newest_unless_asked():
    from service.job_spec.sampling import RolloutSpec

    assert RolloutSpec().version_policy == "newest"
    with pytest.raises(ValueError, match="version_policy"):
        RolloutSpec(version_policy="oldest")


def test_the_pass_rate_filter_retires_the_prompts_of_the_batch_trained_not_of_one_drawn_ahead(toy_dir, tmp_path,
                                                                                             monkeypatch):
    """Asynchronously the prompts of the next max_staleness steps are drawn before a step ends; the step's rewards
    retire its own batch's prompts. Rows answered 'a' always pass, the others never, so only 'a' rows retire."""
    from tests.worker.trainer.test_recipe_knobs import ROWS, solved_or_partial
    from worker.trainer.data import PromptSampler

    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    spec = async_spec(toy_dir, 1, "fixed_lag", steps=3, batch_size=4, pass_rate_filter={"threshold": 0.9})
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"train_file": str(train_file)})})
    draws: list[list[int]] = []
    real = PromptSampler.next_batch

    def drawing(self, size):
        rows = real(self, size)
        draws.append(list(self.last_indices))
        return rows

    monkeypatch.setattr(PromptSampler, "next_batch", drawing)
    trainer = Trainer(spec, tmp_path / "out", reward_fn=solved_or_partial)
    trainer.run(Recorder())
    trained = {i for batch in draws[:3] for i in batch}  # a fourth draw is the end's (none with 3 steps)
    assert {ROWS[i]["answer"] for i in trainer.sampler.retired} == {"a"}
    assert trainer.sampler.retired == {i for i in trained if ROWS[i]["answer"] == "a"}
