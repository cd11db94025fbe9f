"""The service on a real instruct model (SmolLM2-135M-Instruct, built once from its wheel: tests/conftest.py), over
the production-shaped stack (tests/e2e/conftest.py: uvicorn, a Celery worker, PostgreSQL, Redis, S3 on moto).

One short pipeline serves every check: an SFT job on chat `messages` rows, then a CISPO job that continues its
fine-tuned model on chat prompts (two optimizer steps a rollout) and exports merged weights; then a `cispo serve`
process answers chat.completions of the CISPO model and the base. The checks: both jobs' chat rows as the model saw
them (ChatML with its default system prompt); served greedy replies equal to base + the trained adapter run here,
`<|im_end|>` ending a reply and stop strings cutting one; the merged export loads alone through from_pretrained with
the logits of base + adapter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import openai
import pytest
import redis
import torch

from service.serving.channel import presence_key
from tests.conftest import REDIS_TEST_URL
from tests.e2e.test_service_flow import wait_for
from tests.worker.serving.served import local_greedy

JOBS = "/fine_tuning/jobs"
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Peru", "Lima")]
SAMPLING = {"temperature": 1.0, "max_output_tokens": 8, "max_model_len": 96}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FINISHED = ("succeeded", "failed", "cancelled")


def _question(country: str) -> dict:
    return {"role": "user", "content": f"What is the capital of {country}?"}


def _upload(client, rows: list[dict]) -> str:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    r = client.post("/files", files={"file": ("rows.jsonl", data)}, data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _finished(client, body: dict) -> dict:
    r = client.post(JOBS, json=body)
    assert r.status_code == 200, r.text
    job = wait_for(lambda: client.get(f"{JOBS}/{r.json()['id']}").json(), FINISHED, timeout=900)
    assert job["status"] == "succeeded", job["error"]
    return job


def _cli(stack, key: str, *args: str) -> subprocess.CompletedProcess:
    env = {**stack.env, "CISPO_API_URL": stack.base, "CISPO_API_KEY": key}
    return subprocess.run([sys.executable, "-m", "worker.cli", "jobs", *args], env=env, capture_output=True,
                          text=True, timeout=300)


class Trained:
    def __init__(self, stack, key, client, model_dir, sft, cispo, adapter_dir):
        self.stack, self.key, self.client, self.model_dir = stack, key, client, model_dir
        self.sft, self.cispo, self.adapter_dir = sft, cispo, adapter_dir


@pytest.fixture(scope="module")
def trained(stack, real_model_dir):
    key = stack.new_key("real")
    client = stack.client(key)
    sft_rows = [{"messages": [_question(c), {"role": "assistant", "content": a}], "answer": a} for c, a in CAPITALS]
    sft = _finished(client, {
        "model": str(real_model_dir), "training_file": _upload(client, sft_rows), "seed": 1,
        "method": {"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 300,
            "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"}, "sampling": SAMPLING,
            "training": {"eval_max_rows": 2, "checkpoint_interval": 0, "micro_batch_size": 4}}}}})
    prompts = [{"messages": [_question(c)], "answer": a} for c, a in CAPITALS]
    cispo = _finished(client, {
        "model": sft["fine_tuned_model"], "training_file": _upload(client, prompts), "seed": 1,
        "method": {"type": "cispo", "cispo": {
            "reward": {"type": "exact_match", "field": "answer", "strip_punctuation": True},
            "hyperparameters": {"sampling": SAMPLING, "optimizer": {"lr": 1e-3}, "training": {
                "steps": 2, "batch_size": 2, "group_size": 2, "mini_batches": 2, "micro_batch_size": 4,
                "eval_interval": 0, "eval_max_rows": 2, "checkpoint_interval": 0, "preflight_groups": 0,
                "export": "merged"}}}}})
    adapter_dir = stack.root / "real-adapter"
    done = _cli(stack, key, "export", cispo["id"], "-o", str(adapter_dir))
    assert done.returncode == 0, done.stderr
    return Trained(stack, key, client, real_model_dir, sft, cispo, adapter_dir)


@pytest.fixture(scope="module")
def serving(trained):
    """`cispo serve` on the real base, beside the stack (its channel is the stack's Redis)."""
    proc = trained.stack.start("serve", "serve", "--model", str(trained.model_dir))
    deadline = time.monotonic() + 300
    while not redis.Redis.from_url(REDIS_TEST_URL).exists(presence_key(str(trained.model_dir))):
        assert proc.poll() is None, (trained.stack.root / "serve.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the serving worker did not come up"
        time.sleep(0.5)
    return openai.OpenAI(api_key=trained.key, base_url=f"{trained.stack.base}/v1", max_retries=0, timeout=300)


def test_sft_then_cispo_on_chat_rows(trained):
    client = trained.client
    losses = client.get(f"{JOBS}/{trained.sft['id']}/metrics", params={"name": "loss"}).json()["data"]
    assert [m["step"] for m in losses] == [1, 2]
    rewards = client.get(f"{JOBS}/{trained.cispo['id']}/metrics", params={"name": "reward_mean"}).json()["data"]
    assert [m["step"] for m in rewards] == [1, 2]
    samples = client.get(f"{JOBS}/{trained.cispo['id']}/samples").json()["data"]
    assert samples
    for sample in samples:
        # What the model saw: ChatML with the template's default system prompt, the row's user turn, the
        # generation prompt; the completion as text, its closing <|im_end|> not in it.
        assert sample["prompt"].startswith("<|im_start|>system\n")
        assert sample["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert "What is the capital of" in sample["prompt"]
        assert "<|im_end|>" not in sample["completion"]


def test_the_merged_export_loads_alone_with_base_plus_adapter_logits(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged_dir = trained.stack.root / "real-merged"
    done = _cli(trained.stack, trained.key, "export", trained.cispo["id"], "--merge", "-o", str(merged_dir))
    assert done.returncode == 0, done.stderr
    tok = AutoTokenizer.from_pretrained(merged_dir)
    assert tok.chat_template == AutoTokenizer.from_pretrained(trained.model_dir).chat_template
    ids = tok.apply_chat_template([QUESTION, [_question("Peru")]], add_generation_prompt=True, padding=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        alone = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()(**ids).logits
        base = AutoModelForCausalLM.from_pretrained(trained.model_dir, dtype=torch.float32).eval()
        plain = base(**ids).logits
        adapted = PeftModel.from_pretrained(base, trained.adapter_dir).eval()(**ids).logits
    assert (adapted - plain).abs().max() > 1e-2  # the adapter trained: a base-only export would fail below
    torch.testing.assert_close(alone, adapted, atol=2e-4, rtol=1e-4)


def test_chat_completions_of_the_trained_adapter_are_base_plus_adapter(trained, serving):
    for country, _ in CAPITALS[:2]:
        messages = [_question(country)]
        expected = local_greedy(trained.model_dir, trained.adapter_dir, messages, 12)
        r = serving.chat.completions.create(model=trained.cispo["fine_tuned_model"], messages=messages,
                                            max_tokens=12, temperature=0)
        assert r.choices[0].message.content == expected["text"], country
        assert r.choices[0].finish_reason == expected["finish_reason"]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (expected["prompt_tokens"],
                                                                      expected["completion_tokens"])


def test_im_end_ends_a_reply_and_a_stop_string_cuts_one(trained, serving):
    base = str(trained.model_dir)
    r = serving.chat.completions.create(model=base, messages=QUESTION, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"  # <|im_end|>, well before max_tokens, and not in the text
    assert r.usage.completion_tokens == local_greedy(trained.model_dir, None, QUESTION, 20)["completion_tokens"]
    cut = serving.chat.completions.create(model=base, messages=QUESTION, max_tokens=20, temperature=0,
                                          stop=[" Paris"])
    assert cut.choices[0].message.content == "The capital of France is"
    assert cut.choices[0].finish_reason == "stop"
    streamed = serving.chat.completions.create(model=base, messages=QUESTION, max_tokens=20, temperature=0,
                                               stop=["France"], stream=True)
    chunks = [c.choices[0].delta.content for c in streamed if c.choices and c.choices[0].delta.content]
    assert "".join(chunks) == "The capital of "
    short = serving.chat.completions.create(model=base, messages=QUESTION, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
