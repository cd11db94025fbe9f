"""`cispo up` serves too: on the embedded default (SQLite channel, no Redis) its serving worker loads the base
a request names and answers through the OpenAI SDK; an idle stop still takes about a second."""

from __future__ import annotations

import openai

from tests.e2e.up import Up
from tests.worker.serving.served import local_greedy


def test_up_serves_an_allowed_base_over_the_embedded_channel(tmp_path, toy_dir):
    with Up(tmp_path, toy_dir) as up:
        base = str(toy_dir / "model")
        up.env.update(CISPO_SERVE_BASE_MODELS=base, CISPO_SERVE_ACCEPT_TIMEOUT_S="120")
        up.cli("db", "upgrade")
        key = up.cli("keys", "create", "--project", "alpha")
        up.start()
        sdk = openai.OpenAI(api_key=key, base_url=f"http://127.0.0.1:{up.port}/v1", max_retries=0, timeout=300)
        expected = local_greedy(toy_dir / "model", None, "abc", 8)
        r = sdk.completions.create(model=base, prompt="abc", max_tokens=8, temperature=0)
        assert r.choices[0].text == expected["text"] and r.usage.prompt_tokens == expected["prompt_tokens"]
        chunks = sdk.completions.create(model=base, prompt="abc", max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == expected["text"]
        up.stop_idle()
