"""Whole jobs resident on one base, advanced by cycles, end where each job alone ends (worker/trainer/loop.py).

The toy task, two to three cycles; the jobs differ in seed, LoRA rank and targets, learning rate, group size and
reward. The bound is the batched update's (tests/worker/multi/test_batched_update.py): 1e-3 * lr per optimizer step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from service.job_spec.spec import JobSpec, LoraSpec
from tests.specs import job_spec
from worker.checkpoints.checkpoint import save_checkpoint
from worker.multi.cycle import run_cycle, start_jobs
from worker.multi.job import ResidentJob
from worker.multi.lora import SharedBase
from worker.toy.__main__ import toy_spec
from worker.toy.task import reward as toy_reward
from worker.trainer.loop import Trainer

from tests.worker.multi.conftest import alone, record_sampled, shared_with_adapters, toy_base

CPU = torch.device("cpu")


def resident_spec(toy_dir, *, seed=0, lr=3e-3, lora=None, rollout=None, **training) -> JobSpec:
    return job_spec(toy_spec(toy_dir), seed=seed, optimizer={"lr": lr}, lora=lora or {}, rollout=rollout or {},
                    training={"steps": 3, "batch_size": 2, "group_size": 4, "mini_batches": 2, "micro_batch_size": 4,
                              "eval_interval": 2, "eval_max_rows": 4, "checkpoint_interval": 2, "preflight_groups": 1,
                              **training})


def _early_letters(completion: str, answer: str, **_row) -> float:
    return float(completion.strip()[:1] in ("a", "b", "c"))  # another reward: a completion starting with a-c


def _adapter(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))


class Recorder:
    def __init__(self):
        self.steps, self.evals, self.checkpoints, self.stop = [], [], [], False

    def on_step(self, step, metrics):
        self.steps.append((step, metrics))

    def on_eval(self, step, metrics):
        self.evals.append((step, metrics))

    def on_checkpoint(self, step, path):
        self.checkpoints.append((step, path))

    def should_stop(self):
        return self.stop


def test_jobs_on_one_base_end_where_each_ends_alone(toy_dir, tokenizer, tmp_path):
    specs = {
        "job-a": (resident_spec(toy_dir), toy_reward),
        "job-b": (resident_spec(toy_dir, seed=7, lr=1e-2,
                                lora={"r": 4, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
                                group_size=2, mini_batches=1), _early_letters),
        "job-c": (resident_spec(toy_dir, seed=3, steps=2), toy_reward),
    }
    shared = SharedBase(toy_base(toy_dir))
    jobs = {name: ResidentJob(spec, tmp_path / f"shared-{name}", shared, tokenizer, CPU, name=name, reward_fn=fn,
                              callbacks=Recorder()) for name, (spec, fn) in specs.items()}
    start = {name: {k: v.clone() for k, v in shared.adapter_state(name).items()} for name in jobs}
    assert start_jobs(shared, list(jobs.values()), device=CPU) == {}
    while live := [job for job in jobs.values() if not job.done]:
        assert run_cycle(shared, live, device=CPU) == {}
    for name, (spec, fn) in specs.items():
        alone = Recorder()
        result = Trainer(spec, tmp_path / f"alone-{name}", reward_fn=fn).run(alone)
        mine = jobs[name].callbacks
        assert [s for s, _ in mine.steps] == [s for s, _ in alone.steps] == list(range(1, spec.training.steps + 1))
        for (_, got), (_, want) in zip(mine.steps, alone.steps):
            assert got["reward_mean"] == want["reward_mean"], name  # the same samples, scored the same
            assert got["completion_length_mean"] == want["completion_length_mean"], name
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7), name
        assert [s for s, _ in mine.evals] == [s for s, _ in alone.evals]
        for (_, got), (_, want) in zip(mine.evals, alone.evals):
            assert got["eval_reward_mean"] == want["eval_reward_mean"], name
        # the same files (a job moves between kinds of worker; a user downloads the same thing from either)
        assert sorted(p.name for p in (jobs[name].last_checkpoint / "adapter").iterdir()) == \
            sorted(p.name for p in (result.last_checkpoint / "adapter").iterdir()) == \
            ["adapter_config.json", "adapter_model.safetensors"]
        got, want = _adapter(jobs[name].last_checkpoint), _adapter(result.last_checkpoint)
        assert set(got) == set(want)
        diff = max(float((got[k] - want[k]).abs().max()) for k in got)
        steps = spec.training.steps * spec.training.mini_batches
        print(f"job {name}: max |shared - alone| = {diff:.2e}")
        assert diff <= 1e-3 * spec.optimizer.lr * steps, name
        travelled = max(float((got[k] - start[name][k]).abs().max()) for k in got)
        assert travelled > 100 * diff + 1e-5, name  # it trained


def test_a_resident_job_resumes_from_its_checkpoint_like_a_job_alone(toy_dir, tokenizer, tmp_path):
    """A shared worker's checkpoint is an ordinary one: a job alone resumes from it (and so a job moves between
    kinds of worker), reaching the uninterrupted run's adapter."""
    spec = resident_spec(toy_dir, steps=3, checkpoint_interval=1, preflight_groups=0)
    shared = SharedBase(toy_base(toy_dir))
    job = ResidentJob(spec, tmp_path / "run", shared, tokenizer, CPU, name="x", reward_fn=toy_reward,
                      callbacks=Recorder())
    job.start()
    assert run_cycle(shared, [job], device=CPU) == {}
    job.close()
    assert "x" not in shared.specs
    resumed = Trainer(spec, tmp_path / "run", reward_fn=toy_reward).run(Recorder())
    whole = Trainer(spec, tmp_path / "whole", reward_fn=toy_reward).run(Recorder())
    got, want = _adapter(resumed.last_checkpoint), _adapter(whole.last_checkpoint)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) <= 1e-3 * spec.optimizer.lr * 6


def test_due_evaluations_of_resident_jobs_are_decoded_together(toy_dir, tokenizer, tmp_path, monkeypatch):
    """Jobs starting together, and jobs whose evaluation falls due at the same step, decode their evaluation rows
    in one shared decode (as their rollouts), not one decode a job; each job's evaluation reports what it reports
    alone (the first test checks the same against jobs alone). A job due on its own decodes its own."""
    from worker.multi import rollout as shared_rollout

    decodes: list[list[tuple[str, int, bool]]] = []  # per shared decode: (job, rows, greedy) of each job in it
    real = shared_rollout.sample_jobs

    def counted(model, router, jobs, **kwargs):
        decodes.append([(job.name, len(job.prompts), job.greedy) for job in jobs])
        return real(model, router, jobs, **kwargs)

    monkeypatch.setattr(shared_rollout, "sample_jobs", counted)
    specs = {"x": resident_spec(toy_dir, steps=2, eval_interval=1, preflight_groups=0),
             "y": resident_spec(toy_dir, seed=5, steps=2, eval_interval=1, preflight_groups=0),
             "z": resident_spec(toy_dir, seed=9, steps=2, eval_interval=2, checkpoint_interval=0, preflight_groups=0)}
    shared = SharedBase(toy_base(toy_dir))
    jobs = {name: ResidentJob(spec, tmp_path / name, shared, tokenizer, CPU, name=name, reward_fn=toy_reward,
                              callbacks=Recorder()) for name, spec in specs.items()}
    assert start_jobs(shared, list(jobs.values()), device=CPU) == {}
    assert decodes == [[("x", 4, True), ("y", 4, True), ("z", 4, True)]]  # three step-0 evaluations, one decode
    decodes.clear()
    assert run_cycle(shared, list(jobs.values()), device=CPU) == {}
    # step 1: one rollout of the three, then x and y (eval_interval 1) evaluate together; z is not due;
    # step 2 (the last): every job evaluates, in one decode
    assert [[(name, greedy) for name, _, greedy in d] for d in decodes] == [
        [("x", False), ("y", False), ("z", False)], [("x", True), ("y", True)]]
    assert [s for s, _ in jobs["z"].callbacks.evals] == [0]
    decodes.clear()
    assert run_cycle(shared, list(jobs.values()), device=CPU) == {}
    assert [[name for name, _, _ in d] for d in decodes] == [["x", "y", "z"], ["x", "y", "z"]]
    for name, job in jobs.items():
        assert [s for s, _ in job.callbacks.evals] == ([0, 1, 2] if name != "z" else [0, 2])
        assert job.engine.prepared is None  # each evaluation took what was decoded for it
        assert all(m["eval_rows"] == 4.0 for _, m in job.callbacks.evals)


def test_a_prepared_evaluation_answers_only_its_own_call(toy_dir, tokenizer, tmp_path):
    """What decode_evaluations leaves in a job's engine answers that evaluation's call once; any other call (a
    pre-flight, other rows) decodes afresh and leaves it waiting; the job's next step drops it (new weights)."""
    from worker.multi.engine import decode_evaluations

    shared = SharedBase(toy_base(toy_dir))
    jobs = [ResidentJob(resident_spec(toy_dir, seed=s, preflight_groups=0), tmp_path / f"j{s}", shared, tokenizer, CPU,
                        name=f"j{s}", reward_fn=toy_reward, callbacks=Recorder()) for s in (1, 2)]
    decode_evaluations(shared, tokenizer, CPU, jobs)
    job = jobs[0]
    request, prepared = job.engine.prepared
    together = list(prepared.completions)
    other = job.engine.generate(job.policy, request.rows[:2], request.sampling, group_size=1, greedy=True)
    assert other is not prepared and len(other) == 2 and job.engine.prepared[1] is prepared
    assert job.engine.generate(job.policy, list(request.rows), request.sampling, group_size=1,
                               greedy=True) is prepared
    assert job.engine.prepared is None
    decode_evaluations(shared, tokenizer, CPU, jobs)
    jobs[1].begin_step()
    assert jobs[1].engine.prepared is None
    assert jobs[0].eval_rows(jobs[0].eval_source_rows()).completions == together  # took the prepared one
    assert jobs[0].engine.prepared is None
    alone = jobs[0].eval_rows(jobs[0].eval_source_rows())  # nothing prepared: decoded alone
    assert alone.completions == together and len(alone.rewards) == 4  # beside another job's rows, the same


def _continued(toy_dir, tmp_path) -> dict:
    """Continuing an `ft:` model: init_from its checkpoint (an adapter far from zero, pinned as the reference), with
    a KL term to that reference. Its B is a tenth of shared_with_adapters' so that the policy still earns the toy
    reward now and then: with no reward signal the first step's only gradient is the KL term's at policy ==
    reference, rounding noise that Adam (eps 1e-15) turns into steps of lr, differently on each CPU's kernels."""
    shared = shared_with_adapters(toy_dir, {"warm": LoraSpec(r=4, alpha=8, target_modules="all-linear")})
    with torch.no_grad():
        for n, p in shared.model.named_parameters():
            if "lora_B.warm." in n:
                p.mul_(0.1)
    path = save_checkpoint(tmp_path / "warm", model=alone(toy_dir, shared, "warm"), optimizer=None, state={"step": 0})
    return {"init_from": str(path), "loss": {"kl_beta": 0.1}}


def _supervised(toy_dir, tmp_path) -> dict:
    """Supervised fine-tuning on the toy task's rows as conversations (the reward scores its evaluations)."""
    for split in ("train", "val"):
        rows = [json.loads(line) for line in (toy_dir / f"{split}.jsonl").read_text().splitlines()]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({**row, "messages": [
            {"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["answer"]}]}) + "\n"
            for row in rows))
    return {"method": "supervised", "data": {"train_file": str(tmp_path / "train.jsonl"),
                                             "validation_file": str(tmp_path / "val.jsonl")}}


# A job option each: the spec sections that set it (given toy_dir and a scratch directory).
OPTIONS = {
    "gradient_checkpointing": lambda toy_dir, tmp_path: {"training": {"gradient_checkpointing": True}},
    "pack_tokens": lambda toy_dir, tmp_path: {"training": {"pack_tokens": 48}},  # two to three sequences a row
    # In float32 the head is float32 anyway (a bfloat16 base is no test: Adam turns its rounding into steps of lr
    # wherever a gradient is near zero); test_shared_base.py checks the head's float32 rows on a bfloat16 base.
    "lm_head_float32": lambda toy_dir, tmp_path: {"training": {"lm_head_float32": True}},
    "init_from": _continued,
    "supervised": _supervised,
    # Asynchronous sampling: step j samples with the adapter after max(0, j - 1) steps (a stale sampling copy on the
    # shared base; alone, the sampler process); three steps, so that one samples a version other than the first.
    "async": lambda toy_dir, tmp_path: {"rollout": {"max_staleness": 1, "version_policy": "fixed_lag"},
                                        "training": {"steps": 3}},
    # Sampling in bfloat16 while training in float32: its rows decode on bfloat16 copies of the base's weights (its
    # adapter float32 on them), the sampler's log-probs reported for the update's TIS, as alone. Its neighbours
    # sample in bfloat16 too: jobs share a base only with jobs of their rollout.dtype (support.py's base_key).
    "rollout_dtype": lambda toy_dir, tmp_path: {"rollout": {"dtype": "bfloat16"}},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_job_with_an_option_trains_beside_three_jobs_as_it_trains_alone(toy_dir, tokenizer, tmp_path, monkeypatch,
                                                                         option):
    """The job samples the same tokens at every step and ends with the same adapter (the batched update's bound)
    alone and resident beside three plain jobs of other seeds, LoRA shapes and learning rates, which it shares every
    sampling and update batch with."""
    sampled, sampler = record_sampled(monkeypatch)
    small = {"steps": 2, "batch_size": 2, "group_size": 3, "mini_batches": 2, "micro_batch_size": 2,
             "eval_max_rows": 2, "eval_interval": 0, "checkpoint_interval": 0, "preflight_groups": 0}
    sections = OPTIONS[option](toy_dir, tmp_path)
    spec = job_spec(toy_spec(toy_dir), seed=8, lora={"r": 4, "alpha": 8}, optimizer={"lr": 1e-2},
                    **{**sections, "training": {**small, **sections.get("training", {})}})
    rollout = {"dtype": d} if (d := sections.get("rollout", {}).get("dtype")) else None  # its base's (base_key)
    neighbours = [resident_spec(toy_dir, seed=s, lr=lr, lora=lora, rollout=rollout, **{**small, "group_size": g})
                  for s, lr, lora, g in [(1, 3e-3, None, 2), (2, 5e-3, {"r": 2, "target_modules": ["q_proj"]}, 3),
                                         (3, 1e-2, {"r": 8, "alpha": 4}, 2)]]
    shared = SharedBase(toy_base(toy_dir))
    jobs = [ResidentJob(s, tmp_path / f"shared-{k}", shared, tokenizer, CPU, name=f"job-{k}", reward_fn=toy_reward,
                        callbacks=Recorder()) for k, s in enumerate([spec, *neighbours])]
    assert start_jobs(shared, jobs, device=CPU) == {}
    while live := [job for job in jobs if not job.done]:
        assert run_cycle(shared, live, device=CPU) == {}
    first = jobs[0].callbacks.steps[0][1]
    assert first.get("zero_advantage_group_fraction", 0.0) < 1.0, first  # a reward signal, not only rounding
    for job in jobs:  # the job with the option, and its neighbours beside it
        alone, record = Trainer(job.spec, tmp_path / f"alone-{job.name}", reward_fn=toy_reward), Recorder()
        result = alone.run(record)
        assert sampled.get(job) == sampled.get(alone), job.name  # the same tokens, step by step
        # in the same precision (a bfloat16 sampler's log-probs are a bfloat16 decode's, not float32's)
        assert (job in sampler) == (alone in sampler), job.name
        if alone in sampler:
            gap = max(abs(a - b) for a, b in zip(sampler[job], sampler[alone], strict=True))
            print(f"{option}, {job.name}: max |sampler log-prob shared - alone| = {gap:.2e}")
            assert gap <= 1e-5, job.name
        for (_, got), (_, want) in zip(job.callbacks.steps, record.steps, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7), job.name
        for (_, got), (_, want) in zip(job.callbacks.evals, record.evals, strict=True):
            assert got == pytest.approx(want, rel=1e-4, abs=1e-7), job.name
        mine, theirs = job.last_checkpoint, result.last_checkpoint
        assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")) == \
            sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*"))  # the same files (a reference)
        if (theirs / "reference").is_dir():
            assert (mine / "reference" / "adapter_model.safetensors").read_bytes() == \
                (theirs / "reference" / "adapter_model.safetensors").read_bytes()
        got, want = _adapter(mine), _adapter(theirs)
        assert set(got) == set(want)
        diff = max(float((got[k] - want[k]).abs().max()) for k in got)
        bound = 1e-3 * job.spec.optimizer.lr * _optimizer_steps(job.spec)
        print(f"{option}, {job.name}: max |shared - alone| = {diff:.2e} (bound {bound:.2e})")
        assert diff <= bound, job.name
    assert spec.method == "supervised" or len(sampled[jobs[0]]) == spec.training.steps
    got = _adapter(jobs[0].last_checkpoint)
    start = _adapter(Path(spec.init_from)) if spec.init_from else {k: torch.zeros_like(v) for k, v in got.items()}
    bound = 1e-3 * spec.optimizer.lr * _optimizer_steps(spec)
    assert max(float((got[k] - start[k]).abs().max()) for k in got if "lora_B" in k) > 100 * bound  # it trained


def _optimizer_steps(spec: JobSpec) -> int:
    return spec.training.steps * (1 if spec.method == "supervised" else spec.training.updates_per_rollout)
