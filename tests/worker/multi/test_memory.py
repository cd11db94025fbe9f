"""Memory admission on a shared base: the estimate on hand-computed numbers, the shape read off the toy base, and a job
that does not fit beside the resident one waiting, queued and told why, instead of joining."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sqlalchemy import select

from service.db.models import JobEvent
from service.db.session import session_factory
from service.job_spec.spec import JobSpec
from tests.specs import job_spec
from tests.worker.multi.conftest import toy_base
from tests.worker.jobs.test_job_runner import job_row, make_settings, submit
from worker.multi import memory
from worker.multi.lora import SharedBase
from worker.multi.runner import run_shared
from worker.toy.__main__ import toy_spec

LLAMA_LINEARS = {"q_proj": (2, 64, 64), "k_proj": (2, 64, 64), "v_proj": (2, 64, 64), "o_proj": (2, 64, 64),
                 "gate_proj": (2, 64, 128), "up_proj": (2, 64, 128), "down_proj": (2, 128, 64)}
SHAPE = memory.BaseShape(linears=LLAMA_LINEARS, layers=2, hidden=64, q_width=64, kv_width=64, intermediate=128,
                         heads=4, vocab=40, dtype_bytes=4)


def lora_spec(toy_dir, target_modules, r=4, eval_max_rows=8) -> JobSpec:
    return job_spec(toy_spec(toy_dir), lora={"r": r, "alpha": 8, "target_modules": target_modules},
                    sampling={"max_model_len": 32, "max_output_tokens": 16},
                    training={"batch_size": 2, "group_size": 4, "micro_batch_size": 4, "mini_batches": 1,
                              "logprob_chunk_size": 64, "eval_max_rows": eval_max_rows})


def test_the_estimate_on_hand_computed_numbers(toy_dir):
    est = memory.estimate(lora_spec(toy_dir, ["q_proj", "v_proj"]), SHAPE)
    # P = 2 layers * 2 modules * r 4 * (64 + 64) = 2048; weights + grads, and AdamW's two moments: 8 bytes each.
    assert (est.adapter, est.optimizer) == (16384, 16384)
    # Sampling asynchronously (max_staleness 1): its sampling copy and two versions besides, 4 bytes each.
    stale = memory.estimate(job_spec(lora_spec(toy_dir, ["q_proj", "v_proj"]).model_dump(mode="json"),
                                     rollout={"max_staleness": 1}), SHAPE)
    assert (stale.adapter, stale.optimizer) == (16384 + 3 * 4 * 2048, 16384)
    # A micro-batch of 4 rows * 32 tokens = 128 tokens; per token and layer 4*64 + 2*64 + 2*64 + 4*128 + 4 heads * 32
    # = 1152 values of 4 bytes, over 2 layers: 1,179,648; one LM-head chunk (64 tokens) of float32 logits and their
    # gradient, vocab 40: 2 * 64 * 40 * 4 = 20,480.
    assert est.activations == 1_179_648 + 20_480
    # 2 prompts * 4 completions = 8 rows of 32 tokens, keys and values of 64 wide in 2 layers, 4 bytes: 262,144;
    # one decode step's float32 logits: 8 * 40 * 4 = 1,280.
    assert est.kv_cache == 262_144 + 1_280
    assert est.peak == 16384 + 16384 + 1_200_128
    # all-linear: per layer 4 attention linears * 4 * 128 + gate, up and down * 4 * 192 = 4352; 2 layers.
    assert memory.adapter_parameters(lora_spec(toy_dir, "all-linear"), SHAPE) == 8704


def test_an_evaluation_with_more_rows_than_a_rollout_sets_the_kv_cache(toy_dir):
    """An evaluation decodes eval_max_rows rows (with the other due jobs' together): when they outnumber the
    rollout's 8, they are what the decode holds: 64 rows of 32 tokens, 64 wide in 2 layers, float32, and one
    decode step's logits for 64 rows."""
    est = memory.estimate(lora_spec(toy_dir, ["q_proj", "v_proj"], eval_max_rows=64), SHAPE)
    assert est.kv_cache == 64 * 32 * 2 * 2 * 64 * 4 + 64 * 40 * 4 == 2_107_392
    assert est.peak == 16384 + 16384 + 2_107_392  # now the larger phase


def test_jobs_together_need_their_states_and_the_larger_of_their_summed_phases():
    a = memory.MemoryEstimate(adapter=1, optimizer=2, activations=10, kv_cache=100)
    b = memory.MemoryEstimate(adapter=4, optimizer=8, activations=50, kv_cache=20)
    assert memory.together([a, b]) == 1 + 2 + 4 + 8 + max(10 + 50, 100 + 20)
    assert memory.together([a]) == a.peak


def test_the_shape_read_off_the_toy_base_counts_the_adapter_it_gets(toy_dir):
    base = toy_base(toy_dir)
    shape = memory.BaseShape.of(base)
    assert shape.linears == LLAMA_LINEARS and (shape.layers, shape.hidden, shape.kv_width) == (2, 64, 64)
    assert shape.dtype_bytes == 4 and shape.vocab == base.config.vocab_size
    spec = lora_spec(toy_dir, "all-linear", r=3)
    shared = SharedBase(base)
    params = shared.add("job", spec.lora)
    assert sum(p.numel() for p in params) == memory.adapter_parameters(spec, shape)
    assert all(p.dtype == torch.float32 for p in params)
    assert memory.BaseShape.of(shared.base) == shape  # PEFT's wrapped layers and LoRA's own are not the base's


def test_a_worker_sampling_in_another_dtype_holds_the_bases_weights_cast_to_it_once(toy_dir):
    """Its jobs share the rollout.dtype (base_key): the decode's copies of the base's weights in it, counted once
    with the base; none where the jobs sample in the base's own dtype."""
    base = toy_base(toy_dir)
    parameters = sum(p.numel() for p in base.parameters())
    assert memory.cast_copies(base, job_spec(toy_spec(toy_dir), rollout={"dtype": "bfloat16"})) == 2 * parameters
    assert memory.cast_copies(base, job_spec(toy_spec(toy_dir), rollout={"dtype": "float32"})) == 0
    assert memory.cast_copies(base, job_spec(toy_spec(toy_dir))) == 0


def test_a_job_that_does_not_fit_waits_queued_with_the_reason_and_runs_later(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)
    first = submit(settings, toy_dir, steps=3, checkpoint_interval=0)
    second = submit(settings, toy_dir, steps=1, checkpoint_interval=0)
    base = toy_base(toy_dir)
    shape, base_bytes = memory.BaseShape.of(base), memory.model_bytes(base)
    one, other = (memory.estimate(JobSpec.model_validate(job_row(settings, j).spec), shape) for j in (first, second))
    alone, both = base_bytes + memory.together([one]), base_bytes + memory.together([one, other])
    budget = alone + (both - alone) // 2  # room for the first job, not for both
    settings = settings.model_copy(update={"worker_jobs": 2, "worker_memory_gib": budget / 2**30})

    assert run_shared(first, settings) == "succeeded"
    waiting = job_row(settings, second)
    assert (waiting.status, waiting.attempts, waiting.steps_done) == ("queued", 0, 0)
    with session_factory(settings.resolved_database_url()).begin() as s:
        told = list(s.scalars(select(JobEvent).where(JobEvent.job_id == second)))
        told = [(e.level, e.message, e.data) for e in told]
    assert len(told) == 1, told  # told once, not at every cycle
    level, message, data = told[0]
    assert level == "warn" and message.startswith("Waiting for memory on a shared worker")
    assert data["reason"] == "memory" and data["needed_bytes"] == both and data["budget_bytes"] <= budget

    # Its own broker message, on a worker with nothing resident, runs it.
    assert run_shared(second, settings) == "succeeded"


def vllm_lora_spec(toy_dir, **rollout) -> JobSpec:
    return job_spec(lora_spec(toy_dir, ["q_proj", "v_proj"]).model_dump(mode="json"),
                    rollout={"engine": "vllm", **rollout})


def test_a_vllm_jobs_kv_cache_is_the_engines_counted_once_per_worker(toy_dir):
    hf, vllm = lora_spec(toy_dir, ["q_proj", "v_proj"]), vllm_lora_spec(toy_dir)
    assert memory.estimate(vllm, SHAPE).kv_cache == 0  # its rows' keys and values are in the engine's cache
    assert memory.estimate(vllm, SHAPE).activations == memory.estimate(hf, SHAPE).activations
    a = memory.MemoryEstimate(adapter=1, optimizer=2, activations=10, kv_cache=0)
    b = memory.MemoryEstimate(adapter=4, optimizer=8, activations=50, kv_cache=0)
    hf_job = memory.MemoryEstimate(adapter=1, optimizer=1, activations=5, kv_cache=30)
    awake = memory.EngineMemory(held=1000, sleeps_in_update=False)
    asleep = memory.EngineMemory(held=1000, sleeps_in_update=True)
    # Two vLLM jobs: one engine, held through the update too when it does not sleep.
    assert memory.together([a, b], awake) == 15 + 1000 + 60
    assert memory.together([a, b], asleep) == 15 + 1000
    assert memory.together([a, b, hf_job], asleep) == 17 + 1000 + 30  # our decode loop's KV beside the engine's
    assert memory.together([a, b]) == 15 + 60  # no engine: as before


def test_the_engines_memory_is_its_gpu_share_or_its_weights_and_cpu_kv_space(toy_dir, monkeypatch):
    hf, vllm = lora_spec(toy_dir, ["q_proj", "v_proj"]), vllm_lora_spec(toy_dir, gpu_memory_utilization=0.25)
    assert memory.engine_memory([hf], torch.device("cpu"), 1000) is None
    monkeypatch.setattr(memory, "device_memory", lambda device: 80 * 2**30)
    on_gpu = memory.engine_memory([hf, vllm, vllm_lora_spec(toy_dir, gpu_memory_utilization=0.5, sleep_mode=False)],
                                  torch.device("cuda"), 1000)
    assert on_gpu == memory.EngineMemory(held=20 * 2**30, sleeps_in_update=True)  # the first vLLM job's settings
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    on_cpu = memory.engine_memory([vllm], torch.device("cpu"), 1000)
    assert on_cpu == memory.EngineMemory(held=1000 * 4 + 2 * 2**30, sleeps_in_update=False)  # the toy is float32


def test_a_vllm_job_waits_when_the_engine_does_not_fit_beside_the_resident_job(toy_dir, tmp_path, monkeypatch):
    from worker.multi.runner import Resident, SharedWorker

    base = toy_base(toy_dir)
    worker = SharedWorker(settings=None, sessions=None, store=None, owner="test", model="toy", key=("toy", "x"),
                          slots=2)
    worker.shape, worker.base_bytes = memory.BaseShape.of(base), memory.model_bytes(base)
    worker.base_parameters, worker.device = sum(p.numel() for p in base.parameters()), torch.device("cpu")
    resident = vllm_lora_spec(toy_dir)
    worker.residents["first"] = Resident("first", SimpleNamespace(spec=resident), reporter=None, work=tmp_path)
    worker.estimates["first"] = memory.estimate(resident, worker.shape)
    joining = vllm_lora_spec(toy_dir)
    jobs_alone = worker.base_bytes + memory.together([worker.estimates["first"], memory.estimate(joining,
                                                                                              worker.shape)])
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    worker.budget = jobs_alone + 2**30 // 2  # room for both jobs' own memory, not for the engine's KV space
    worker.told_waiting.add("second")  # told already: no event to write here
    assert not worker._fits("second", joining)
    worker.budget = jobs_alone + memory.engine_memory([resident], worker.device, worker.base_parameters).held
    assert worker._fits("second", joining)


def test_packing_and_gradient_checkpointing_change_what_the_update_keeps(toy_dir):
    """lora_spec's micro-batch, but one packed row of 96 tokens, each attending over the 96 (eager attention's
    weights), or checkpointed: each of the 2 layers' inputs (64 wide) and one layer's 1152 values, per token."""
    head = 2 * 64 * 40 * 4  # one LM-head chunk's logits and their gradient, as before
    packed = memory.estimate(lora_spec(toy_dir, ["q_proj", "v_proj"]).model_copy(update={"training": lora_spec(
        toy_dir, ["q_proj"]).training.model_copy(update={"pack_tokens": 96})}), SHAPE)
    assert packed.activations == 96 * 2 * (4 * 64 + 2 * 64 + 2 * 64 + 4 * 128 + 4 * 96) * 4 + head
    checkpointed = memory.estimate(lora_spec(toy_dir, ["q_proj", "v_proj"]).model_copy(update={"training": lora_spec(
        toy_dir, ["q_proj"]).training.model_copy(update={"gradient_checkpointing": True})}), SHAPE)
    assert checkpointed.activations == 128 * (2 * 64 + 1152) * 4 + head == 655_360 + head
