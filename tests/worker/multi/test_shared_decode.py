"""Several jobs' rows sampled in one decode over a shared base equal each job sampled alone.

Alone is the existing path: a PeftModel holding only that job's adapter, worker/rollout/decode.py's
rollout_weights + sample_tokens (and rollout.generate for whole rollouts).
"""

from __future__ import annotations

import json

import pytest
import torch

from service.job_spec.sampling import SamplingSpec
from worker.multi.lora import SharedBase, segments_of
from worker.multi.rollout import RolloutRequest, generate_jobs
from worker.rollout.decode import JobRows, sample_jobs, sample_tokens
from worker.rollout.effective_weights import rollout_weights
from worker.rollout.rollout import generate, TransformersSampler
from worker.model.policy import Policy
from worker.model.streams import stream_seed

from tests.worker.multi.conftest import LORAS, alone, shared_with_adapters
from tests.worker.trainer.conftest import forward_shapes

CPU = torch.device("cpu")
# Each job its own sampling knobs and length budget.
SAMPLING = {
    "job-a": SamplingSpec(temperature=1.0, max_output_tokens=6, max_model_len=32),
    "job-b": SamplingSpec(temperature=0.7, top_k=5, max_output_tokens=3, max_model_len=32),
    "job-c": SamplingSpec(temperature=1.3, top_p=0.9, repetition_penalty=1.2, max_output_tokens=8, max_model_len=32),
    "job-d": SamplingSpec(temperature=1.0, min_output_tokens=2, max_output_tokens=5, max_model_len=32),
}
LOGPROB_TOLERANCE = 2e-5  # float32 rounding of other batch shapes (longer left padding, other kernels' order)


def test_segments_must_be_contiguous():
    assert segments_of(["a", "a", "b", None]) == [("a", 0, 2), ("b", 2, 3), (None, 3, 4)]
    with pytest.raises(ValueError, match="not contiguous"):
        segments_of(["a", "b", "a"])


@pytest.fixture(scope="module")
def shared(toy_dir) -> SharedBase:
    return shared_with_adapters(toy_dir, LORAS)


def _rows(toy_dir, start: int, n: int) -> list[dict]:
    lines = (toy_dir / "train.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[start : start + n]]


def test_each_row_samples_what_its_job_samples_alone(toy_dir, tokenizer, shared):
    """Per-row adapters: tokens equal, log-probs within float32 rounding; a job's own prompts shared with another
    job (job-a and job-d get the same prompts) are still prefilled through each one's own adapter."""
    prompts = {name: [tokenizer(r["prompt"])["input_ids"] for r in _rows(toy_dir, 7 * k, 3 + k)]
               for k, name in enumerate(LORAS)}
    prompts["job-d"] = prompts["job-a"]
    jobs = [JobRows(name, prompts[name] * 2, SAMPLING[name].max_output_tokens, SAMPLING[name],
                    seeds=[stream_seed("t", k, i) for i in range(2 * len(prompts[name]))], logprobs=True)
            for k, name in enumerate(LORAS)]
    shared.model.eval()
    together = sample_jobs(shared.model, shared.router, jobs, eos_id=tokenizer.eos_token_id,
                           pad_id=tokenizer.pad_token_id, device=CPU)
    differs = 0
    for job, (tokens, logps) in zip(jobs, together):
        model = alone(toy_dir, shared, job.name).eval()
        with rollout_weights(model) as generator:
            want, want_logps = sample_tokens(generator, job.prompts, max_new=job.max_new, sampling=job.sampling,
                                             greedy=False, eos_id=tokenizer.eos_token_id,
                                             pad_id=tokenizer.pad_token_id, device=CPU, logprobs=True,
                                             seeds=job.seeds)
        assert tokens == want, job.name
        for got, exp in zip(logps, want_logps):
            assert got == pytest.approx(exp, abs=LOGPROB_TOLERANCE), job.name
        differs += tokens != together[0][0]
    assert differs  # the jobs' adapters and knobs really sample differently


def test_greedy_rows_and_a_job_alone_in_the_shared_decode(toy_dir, tokenizer, shared):
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in _rows(toy_dir, 50, 4)]
    jobs = [JobRows("job-c", prompts, 5, SAMPLING["job-c"], greedy=True),
            JobRows("job-b", prompts, 4, SAMPLING["job-b"], greedy=True)]
    shared.model.eval()
    together = sample_jobs(shared.model, shared.router, jobs, eos_id=tokenizer.eos_token_id,
                           pad_id=tokenizer.pad_token_id, device=CPU)
    for job, (tokens, _) in zip(jobs, together):
        only = sample_jobs(shared.model, shared.router, [job], eos_id=tokenizer.eos_token_id,
                           pad_id=tokenizer.pad_token_id, device=CPU)[0][0]
        assert tokens == only
    assert together[0][0] != together[1][0]


def test_rollouts_of_several_jobs_equal_each_job_generated_alone(toy_dir, tokenizer, shared):
    requests = [RolloutRequest(name, _rows(toy_dir, 11 * k, 2 + k % 2), SAMPLING[name], group_size=2 + k,
                               sampling_seeds=[stream_seed("sample", k, 0, p) for p in range(2 + k % 2)])
                for k, name in enumerate(LORAS)]
    rollouts = generate_jobs(shared, tokenizer, CPU, requests)
    for req, rollout in zip(requests, rollouts):
        policy = Policy(alone(toy_dir, shared, req.name).eval(), tokenizer, CPU)
        want = generate(policy, req.rows, req.sampling, group_size=req.group_size,
                        sampler=TransformersSampler(policy, req.sampling), sampling_seeds=req.sampling_seeds)
        assert rollout.token_ids == want.token_ids, req.name
        assert rollout.action_mask == want.action_mask
        assert rollout.completions == want.completions and rollout.truncated == want.truncated


def test_finished_rows_may_ride_along_until_a_check(toy_dir, tokenizer, shared):
    """As on CUDA (a check every few steps, not every step): the same tokens and, within float32 rounding, the
    same log-probs; a job's rows still leave at its own max_new, and its picker is never asked past it."""
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in _rows(toy_dir, 60, 4)]
    jobs = [JobRows("job-a", prompts * 2, 7, SAMPLING["job-a"], seeds=list(range(8)), logprobs=True),
            JobRows(None, prompts, 2, SAMPLING["job-b"], seeds=list(range(4)), logprobs=True),
            JobRows("job-c", prompts, 5, SAMPLING["job-c"], greedy=True, logprobs=True, stop_tokens=(41,))]
    shared.model.eval()
    kw = dict(eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, device=CPU)
    every_step = sample_jobs(shared.model, shared.router, jobs, **kw, check_every=1)
    with forward_shapes(shared.model) as shapes:
        every_3 = sample_jobs(shared.model, shared.router, jobs, **kw, check_every=3)
    for (tokens, logps), (tokens_3, logps_3) in zip(every_step, every_3):
        assert tokens_3 == tokens
        for got, exp in zip(logps_3, logps):
            assert got == pytest.approx(exp, abs=LOGPROB_TOLERANCE)
    assert len({len(t) for t in every_step[0][0]}) > 1  # rows did end at various steps
    sizes = [b for b, _ in shapes[1:]]  # sizes[t]: the forward after step t
    changes = {t for t in range(1, len(sizes)) if sizes[t] != sizes[t - 1]}
    assert 1 in changes and sizes[0] - sizes[1] >= 4  # the base job's rows left at its max_new (2 tokens)
    assert changes <= {t for t in range(len(sizes)) if (t + 1) % 3 == 0 or t + 1 in (2, 5)}, sizes


def test_jobs_sampling_in_their_own_rollout_dtype_decode_as_alone_beside_float32_jobs(toy_dir, tokenizer):
    """Rows of jobs with a rollout.dtype (bfloat16 over the float32 base; job-c's LM head in float32 too) decode on
    the base's weights cast as alone, in decodes of their own precision: tokens equal, the sampler's log-probs
    reported and equal; the float32 jobs beside them report none, as alone; the base's own weights stay float32."""
    shared = shared_with_adapters(toy_dir, LORAS)
    for name in ("job-a", "job-c"):  # what add(rollout_dtype=, head_float32=) records
        shared.rollout_dtypes[name] = torch.bfloat16
    shared.head_float32.add("job-c")
    requests = [RolloutRequest(name, _rows(toy_dir, 5 * k, 2), SAMPLING[name], group_size=2,
                               sampling_seeds=[stream_seed("cast", k, 0, p) for p in range(2)])
                for k, name in enumerate(LORAS)]
    rollouts = generate_jobs(shared, tokenizer, CPU, requests)
    assert all(p.dtype == torch.float32 for p in shared.base.parameters())
    for req, rollout in zip(requests, rollouts):
        dtype = shared.rollout_dtypes.get(req.name)
        policy = Policy(alone(toy_dir, shared, req.name).eval(), tokenizer, CPU,
                        lm_head_float32=req.name in shared.head_float32)
        want = generate(policy, req.rows, req.sampling, group_size=req.group_size, sampling_seeds=req.sampling_seeds,
                        sampler=TransformersSampler(policy, req.sampling, dtype=dtype, logprobs=dtype is not None))
        assert rollout.token_ids == want.token_ids, req.name
        assert (rollout.sampler_logprobs is None) == (dtype is None), req.name
        for got, exp in zip(rollout.sampler_logprobs or [], want.sampler_logprobs or [], strict=True):
            assert got == pytest.approx(exp, abs=LOGPROB_TOLERANCE), req.name
