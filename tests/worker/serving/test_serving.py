"""Serving through the OpenAI SDK, for real: a uvicorn API process, Redis, PostgreSQL, a local object store and a
`cispo serve` worker process keeping the tiny base resident; a fine-tuned model with two kept checkpoints.

Greedy answers must equal what the base plus the checkpoint's adapter generates in this process; another
project sees nothing; bad fields are 400s naming the field; a base no worker serves is a 503 with Retry-After.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import redis

from service.db.session import session_factory
from service.repositories import projects
from service.serving.channel import presence_key
from tests.service.api.conftest import jsonl
from tests.service.api.live_server import live_api
from tests.conftest import REDIS_TEST_URL
from tests.processes import survivors, tagged
from tests.worker.serving.served import local_greedy, random_adapter_checkpoint, record_training

CHAT = [{"role": "user", "content": "Say abc"}]
UNSERVED_BASE = "org/no-worker-serves-this"
ACCEPT_TIMEOUT_S = 8


class Served:
    def __init__(self, api, model_dir, ft_model, checkpoints, other_key, log):
        self.api, self.model_dir, self.ft_model, self.checkpoints = api, model_dir, ft_model, checkpoints
        self.other_key, self.log = other_key, log

    def sdk(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(api_key=key or self.api.key, base_url=f"{self.api.base}/v1", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served(tmp_path_factory, toy_dir):
    redis.Redis.from_url(REDIS_TEST_URL).flushdb()
    root = tmp_path_factory.mktemp("serving")
    model_dir = toy_dir / "model"
    env = {"CISPO_MODEL_DIRS": str(toy_dir), "CISPO_SERVE_BASE_MODELS": UNSERVED_BASE,
           "CISPO_SERVE_ACCEPT_TIMEOUT_S": str(ACCEPT_TIMEOUT_S), "CISPO_RATE_LIMIT_BURST": "1000"}
    with live_api(root, **env) as api:
        with api.client() as http:
            f = http.post("/v1/files", files={"file": ("t.jsonl", jsonl([{"prompt": "Say a", "answer": "a"}] * 4))},
                          data={"purpose": "fine-tune"}).json()["id"]
            job = http.post("/v1/fine_tuning/jobs", json={
                "model": str(model_dir), "training_file": f, "suffix": "served",
                "method": {"type": "cispo", "cispo": {"reward": {"type": "exact_match", "field": "answer"}}}})
            assert job.status_code == 200, job.text
            job_id = job.json()["id"]
        local = {step: random_adapter_checkpoint(model_dir, root / "local", step=step, seed=step) for step in (1, 2)}
        ids = record_training(api.database_url, api.store, job_id, local)
        with api.client() as http:
            ft_model = http.get(f"/v1/fine_tuning/jobs/{job_id}").json()["fine_tuned_model"]
        with session_factory(api.database_url)() as s:
            other_key = projects.create_key(s, projects.get_or_create_project(s, "beta"))
            s.commit()
        # One adapter kept at a time: switching checkpoints evicts and reloads.
        worker_env, tag = tagged({**api.env, "CISPO_SERVE_ADAPTERS_CACHED": "1"})
        log = (root / "serve.log").open("w")
        worker = subprocess.Popen([sys.executable, "-m", "worker.cli", "serve", "--model", str(model_dir)],
                                  env=worker_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not redis.Redis.from_url(REDIS_TEST_URL).exists(presence_key(str(model_dir))):
                assert worker.poll() is None, (root / "serve.log").read_text()
                assert time.monotonic() < deadline, "the serving worker did not come up"
                time.sleep(0.2)
            yield Served(api, model_dir, ft_model, {step: (ids[step], local[step]) for step in ids}, other_key,
                         root / "serve.log")
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(20)
            except subprocess.TimeoutExpired:
                worker.kill()
            log.close()
            print((root / "serve.log").read_text()[-3000:])
            assert not survivors(tag)


def test_chat_completion_of_a_fine_tuned_model_is_what_base_plus_adapter_generate(served):
    expected = local_greedy(served.model_dir, served.checkpoints[2][1] / "adapter", CHAT, 12)
    base = local_greedy(served.model_dir, None, CHAT, 12)
    assert expected["text"] != base["text"]  # the adapter matters, so the comparison means something
    r = served.sdk().chat.completions.create(model=served.ft_model, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == served.ft_model and r.id.startswith("chatcmpl-")
    assert [c.message.content for c in r.choices] == [expected["text"]]
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == expected["finish_reason"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (expected["prompt_tokens"],
                                                                  expected["completion_tokens"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_completion_arrives_in_chunks_ending_with_done(served):
    expected = local_greedy(served.model_dir, served.checkpoints[2][1] / "adapter", CHAT, 12)
    stream = served.sdk().chat.completions.create(model=served.ft_model, messages=CHAT, max_tokens=12,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text_chunks = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(text_chunks) == expected["text"] and len(text_chunks) > 1  # token by token, not one blob
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected["finish_reason"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected["completion_tokens"]
    # On the wire: server-sent events, the last one OpenAI's terminator.
    with httpx.Client(base_url=served.api.base, headers={"Authorization": f"Bearer {served.api.key}"},
                      timeout=60) as http:
        raw = http.post("/v1/chat/completions", json={"model": served.ft_model, "messages": CHAT, "max_tokens": 3,
                                                      "temperature": 0, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_any_kept_checkpoint_is_served_by_name_and_by_id(served):
    ckpt_id, local = served.checkpoints[1]
    expected = local_greedy(served.model_dir, local / "adapter", CHAT, 10)
    sdk = served.sdk()
    for model in (f"{served.ft_model}:ckpt-step-1", ckpt_id):
        r = sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == expected["text"], model
    # And back to the final checkpoint, whose adapter was evicted meanwhile (one kept) and loads again.
    final = local_greedy(served.model_dir, served.checkpoints[2][1] / "adapter", CHAT, 10)
    assert final["text"] != expected["text"]
    r = sdk.chat.completions.create(model=served.ft_model, messages=CHAT, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == final["text"]


def test_completions_on_the_base_the_project_trained(served):
    expected = local_greedy(served.model_dir, None, "abc", 8)
    r = served.sdk().completions.create(model=str(served.model_dir), prompt="abc", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == expected["text"]
    assert r.usage.prompt_tokens == expected["prompt_tokens"]
    stream = served.sdk().completions.create(model=str(served.model_dir), prompt="abc", max_tokens=8,
                                             temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected["text"]


def test_sampling_with_a_seed_repeats_and_n_gives_distinct_choices(served):
    sdk = served.sdk()
    ask = dict(model=served.ft_model, messages=CHAT, max_tokens=10, temperature=1.0, seed=11, n=3)
    first, again = (sdk.chat.completions.create(**ask) for _ in range(2))
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1


def test_stop_sequences_cut_the_text_before_them(served):
    full = local_greedy(served.model_dir, served.checkpoints[2][1] / "adapter", CHAT, 12)["text"]
    cut = next(i for i in range(1, len(full) - 1) if full.find(full[i:i + 2]) == i)  # its first occurrence
    stop = [full[cut:cut + 2], "\u2603never"]
    sdk = served.sdk()
    r = sdk.chat.completions.create(model=served.ft_model, messages=CHAT, max_tokens=12, temperature=0, stop=stop)
    assert r.choices[0].message.content == full[:cut] and r.choices[0].finish_reason == "stop"
    # Streamed, the stop sequence's first character is held back until the next token shows it is one.
    chunks = sdk.chat.completions.create(model=served.ft_model, messages=CHAT, max_tokens=12, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full[:cut]


def test_another_project_cannot_call_the_model_or_its_base(served):
    other = served.sdk(served.other_key)
    for model in (served.ft_model, served.checkpoints[1][0], str(served.model_dir)):
        with pytest.raises(openai.NotFoundError) as e:
            other.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
        assert e.value.body["param"] == "model"
    with pytest.raises(openai.AuthenticationError):
        served.sdk("sk-wrong").chat.completions.create(model=served.ft_model, messages=CHAT)


@pytest.mark.parametrize("field, value", [
    ("temperature", 5), ("n", 0), ("max_tokens", 0), ("top_p", 0), ("logprobs", True), ("messages", []),
    ("stop", ["a", "b", "c", "d", "e"]), ("max_tokens", 100000), ("seed", 2**70), ("seed", -(2**63) - 1),
])
def test_a_bad_field_is_a_400_naming_it(served, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        served.sdk().chat.completions.create(**{"model": served.ft_model, "messages": CHAT, field: value})
    assert e.value.status_code == 400 and e.value.body["param"] == field, e.value.body


def test_a_prompt_longer_than_the_model_takes_is_a_400_and_the_default_length_fits(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.sdk().completions.create(model=served.ft_model, prompt="a" * 300, max_tokens=4)
    assert e.value.body["param"] == "prompt" and "256" in e.value.body["message"]
    # Without max_tokens the default (16) is cut to what the prompt leaves: 250 characters + <s> leave 5.
    r = served.sdk().completions.create(model=served.ft_model, prompt="a" * 250)
    assert r.usage.prompt_tokens == 251 and 1 <= r.usage.completion_tokens <= 5


def test_text_no_tokenizer_encodes_is_a_400_naming_the_field(served):
    # Raw bodies: a client's encoder may refuse a lone surrogate itself; the escape in JSON is what arrives.
    model = served.ft_model.encode()
    with served.api.client() as http:
        for route, body, where in (
                ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "ok \\ud800"}]}',
                 "messages[0].content"),
                ("/v1/completions", b'{"model": "%s", "prompt": ["a", "\\udfff"]}', "prompt[1]")):
            r = http.post(route, content=body.replace(b"%s", model), headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == where and "lone UTF-16 surrogate" in error["message"], error
        r = http.post("/v1/completions", content=b'{"model": "%s", "prompt": "pair \\ud83d\\ude00", "max_tokens": 1}'
                      .replace(b"%s", model), headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text  # a pair is a character


def test_json_nested_past_the_parser_is_a_400_on_every_route(served):
    deep = b"[" * 100_000 + b"]" * 100_000
    with served.api.client() as http:
        for route, body in (("/v1/chat/completions", b'{"model": "m", "messages": ' + deep + b"}"),
                            ("/v1/completions", b'{"model": "m", "prompt": ' + deep + b"}"),
                            ("/v1/fine_tuning/jobs", b'{"model": "m", "training_file": ' + deep + b"}"),
                            ("/v1/evals", b'{"model": "m", "file": ' + b"1" * 5000 + b"}")):
            r = http.post(route, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (route, r.text)
            error = r.json()["error"]
            assert error["code"] == "invalid_json" and "not valid JSON for this service" in error["message"], error


def test_a_prompt_too_long_in_characters_is_refused_before_it_is_tokenized(served):
    # The tiny model takes 256 tokens: no text of more than 256 * 16 characters fits, whatever its tokens.
    words = "lorem ipsum dolor sit amet " * 120_000  # 3.2 MB: tokenizing it took the worker 21 s here
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        served.sdk().chat.completions.create(model=served.ft_model, messages=[{"role": "user", "content": words}])
    assert e.value.body["param"] == "messages" and f"{len(words)} characters" in e.value.body["message"]
    assert time.monotonic() - started < 8  # under 3 s at a load average of 13: the body through API and channel
    with pytest.raises(openai.BadRequestError) as e:
        served.sdk().completions.create(model=served.ft_model, prompt="a" * (256 * 16 + 1), max_tokens=1)
    assert e.value.body["param"] == "prompt" and "4097 characters" in e.value.body["message"], e.value.body
    r = served.sdk().completions.create(model=served.ft_model, prompt="a" * 250)  # what fits still runs
    assert r.usage.prompt_tokens == 251


def test_a_base_no_worker_serves_is_a_503_with_retry_after(served):
    with httpx.Client(base_url=served.api.base, headers={"Authorization": f"Bearer {served.api.key}"},
                      timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"model": UNSERVED_BASE, "messages": CHAT})
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
    assert "cispo serve" in r.json()["error"]["message"]


def test_a_worker_that_never_takes_the_request_is_a_503_after_the_accept_timeout(served):
    # A worker announced for the base that never pops its queue (hung, or busy for good).
    redis.Redis.from_url(REDIS_TEST_URL).set(presence_key(UNSERVED_BASE), "1", ex=60)
    started = time.monotonic()
    with httpx.Client(base_url=served.api.base, headers={"Authorization": f"Bearer {served.api.key}"},
                      timeout=60) as http:
        r = http.post("/v1/completions", json={"model": UNSERVED_BASE, "prompt": "a"})
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
    assert "within" in r.json()["error"]["message"]
    assert ACCEPT_TIMEOUT_S <= time.monotonic() - started < ACCEPT_TIMEOUT_S + 10


def test_an_abandoned_stream_stops_decoding_at_its_next_token(served):
    """A client that reads the first chunk of a long stream and hangs up: the worker stops decoding it (one look
    at the cancel mark per token) instead of decoding every choice to its end for nobody."""
    seen = served.log.read_text().count("its caller hung up")
    body = {"model": served.ft_model, "prompt": "a", "max_tokens": 200, "n": 8, "temperature": 1.0, "seed": 3,
            "stream": True}
    with httpx.Client(base_url=served.api.base, headers={"Authorization": f"Bearer {served.api.key}"},
                      timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first chunk, then the connection closes
    deadline = time.monotonic() + 30
    while served.log.read_text().count("its caller hung up") == seen:
        assert time.monotonic() < deadline, served.log.read_text()[-2000:]
        time.sleep(0.1)
    stopped = served.log.read_text().split("its caller hung up; stopped after ")[-1].split(" tokens")[0]
    assert int(stopped) < 8 * 200
    r = served.sdk().completions.create(model=served.ft_model, prompt="a", max_tokens=3, temperature=0)
    assert r.choices[0].text is not None  # the worker goes on serving


def test_waiting_chats_hold_no_api_thread_and_one_project_holds_at_most_its_share(served):
    """More chats than the API has threads (40), all waiting on a worker that never takes them: another
    tenant's job list still answers at once, one project's waits stop at its cap (64, then 429), and another
    project may still wait."""
    redis.Redis.from_url(REDIS_TEST_URL).set(presence_key(UNSERVED_BASE), "1", ex=60)
    results: list[httpx.Response] = []

    def chat(key: str) -> None:
        with httpx.Client(base_url=served.api.base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as h:
            results.append(h.post("/v1/chat/completions", json={"model": UNSERVED_BASE, "messages": CHAT}))

    threads = [threading.Thread(target=chat, args=(served.api.key,)) for _ in range(70)]
    for t in threads:
        t.start()
    time.sleep(2)  # all of them sent and waiting
    other = threading.Thread(target=chat, args=(served.other_key,))
    other.start()
    with httpx.Client(base_url=served.api.base, headers={"Authorization": f"Bearer {served.other_key}"},
                      timeout=60) as http:
        took = []
        for _ in range(5):
            started = time.monotonic()
            assert http.get("/v1/fine_tuning/jobs").status_code == 200
            took.append(time.monotonic() - started)
    for t in threads + [other]:
        t.join(60)
    assert max(took) < 2.0, took  # not behind the waits (an API thread each: about the accept timeout)
    codes = sorted(r.status_code for r in results)
    refused = [r for r in results if r.status_code == 429]
    assert codes.count(503) == 64 + 1 and len(refused) == 70 - 64, codes  # the other project waited its turn
    assert refused[0].json()["error"]["code"] == "serving_quota_exceeded" and int(refused[0].headers["retry-after"]) >= 1
