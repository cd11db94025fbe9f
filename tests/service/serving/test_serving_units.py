"""The serving pieces that need no model: the embedded (SQLite) channel, and text deltas around stop sequences."""

from __future__ import annotations

import threading
import time

import pytest

from service.errors import TooManyRequests
from service.serving.channel import RedisChannel, SqliteChannel, presence_key, request_queue
from service.serving.replies import CHAT, Reply
from service.serving.waits import ServingWaits
from worker.serving.stream import TextDeltas


def test_sqlite_channel_pops_in_order_across_keys_and_times_out(tmp_path):
    channel = SqliteChannel(tmp_path / "serve.db")
    a, b = request_queue("org/a"), request_queue("org/b")
    assert a != b and channel.pop([a, b], 0.05) is None
    channel.push(a, {"n": 1}, ttl_s=60)
    channel.push(b, {"n": 2}, ttl_s=60)
    channel.push(a, {"n": 3}, ttl_s=60)
    assert [channel.pop([a, b], 1)[1]["n"] for _ in range(3)] == [1, 2, 3]
    assert channel.pop([b], 0.05) is None


def test_sqlite_channel_wakes_a_waiting_reader_and_drops_expired_messages(tmp_path):
    channel = SqliteChannel(tmp_path / "serve.db")
    channel.push("k", {"old": True}, ttl_s=0.01)
    time.sleep(0.05)
    threading.Timer(0.2, lambda: SqliteChannel(tmp_path / "serve.db").push("k", {"new": True}, ttl_s=60)).start()
    started = time.monotonic()
    assert channel.pop(["k"], 5)[1] == {"new": True}
    assert time.monotonic() - started < 2


@pytest.fixture(params=["sqlite", "redis"])
def channel(request, tmp_path):
    if request.param == "sqlite":
        return SqliteChannel(tmp_path / "serve.db")
    import redis

    from tests.conftest import REDIS_TEST_URL

    redis.Redis.from_url(REDIS_TEST_URL).flushdb()
    return RedisChannel(REDIS_TEST_URL, 5.0)


def test_many_messages_are_pushed_in_order_and_many_marks_looked_at_at_once(channel):
    """A serving worker sends a decode step's replies together and looks at every request's cancel mark in one
    call: the same lists and marks as one push or one look at a time."""
    channel.push_many([("r1", {"n": 1}), ("r2", {"n": 2}), ("r1", {"n": 3})], ttl_s=60)
    assert [channel.pop(["r1"], 1)[1]["n"] for _ in range(2)] == [1, 3]
    assert channel.pop(["r2"], 1)[1] == {"n": 2} and channel.pop(["r1", "r2"], 0.05) is None
    channel.mark_alive("c2", 60)
    channel.mark_alive("c3", 0.001)
    time.sleep(0.01)
    assert channel.alive_many(["c1", "c2", "c3"]) == [False, True, False]
    assert channel.alive_many([]) == []


def test_presence_expires(tmp_path):
    channel = SqliteChannel(tmp_path / "serve.db")
    key = presence_key("org/a")
    assert not channel.alive(key)
    channel.mark_alive(key, 0.2)
    assert channel.alive(key)
    time.sleep(0.3)
    assert not channel.alive(key)


@pytest.fixture(scope="module")
def tokenizer():
    from worker.toy.tiny_model import build_tokenizer

    return build_tokenizer()


def _feed(tokenizer, text: str, stops: list[str]) -> tuple[list[str], bool]:
    deltas = TextDeltas(tokenizer, stops)
    out = []
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if piece := deltas.add(token):
            out.append(piece)
        if deltas.stopped:
            return out, True
    return out + [deltas.flush()], False


def test_text_deltas_hold_back_a_possible_stop_and_never_send_it(tokenizer):
    out, stopped = _feed(tokenizer, "abcxyzdef", ["xyz"])
    assert stopped and "".join(out) == "abc" and not any("x" in piece for piece in out)
    out, stopped = _feed(tokenizer, "abxyd", ["xyz"])  # "xy" looked like the stop, then was not
    assert not stopped and "".join(out) == "abxyd"


def test_text_deltas_without_stops_send_each_token(tokenizer):
    out, _ = _feed(tokenizer, "hello", [])
    assert out[:5] == list("hello")


def test_usage_sums_every_choice():
    reply = Reply(CHAT, "m")
    whole = reply.whole([{"type": "start", "prompt_tokens": 7, "choices": 2},
                         {"type": "delta", "index": 1, "text": "b"}, {"type": "delta", "index": 0, "text": "a"},
                         {"type": "finish", "index": 0, "reason": "stop", "tokens": 2},
                         {"type": "finish", "index": 1, "reason": "length", "tokens": 3}])
    assert [c["message"]["content"] for c in whole["choices"]] == ["a", "b"]
    assert whole["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def test_a_project_holds_at_most_its_share_of_the_serving_waits_and_all_at_most_the_total():
    waits = ServingWaits(total=5, per_project=3)
    for _ in range(3):
        waits.hold("alpha")
    with pytest.raises(TooManyRequests) as refused:
        waits.hold("alpha")
    assert refused.value.code == "serving_quota_exceeded" and "CISPO_SERVE_MAX_WAITING_PER_PROJECT" in str(refused.value)
    waits.hold("beta")  # another tenant still has room
    waits.hold("beta")
    with pytest.raises(TooManyRequests) as busy:
        waits.hold("gamma")
    assert busy.value.code == "serving_busy"
    waits.release("alpha")
    waits.hold("gamma")  # a place given back is taken again
    assert dict(waits.held) == {"alpha": 2, "beta": 2, "gamma": 1}
