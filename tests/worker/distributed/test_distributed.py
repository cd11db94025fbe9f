"""FSDP2 on gloo: two processes match one, and checkpoints move between world sizes.

Two CPU processes (torch.multiprocessing, gloo) run one CISPO optimizer step
on the halves of a fixed batch; one process runs it on the whole batch. Loss,
gradients and updated weights must agree, for LoRA and full fine-tuning,
including a rank with fewer micro-batches than the other (it joins FSDP's
collectives with a zero-weighted pass) and a KL term (the reference policy
runs unsharded); also packed (training.pack_tokens) at 2 processes against
padded at 1. Checkpoints hold whole tensors: one saved at 2 processes
reloads at 1 and saves back identically, and the reverse. A whole job run by
`cispo train` at 2 processes samples and learns what it does at 1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from safetensors.torch import load_file, save_file

from service.job_spec.spec import JobSpec
from tests import specs
from worker.toy.__main__ import toy_spec
from worker.trainer.callbacks import NoCallbacks

ROOT = Path(__file__).resolve().parents[3]  # the checkout the subprocesses import
SEQUENCES = 8  # the global batch: 2 prompts x group 4
KINDS = ("lora", "full")


def job_spec(toy_dir: Path, kind: str, *, gpus: int = 1, dtype: str = "auto", **training) -> JobSpec:
    return specs.job_spec(toy_spec(toy_dir), dtype=dtype, lora={} if kind == "lora" else None, loss={"kl_beta": 0.1},
                          resources={"gpus": gpus},
                          training={"steps": 2, "batch_size": 2, "group_size": 4, "mini_batches": 1,
                                    "micro_batch_size": 2, "eval_interval": 0, "eval_max_rows": 4,
                                    "checkpoint_interval": 1, **training})


def fixed_batch():
    """SEQUENCES prompt+completion sequences of uneven lengths, with advantages (deterministic)."""
    from worker.rollout.rollout import Rollout

    g = torch.Generator().manual_seed(7)
    token_ids, masks = [], []
    for i in range(SEQUENCES):
        prompt, completion = 3 + i % 3, 2 + (5 * i) % 4
        token_ids.append(torch.randint(4, 30, (prompt + completion,), generator=g).tolist())
        masks.append([0] * prompt + [1] * completion)
    rollout = Rollout(rows=[{}] * SEQUENCES, token_ids=token_ids, action_mask=masks,
                      action_turns=[[0] * sum(m) for m in masks], prompt_lengths=[3 + i % 3 for i in range(SEQUENCES)],
                      completions=[""] * SEQUENCES, truncated=[False] * SEQUENCES, turns=[1] * SEQUENCES)
    advantages = torch.randn(SEQUENCES, generator=g)
    return rollout, advantages


def share(rollout, advantages, rank: int, world: int):
    """A rank's contiguous share of the batch, as the trainer splits it."""
    from worker.rollout.rollout import Rollout

    n = SEQUENCES // world
    part = slice(rank * n, (rank + 1) * n)
    fields = {k: getattr(rollout, k)[part] for k in
              ("rows", "token_ids", "action_mask", "action_turns", "prompt_lengths", "completions", "truncated", "turns")}
    return Rollout(**fields), advantages[part]


def one_update(spec: JobSpec, rank: int, world: int) -> dict[str, torch.Tensor]:
    """One optimizer step on this rank's share; returns (on rank 0) loss, whole gradients and weights."""
    from worker.distributed.state import full_model_state
    from worker.model.policy import load_policy
    from worker.trainer.update import Updater

    torch.manual_seed(0)
    policy = load_policy(spec, resume_from=None, warm_start=None)
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in policy.model.named_parameters()}

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    grads["grad." + names[id(p)]] = g.detach().clone()
            return super().step(closure)

    optimizer = Recording(policy.trainable_parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    rollout, advantages = share(*fixed_batch(), rank, world)
    # The last rank drops one of its sequences: fewer micro-batches there (2 a rank, 1 on the last).
    indices = list(range(len(rollout)))[: len(rollout) - (rank == world - 1 and world > 1)]
    if world == 1:
        indices = [i for i in indices if i != SEQUENCES - 1]
    stats = Updater(policy, optimizer, spec).run(rollout, advantages, indices)
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    state = full_model_state(policy.model) if world > 1 else policy.model.state_dict()
    weights = {"weight." + k: v for k, v in state.items() if k in trainable}
    return {**grads, **weights, "loss": torch.tensor(stats.step_losses), "grad_norm": torch.tensor(stats.grad_norms),
            "tokens": torch.tensor([stats.sums["tokens"]])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, task: str, args: dict) -> None:
    """One spawned rank: join a gloo group through the environment, as torchrun would set it up."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from worker.distributed import group

    group.init_from_env()
    try:
        TASKS[task](rank, world, **args)
    finally:
        torch.distributed.destroy_process_group()
    # The task succeeded: leave without the interpreter's teardown. gloo's threads outlive
    # destroy_process_group, and their C++ teardown at exit aborts now and then ("terminate called without an
    # active exception": ~1 in 10 runs of the asynchronous stop-and-resume test, old code and new); jobs
    # tolerate a rank dying in its teardown (test_a_rank_dying_in_its_teardown_does_not_lose_the_result), and
    # a test of what the ranks computed must not fail on it either.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(task: str, world: int = 2, **args) -> None:
    mp.start_processes(_rank_main, args=(world, _free_port(), task, args), nprocs=world, join=True,
                       start_method="spawn")


def _update_task(rank: int, world: int, toy_dir: str, out: str) -> None:
    for kind in KINDS:
        result = one_update(job_spec(Path(toy_dir), kind), rank, world)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in result.items()}, Path(out) / f"{kind}.safetensors")


def _resume_and_save_task(rank: int, world: int, runs: dict[str, str]) -> None:
    """Resume each run's newest checkpoint at this world size and save it again under saved-again/."""
    from worker.trainer.loop import Trainer

    for kind, run_dir in runs.items():
        trainer = Trainer(JobSpec.model_validate_json((Path(run_dir) / "spec.json").read_text()), Path(run_dir))
        trainer.checkpoint_root = Path(run_dir) / "saved-again"
        trainer.save()


def _bf16_update_task(rank: int, world: int, toy_dir: str, out: str) -> None:
    """bf16 compute with gradient checkpointing; records what each rank held before sharding."""
    from worker.model import policy as policy_module

    shard = policy_module.shard_model
    seen: list[dict] = []

    def recording_shard(model, device, dtype):
        tensors = [*model.parameters(), *model.buffers()]
        seen.append({"devices": sorted({str(t.device) for t in tensors}),
                     "materialized_bytes": sum(t.nbytes for t in tensors if not t.is_meta)})
        shard(model, device, dtype)
        seen[-1]["trainable_dtypes"] = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})

    policy_module.shard_model = recording_shard
    for kind in KINDS:
        seen.clear()
        result = one_update(job_spec(Path(toy_dir), kind, dtype="bfloat16", gradient_checkpointing=True), rank, world)
        (Path(out) / f"{kind}-rank{rank}.json").write_text(json.dumps(seen))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in result.items()}, Path(out) / f"{kind}.safetensors")


def async_job_spec(toy_dir: Path, kind: str, gpus: int = 1, **training) -> JobSpec:
    """job_spec at rollout.max_staleness 1: 3 steps, 4 prompts x 4, two optimizer steps each (KL term on). The
    'fixed_lag' version policy: batch j sampled by version max(0, j - 1) whatever the timing, so runs compare."""
    training = {"steps": 3, "batch_size": 4, "group_size": 4, "mini_batches": 2, "micro_batch_size": 4,
                "checkpoint_interval": 0, **training}
    return specs.job_spec(job_spec(toy_dir, kind, gpus=gpus, **training).model_dump(mode="json"),
                          rollout={"max_staleness": 1, "version_policy": "fixed_lag"})


def _async_task(rank: int, world: int, toy_dir: str, kind: str, out: str) -> None:
    """A max_staleness 1 job at this world size; records the version tag of every sequence this rank trained on
    and (rank 0) each step's metrics and the final trainable weights."""
    from worker.distributed.state import full_model_state
    from worker.trainer import rank_pipeline
    from worker.trainer.loop import Trainer

    taken = []
    real_take = rank_pipeline.RankPipeline.take

    def take(self, step):
        share = real_take(self, step)
        taken.append({"step": step, "versions": list(share.versions), "sequences": len(share.rollout)})
        return share

    rank_pipeline.RankPipeline.take = take
    calls = Recorder()
    try:
        trainer = Trainer(async_job_spec(Path(toy_dir), kind, gpus=world), Path(out) / "run")
        trainer.run(calls)
    finally:
        rank_pipeline.RankPipeline.take = real_take
    (Path(out) / f"taken-rank{rank}.json").write_text(json.dumps(taken))
    state = full_model_state(trainer.policy.model) if world > 1 else trainer.policy.model.state_dict()
    if rank == 0:
        trainable = {n for n, p in trainer.policy.model.named_parameters() if p.requires_grad}
        save_file({k: v.contiguous() for k, v in state.items() if k in trainable}, Path(out) / "weights.safetensors")
        (Path(out) / "metrics.json").write_text(json.dumps([m for _, m in calls.steps]))


def _packed_update_task(rank: int, world: int, toy_dir: str, out: str) -> None:
    for kind in KINDS:
        spec = job_spec(Path(toy_dir), kind)
        # 24 tokens (under the spec's floor, max_model_len 32): rank 0's four sequences (9, 8, 7, 5 tokens) take
        # two rows, rank 1's three (8, 7, 6) one
        spec = spec.model_copy(update={"training": spec.training.model_copy(update={"pack_tokens": 24})})
        result = one_update(spec, rank, world)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in result.items()}, Path(out) / f"{kind}.safetensors")


class StopAfter(NoCallbacks):
    """Callbacks that ask to stop (as a cancel or pause does) once `after` steps are done; every rank decides alike,
    as torchrun's ranks do with rank 0's answer (worker/torchrun/rank.py)."""

    def __init__(self, after: int | None = None):
        self.after, self.steps = after, []

    def on_step(self, step, metrics): self.steps.append(metrics)
    def should_stop(self): return self.after is not None and len(self.steps) >= self.after


def _async_stop_resume_task(rank: int, world: int, toy_dir: str, out: str) -> None:
    """A max_staleness 1 job of 4 steps at this world size, stopped after step 2 with the next batches in flight,
    then resumed from its checkpoint to the end. Records, per rank, each run's step, the version tag of every
    sequence trained on and whether rank 0's sampler process outlived the stop; rank 0 also the checkpoint's
    state, each step's metrics and the final trainable weights."""
    from tests.worker.trainer.test_async_rollouts import sampler_processes
    from worker.checkpoints.checkpoint import load_checkpoint
    from worker.distributed.state import full_model_state
    from worker.trainer import rank_pipeline
    from worker.trainer.loop import Trainer

    taken = []
    real_take = rank_pipeline.RankPipeline.take

    def take(self, step):
        share = real_take(self, step)
        taken.append({"step": step, "versions": list(share.versions)})
        return share

    rank_pipeline.RankPipeline.take = take
    spec = async_job_spec(Path(toy_dir), "lora", gpus=world, steps=4)
    record: dict = {}
    try:
        first, stop = Trainer(spec, Path(out) / "run"), StopAfter(2)
        stopped = first.run(stop)
        record["stopped"] = {"stopped": stopped.stopped, "steps_done": stopped.steps_done,
                             "samplers_left": len(sampler_processes())}
        # A resumed job is a new launch after every rank has ended, rank 0's checkpoint written (the others
        # return from save() before it is, and would otherwise look for it too soon).
        if world > 1:
            torch.distributed.barrier()
        resumed, rest = Trainer(spec, Path(out) / "run"), StopAfter()
        record["resumed_at"] = resumed.step
        finished = resumed.run(rest)
        record["finished"] = {"stopped": finished.stopped, "steps_done": finished.steps_done}
    finally:
        rank_pipeline.RankPipeline.take = real_take
    record["taken"] = taken
    (Path(out) / f"stop-resume-rank{rank}.json").write_text(json.dumps(record))
    state = full_model_state(resumed.policy.model) if world > 1 else resumed.policy.model.state_dict()
    if rank == 0:
        trainable = {n for n, p in resumed.policy.model.named_parameters() if p.requires_grad}
        save_file({k: v.contiguous() for k, v in state.items() if k in trainable}, Path(out) / "weights.safetensors")
        (Path(out) / "metrics.json").write_text(json.dumps(stop.steps + rest.steps))
        (Path(out) / "checkpoint-state.json").write_text(json.dumps(load_checkpoint(stopped.last_checkpoint).state))


TASKS = {"update": _update_task, "bf16_update": _bf16_update_task, "resume_and_save": _resume_and_save_task,
         "async": _async_task, "packed_update": _packed_update_task,
         "async_stop_resume": _async_stop_resume_task}


@pytest.fixture(scope="module")
def two_process_updates(toy_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2")
    spawn("update", toy_dir=str(toy_dir), out=str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_match_one(kind, toy_dir, two_process_updates):
    """Same loss, gradients and updated weights at 2 processes as at 1, on the same batch."""
    sharded = load_file(str(two_process_updates / f"{kind}.safetensors"))
    single = one_update(job_spec(toy_dir, kind), rank=0, world=1)
    assert sharded.keys() == single.keys()
    assert float(single["tokens"]) > 0 and single["loss"].abs().item() > 0
    assert any(k.startswith("grad.") for k in single)
    for name, expected in single.items():
        if name == "tokens":  # rank 0's own share; the update's normaliser is the global count
            continue
        if name.startswith("weight."):
            assert_same_adamw_step(sharded[name], expected, single["grad." + name.removeprefix("weight.")], name)
        else:
            torch.testing.assert_close(sharded[name], expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # The step moved the weights, so equal weights mean equal updates, not two untouched models.
    from worker.model.policy import load_policy

    torch.manual_seed(0)
    initial = load_policy(job_spec(toy_dir, kind), resume_from=None, warm_start=None).model.state_dict()
    assert max((single["weight." + k] - v).abs().max().item() for k, v in initial.items()
               if "weight." + k in single) > 1e-3


@pytest.mark.slow
def test_two_processes_packed_match_one_padded(toy_dir, tmp_path):
    """training.pack_tokens under FSDP2: each rank packs its own sequences (rank 1, one sequence short, runs
    fewer rows and joins with a zero-weighted pass); loss, gradients and weights are one padded process's."""
    spawn("packed_update", toy_dir=str(toy_dir), out=str(tmp_path))
    for kind in KINDS:
        sharded = load_file(str(tmp_path / f"{kind}.safetensors"))
        single = one_update(job_spec(toy_dir, kind), rank=0, world=1)
        assert sharded.keys() == single.keys()
        for name, expected in single.items():
            if name == "tokens":
                continue
            if name.startswith("weight."):
                assert_same_adamw_step(sharded[name], expected, single["grad." + name.removeprefix("weight.")], name)
            else:
                torch.testing.assert_close(sharded[name], expected, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{kind} {name}: {m}")


LR, EPS = 1e-2, 1e-8  # one_update's AdamW


def assert_same_adamw_step(sharded: torch.Tensor, single: torch.Tensor, grad: torch.Tensor, name: str,
                           atol: float = 1e-5) -> None:
    """AdamW's first step is lr * g / (|g| + eps): about lr * sign(g), except where |g| is near eps.

    There a summation-order difference in g (1e-10) moves the step by a good part of lr, so those
    weights are only held to the bound every first step obeys, |step| <= lr; the rest to `atol`.
    """
    tiny = grad.abs() < 1e3 * EPS
    torch.testing.assert_close(sharded[~tiny], single[~tiny], rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")
    assert not tiny.any() or (sharded[tiny] - single[tiny]).abs().max() <= 2 * LR, name


@pytest.fixture(scope="module")
def bf16_updates(toy_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2-bf16")
    spawn("bf16_update", toy_dir=str(toy_dir), out=str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_rank_1_builds_on_meta_and_receives_rank_0s_weights(kind, toy_dir, bf16_updates):
    """Only rank 0 reads the model; rank 1 holds no weight bytes before sharding, float32 shards after."""
    ranks = [json.loads((bf16_updates / f"{kind}-rank{r}.json").read_text()) for r in (0, 1)]
    models = 2 if kind == "full" else 1  # full fine-tuning with a KL term also shards its reference copy
    assert len(ranks[0]) == len(ranks[1]) == models
    assert all(m["materialized_bytes"] == 0 and m["devices"] == ["meta"] for m in ranks[1])
    assert all(m["materialized_bytes"] > 0 and m["devices"] == ["cpu"] for m in ranks[0])
    assert ranks[0][0]["trainable_dtypes"] == ranks[1][0]["trainable_dtypes"] == ["torch.float32"]
    print(kind, "rank 0 before sharding:", [m["materialized_bytes"] for m in ranks[0]], "bytes")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_two_processes_match_one(kind, toy_dir, bf16_updates):
    """bf16 compute on float32 masters: 2 processes (FSDP2 MixedPrecisionPolicy) agree with 1 (autocast)."""
    sharded = load_file(str(bf16_updates / f"{kind}.safetensors"))
    single = one_update(job_spec(toy_dir, kind, dtype="bfloat16", gradient_checkpointing=True), rank=0, world=1)
    fp32 = one_update(job_spec(toy_dir, kind, gradient_checkpointing=True), rank=0, world=1)
    assert sharded.keys() == single.keys()

    from worker.model.policy import load_policy

    torch.manual_seed(0)
    initial = load_policy(job_spec(toy_dir, kind), resume_from=None, warm_start=None).model.state_dict()

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))

    # bf16 keeps 8 significant bits (a rounding moves a value by up to 2^-9 = 0.2%); the two paths round at
    # different points (autocast keeps embeddings, the residual stream and norms in float32, FSDP's bf16
    # parameters do not). Each is a bf16 approximation of the same float32 computation, so by the triangle
    # inequality they lie within about twice bf16's own distance from float32 of each other: the bound is
    # 3x that distance, at least 1% (2^-9 a rounding). Measured: gradients up to 2.6x (LoRA 0.2% apart,
    # full fine-tuning up to 4.5% where bf16 is 1.9% from float32). A missing cast or reduction is ~100%.
    torch.testing.assert_close(sharded["loss"], single["loss"], rtol=1e-2, atol=0)
    for name in [n for n in single if n.startswith("grad.") or n == "grad_norm"]:
        if single[name].abs().max() == 0:  # lora_A before lora_B moved: zero gradient in every run
            assert sharded[name].abs().max() == 0, name
            continue
        apart, bf16_error = rel(sharded[name], single[name]), rel(single[name], fp32[name])
        assert apart < max(1e-2, 3 * bf16_error), name
    for name in [n for n in single if n.startswith("weight.")]:
        start = initial[name.removeprefix("weight.")]
        # AdamW's first step is about lr * sign(g): small gradient differences flip the sign of the smallest
        # gradients, so updates differ more than gradients. Same bound, floor 15% (measured: up to 1.9x,
        # 25% at most, where bf16's own update is 25% from float32's).
        drift = rel(sharded[name] - start, single[name] - start)
        assert drift < max(0.15, 3 * rel(single[name] - start, fp32[name] - start)), name


# -- checkpoints across world sizes ------------------------------------------------


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds: weights (adapter or whole model) and optimizer state."""
    out = {}
    for f in sorted(ckpt.rglob("*.safetensors")):
        out.update({f"{f.relative_to(ckpt)}:{k}": v for k, v in load_file(str(f)).items()})
    return out


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert ta.keys() == tb.keys()
    assert any(k.startswith("trainer_state.safetensors:optimizer.state.") for k in ta)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    sa, sb = (json.loads((p / "trainer_state.json").read_text()) for p in (a, b))
    assert sa["optimizer"] == sb["optimizer"] and sa["state"]["step"] == sb["state"]["step"]


class Recorder:
    def __init__(self):
        self.steps, self.evals, self.checkpoints, self.events, self.preflights = [], [], [], [], []

    def on_step(self, step, metrics): self.steps.append((step, metrics))
    def on_eval(self, step, metrics): self.evals.append((step, metrics))
    def on_checkpoint(self, step, path): self.checkpoints.append((step, path))
    def event(self, message): self.events.append(message)
    def on_preflight(self, metrics): self.preflights.append(metrics)
    def should_stop(self): return False


@pytest.mark.slow
def test_one_process_checkpoints_resume_at_two(toy_dir, tmp_path):
    """Saved at 1 process, resumed at 2 and saved again: the same tensors (LoRA and full fine-tuning)."""
    from transformers import AutoModelForCausalLM

    from worker.trainer.loop import train

    runs = {}
    for kind in KINDS:
        spec = job_spec(toy_dir, kind, steps=1)
        result = train(spec, tmp_path / kind)
        (tmp_path / kind / "spec.json").write_text(job_spec(toy_dir, kind, steps=1, gpus=2).model_dump_json())
        runs[kind] = str(tmp_path / kind)
        if kind == "full":  # a whole model that from_pretrained loads, equal to the saved weights
            saved = load_file(str(result.last_checkpoint / "model" / "model.safetensors"))
            loaded = AutoModelForCausalLM.from_pretrained(result.last_checkpoint / "model").state_dict()
            assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    spawn("resume_and_save", runs=runs)
    for kind, run_dir in runs.items():
        assert_same_checkpoint(Path(run_dir) / "checkpoints" / "step-00000001",
                               Path(run_dir) / "saved-again" / "step-00000001")


@pytest.mark.slow
def test_torchrun_job_reports_and_resumes_at_one(toy_dir, tmp_path):
    """A 2-process job under torchrun relays steps, evaluations and checkpoints; its checkpoint resumes at 1."""
    from worker.torchrun.launch import run_distributed
    from worker.trainer.loop import Trainer

    spec = job_spec(toy_dir, "lora", steps=2, gpus=2, checkpoint_interval=1)
    calls = Recorder()
    result = run_distributed(spec, tmp_path, calls)
    assert result.steps_done == 2 and not result.stopped
    assert [s for s, _ in calls.steps] == [1, 2] and [s for s, _ in calls.checkpoints] == [1, 2]
    assert [s for s, _ in calls.evals] == [0, 1, 2]  # every checkpoint carries its eval
    # the pre-flight's groups come from both ranks (one each), relayed once; rank 0 says what it loads
    assert [p["preflight_groups"] for p in calls.preflights] == [2.0]
    assert calls.events[:2] == [f"Loading the model {spec.model}", "Starting the rollout engine (hf)"]
    metrics = calls.steps[0][1]
    # The whole batch's figures, not rank 0's half: 2 prompts x 4 completions.
    assert metrics["optimizer_steps"] == 1 and 0 <= metrics["reward_mean"] <= 1
    assert metrics["trained_tokens"] == pytest.approx(8 * metrics["completion_length_mean"])
    assert result.last_checkpoint == calls.checkpoints[-1][1]

    trainer = Trainer(job_spec(toy_dir, "lora", steps=2), tmp_path)  # the same job at 1 process
    assert trainer.step == 2
    trainer.checkpoint_root = tmp_path / "saved-again"
    assert_same_checkpoint(result.last_checkpoint, trainer.save())


@pytest.mark.slow
def test_a_rank_error_of_a_known_kind_fails_the_job_as_that_kind(toy_dir, tmp_path):
    """A bad warm start fails in every rank; the launcher raises CheckpointError (the job fails as invalid_job)."""
    from worker.checkpoints.checkpoint import CheckpointError
    from worker.torchrun.launch import run_distributed

    spec = job_spec(toy_dir, "lora", gpus=2).model_copy(update={"init_from": str(tmp_path / "no-such-checkpoint")})
    with pytest.raises(CheckpointError, match="no-such-checkpoint is not a directory"):
        run_distributed(spec, tmp_path / "run", Recorder())


@pytest.mark.parametrize("written, raised", [({1: ("CheckpointError", "init_from: no checkpoint")}, "CheckpointError"),
                                             ({0: ("KeyError", "x"), 1: ("DataError", "bad row")}, "DataError"),
                                             ({1: ("KeyError", "x")}, "RankFailed"), ({}, "RankFailed")])
def test_rank_0_killed_before_reporting_still_fails_as_the_known_kind_a_rank_wrote(tmp_path, written, raised):
    """The race a loaded machine makes: every rank fails on a bad warm start, rank 1 exits first, torchrun kills
    rank 0 before it sends its error. The launcher reads what each rank wrote before exiting: the lowest rank's
    known kind wins (the job fails as invalid_job, not as a crash); an unknown kind or none stays RankFailed."""
    from worker.torchrun import launch

    for rank, (kind, message) in written.items():
        launch.write_rank_error(tmp_path, rank, type(kind, (Exception,), {})(message))
    assert not list((tmp_path / launch.RANK_ERRORS).glob(".*"))  # no partial file left
    ours, ranks = socket.socketpair()
    ranks.close()  # rank 0 gone without a word
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    (tmp_path / launch.RANKS_LOG).write_text("rank 1: init_from ... is not a directory\n")
    with ours, pytest.raises(Exception) as failure:
        launch._serve(ours, proc, Recorder(), 60.0, tmp_path / launch.RANKS_LOG)
    assert type(failure.value).__name__ == raised
    if raised != "RankFailed":
        assert str(failure.value) == [m for k, m in written.values() if k == raised][0]


TEARDOWN_RACE = """
import atexit, os, socket, time
if os.environ.get("RANK") == "1":
    atexit.register(os.abort)  # rank 1 finishes, then dies in its teardown (as gloo can)
elif os.environ.get("RANK") == "0":
    _sendall = socket.socket.sendall
    def sendall(self, data, *args):
        if data.startswith(b'{"kind": "done"'):
            time.sleep(3)  # rank 0 slow to report the result
        return _sendall(self, data, *args)
    socket.socket.sendall = sendall
"""


@pytest.mark.slow
def test_a_rank_dying_in_its_teardown_does_not_lose_the_result(toy_dir, tmp_path, monkeypatch):
    """Rank 1 aborts once its training is over, while rank 0 still reports the result: no rank leaves before
    rank 0 has reported, so the job has its result and succeeds (torchrun killing rank 0 first lost it)."""
    from worker.torchrun.launch import run_distributed

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(TEARDOWN_RACE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))
    result = run_distributed(job_spec(toy_dir, "lora", gpus=2, steps=1, checkpoint_interval=0), tmp_path / "run",
                             Recorder())
    assert result.steps_done == 1 and not result.stopped


# -- one job, 1 or 2 processes -------------------------------------------------------


@pytest.mark.slow
def test_cispo_train_runs_the_spec_gpus_and_two_processes_train_as_one(toy_dir, tmp_path):
    """`cispo train` with resources.gpus 2 runs two ranks under torchrun, as the service does. Sampling streams
    are keyed by prompt (not rank) and mini-batches are cut from the whole batch, so the job samples exactly the
    completions it samples at one process (equal rewards and lengths each step) and ends with the same adapter."""
    from worker.trainer.loop import Trainer

    # 2 optimizer steps a trainer step, each mixing sequences of both ranks; 3 steps: later rollouts sample
    # from updated weights. The KL term (job_spec's kl_beta) is on.
    training = dict(steps=3, batch_size=4, group_size=4, mini_batches=2, micro_batch_size=4, checkpoint_interval=0)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(job_spec(toy_dir, "lora", gpus=2, **training).model_dump(mode="json")))
    run = subprocess.run([sys.executable, "-m", "worker.cli", "train", str(spec_path), "--output", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "two" / "ranks.log").is_file()  # torchrun's ranks, not one process
    lines = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    two = [m for m in lines if m["kind"] == "train"]

    one = Recorder()
    result = Trainer(job_spec(toy_dir, "lora", **training), tmp_path / "one").run(one)
    assert [m["step"] for m in two] == [s for s, _ in one.steps] == [1, 2, 3]
    for m2, (_, m1) in zip(two, one.steps):
        assert (m2["reward_mean"], m2["completion_length_mean"], m2["optimizer_steps"]) == \
               (m1["reward_mean"], m1["completion_length_mean"], m1["optimizer_steps"]), m2["step"]
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-6)
    assert 0 < sum(m["reward_mean"] for m in two) < 3  # rewards that vary, so equal ones mean equal samples

    sharded = load_file(str(tmp_path / "two" / "checkpoints" / "step-00000003" / "adapter" / "adapter_model.safetensors"))
    single = load_file(str(result.last_checkpoint / "adapter" / "adapter_model.safetensors"))
    assert sharded.keys() == single.keys()
    for name, expected in single.items():
        torch.testing.assert_close(sharded[name], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# -- asynchronous rollouts under FSDP -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_train_asynchronously_within_the_bound_as_one_process_does(kind, toy_dir, tmp_path):
    """max_staleness 1 at 2 ranks: rank 0's sampler process gets each version gathered from the shards, and every
    sequence each rank trains on is at most one version old. Batch j is sampled by version max(0, j - 1) at any
    world size, so the job samples what it samples in one process (equal rewards and lengths each step: a version
    not relayed, or relayed from one shard, would sample other completions from step 3 on) and ends with the same
    weights (LoRA; under full fine-tuning AdamW's first steps amplify the ranks' float summation order, see
    assert_same_adamw_step, so there the losses are held to 2% and the samples to equality)."""
    for run in ("two", "one"):
        (tmp_path / run).mkdir()
    spawn("async", toy_dir=str(toy_dir), kind=kind, out=str(tmp_path / "two"))
    _async_task(0, 1, str(toy_dir), kind, str(tmp_path / "one"))

    for rank in (0, 1):
        taken = json.loads((tmp_path / "two" / f"taken-rank{rank}.json").read_text())
        assert [t["step"] for t in taken] == [0, 1, 2]
        for t in taken:  # this rank's half of the 16 sequences, each tagged with the version that sampled it
            assert t["sequences"] == 8 and len(t["versions"]) == 8
            assert all(0 <= t["step"] - v <= 1 for v in t["versions"]), t
        assert [t["versions"] for t in taken] == [[0] * 8, [0] * 8, [1] * 8]
    two, one = (json.loads((tmp_path / run / "metrics.json").read_text()) for run in ("two", "one"))
    assert len(two) == len(one) == 3
    for m2, m1 in zip(two, one):
        assert (m2["reward_mean"], m2["completion_length_mean"]) == (m1["reward_mean"], m1["completion_length_mean"])
        assert (m2["policy_lag_max"], m2["stale_dropped"]) == (m1["policy_lag_max"], 0.0)
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4 if kind == "lora" else 2e-2, abs=1e-6)
    assert [m["policy_lag_max"] for m in two] == [0.0, 1.0, 1.0]
    assert 0 < sum(m["reward_mean"] for m in two) < 3  # rewards that vary, so equal ones mean equal samples
    if kind == "full":
        return
    sharded, single = (load_file(str(tmp_path / run / "weights.safetensors")) for run in ("two", "one"))
    assert sharded.keys() == single.keys()
    for name, expected in single.items():
        torch.testing.assert_close(sharded[name], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_torchrun_async_job_trains_and_leaves_no_sampler(toy_dir, tmp_path):
    """The job runner's launcher at resources.gpus 2 with max_staleness 1: the job finishes with finite losses,
    the lag within the bound, and its sampler process gone with the ranks."""
    import math

    from tests.worker.trainer.test_async_rollouts import sampler_processes
    from worker.torchrun.launch import run_distributed

    calls = Recorder()
    result = run_distributed(async_job_spec(toy_dir, "lora", gpus=2, steps=2), tmp_path, calls)
    assert result.steps_done == 2 and not result.stopped
    metrics = [m for _, m in calls.steps]
    assert [m["policy_lag_max"] for m in metrics] == [0.0, 1.0] and all(m["stale_dropped"] == 0 for m in metrics)
    assert all(math.isfinite(m["loss"]) and m["trained_tokens"] > 0 for m in metrics)
    assert sampler_processes() == []


@pytest.mark.slow
def test_two_ranks_stopped_asynchronously_resume_from_the_checkpoint_as_one_process_does(toy_dir, tmp_path):
    """max_staleness 1 at 2 ranks, stopped (cancel, pause, drain) after step 2 of 4 with the next batches in flight:
    every rank stops, rank 0's sampler process is gone, the checkpoint holds the trained position (what was in
    flight is requested again), and both ranks resume from it and finish, the resumed sampler starting at version
    2. The same stop and resume in one process samples the same completions and ends with the same adapter."""
    for run in ("two", "one"):
        (tmp_path / run).mkdir()
    spawn("async_stop_resume", toy_dir=str(toy_dir), out=str(tmp_path / "two"))
    _async_stop_resume_task(0, 1, str(toy_dir), str(tmp_path / "one"))

    for rank in (0, 1):
        record = json.loads((tmp_path / "two" / f"stop-resume-rank{rank}.json").read_text())
        assert record["stopped"] == {"stopped": True, "steps_done": 2, "samplers_left": 0}, rank
        assert record["resumed_at"] == 2
        assert record["finished"] == {"stopped": False, "steps_done": 4}
        # Batch j by version max(0, j - 1) before the stop; after it, batches 2 and 3 by the resumed weights.
        assert [(t["step"], sorted(set(t["versions"])), len(t["versions"])) for t in record["taken"]] == \
               [(0, [0], 8), (1, [0], 8), (2, [2], 8), (3, [2], 8)], rank
    state = json.loads((tmp_path / "two" / "checkpoint-state.json").read_text())
    assert state["step"] == 2 and state["data"] == {"epoch": 0, "index": 2 * 4}

    two, one = (json.loads((tmp_path / run / "metrics.json").read_text()) for run in ("two", "one"))
    assert len(two) == len(one) == 4
    for m2, m1 in zip(two, one):
        assert (m2["reward_mean"], m2["completion_length_mean"]) == (m1["reward_mean"], m1["completion_length_mean"])
        assert (m2["policy_lag_max"], m2["stale_dropped"]) == (m1["policy_lag_max"], 0.0)
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-6)
    assert [m["policy_lag_max"] for m in two] == [0.0, 1.0, 0.0, 1.0]
    assert 0 < sum(m["reward_mean"] for m in two) < 4  # rewards that vary, so equal ones mean equal samples
    sharded, single = (load_file(str(tmp_path / run / "weights.safetensors")) for run in ("two", "one"))
    assert sharded.keys() == single.keys()
    for name, expected in single.items():
        torch.testing.assert_close(sharded[name], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
