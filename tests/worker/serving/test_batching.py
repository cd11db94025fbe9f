"""A serving worker decodes the requests it holds together: one forward per decode step over every running row,
each row through its own project's adapter, and every answer what that request decoded alone gives.

The worker runs in this process on the embedded channel (the API's own queues and reply lists, on SQLite), with
four projects' fine-tuned adapters uploaded as a worker uploads them; what its model is fed is recorded by a hook
on the embedding (rows and adapters per forward)."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections import defaultdict

import pytest

from service.serving import requests
from service.serving.channel import ANY_BASE, PREFIX, SqliteChannel, cancel_key, request_queue
from service.serving.targets import Target
from service.settings import Settings
from service.storage import LocalStore
from worker.checkpoints.artifacts import upload_checkpoint
from worker.serving.answer import answer
from worker.serving.engine import ResidentModel
from worker.serving.server import ServingWorker

from tests.worker.serving.served import random_adapter_checkpoint

PROJECTS = ("alpha", "beta", "gamma", "delta")
PROMPTS = ("Say abc", "Say cab", "Spell bca", "Say a b c")


class WatchedChannel(SqliteChannel):
    """The embedded channel, keeping every reply message in the order sent, with a hook run on each."""

    def __init__(self, path):
        super().__init__(path)
        self.sent: list[tuple[str, dict]] = []
        self.on_reply = lambda reply, message: None

    def push(self, key: str, message: dict, ttl_s: float) -> None:
        super().push(key, message, ttl_s)
        self._sent(key, message)

    def _sent(self, key: str, message: dict) -> None:
        if key.startswith(f"{PREFIX}:reply:"):
            self.sent.append((key, message))
            self.on_reply(key, message)

    def push_many(self, messages: list[tuple[str, dict]], ttl_s: float) -> None:
        super().push_many(messages, ttl_s)
        for key, message in messages:
            self._sent(key, message)

    def replies(self, reply: str) -> list[dict]:
        return [m for k, m in self.sent if k == reply]


@pytest.fixture(scope="module")
def adapters(toy_dir, tmp_path_factory):
    """One fine-tuned checkpoint per project, uploaded: (store root, {project: wire checkpoint})."""
    root = tmp_path_factory.mktemp("batching")
    store = LocalStore(root / "store")
    found = {}
    for k, project in enumerate(PROJECTS):
        local = random_adapter_checkpoint(toy_dir / "model", root / project, step=1, seed=100 + k)
        prefix, files = upload_checkpoint(store, f"ftjob-{project}", 1, local)
        found[project] = {"id": f"ftckpt-{project}-1", "prefix": prefix, "files": files}
    return root, found


def _request(base: str, checkpoint: dict | None, prompt: str, **fields) -> dict:
    parsed = requests.parse(requests.ChatRequest, {"model": "ft:any", "messages": [{"role": "user", "content": prompt}],
                                                   "temperature": 0, **fields})
    return {"target": Target(base, checkpoint).wire(), "prompts": requests.prompts(parsed),
            "sampling": requests.sampling(parsed)}


def _alone(resident: ResidentModel, request: dict) -> list[dict]:
    sent = []
    answer(resident, request, lambda **m: sent.append(m))
    return _outcome(sent)


def _outcome(messages: list[dict]) -> list[dict]:
    """Per choice: its text, finish reason and token count."""
    texts, ends = defaultdict(str), {}
    for m in messages:
        if m["type"] == "delta":
            texts[m["index"]] += m["text"]
        elif m["type"] == "finish":
            ends[m["index"]] = (m["reason"], m["tokens"])
    return [{"text": texts[i], "reason": ends[i][0], "tokens": ends[i][1]} for i in sorted(ends)]


class Worker:
    """A ServingWorker on `base` in a thread, its model's forwards recorded: (rows, rows' adapters, tokens per row)."""

    def __init__(self, root, base: str, tmp_path, *, adapters_kept: int = 8):
        self.base = base
        self.channel = WatchedChannel(tmp_path / "serve.db")
        settings = Settings(home=tmp_path / "home", work_dir=tmp_path / "work", storage_url=str(root / "store"))
        self.worker = ServingWorker(settings, [base], channel=self.channel)
        resident = ResidentModel(base, store=self.worker.store, scratch=self.worker.scratch,
                                 max_adapters=adapters_kept)
        self.worker.residents[base] = resident  # the one it serves with (it loads a base only where none is)
        self.forwards: list[tuple[int, list[str | None] | None, int]] = []

        def record(module, args):
            ids = args[0]
            segments = getattr(getattr(resident, "router", None), "segments", None)
            names = None if segments is None else [name for name, start, end in segments for _ in range(end - start)]
            self.forwards.append((ids.shape[0], names, ids.shape[1]))
        resident.model.get_input_embeddings().register_forward_pre_hook(record)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def push(self, request: dict) -> str:
        reply = f"{PREFIX}:reply:{uuid.uuid4().hex}"
        self.channel.push(request_queue(self.base), {**request, "reply": reply, "deadline": time.time() + 120},
                          ttl_s=120)
        return reply

    def ended(self, replies: list[str], timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(any(m["type"] == "end" for m in self.channel.replies(r)) for r in replies):
            assert self.thread.is_alive() and time.monotonic() < deadline, self.channel.sent[-5:]
            time.sleep(0.05)

    def steps(self) -> list[tuple[int, list[str | None] | None]]:
        """(rows, their adapters) of each decode forward (one new token a row)."""
        return [(rows, names) for rows, names, width in self.forwards if width == 1]

    def close(self) -> None:
        self.worker.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def worker(adapters, toy_dir, tmp_path, request):
    root, _ = adapters
    w = Worker(root, str(toy_dir / "model"), tmp_path, **getattr(request, "param", {}))
    yield w
    w.close()


@pytest.fixture(scope="module")
def alone(adapters, toy_dir):
    """A resident of its own, for what each request decoded alone gives."""
    root, _ = adapters
    return ResidentModel(str(toy_dir / "model"), store=LocalStore(root / "store"), scratch=root / "alone",
                         max_adapters=8)


def test_sixteen_streams_of_four_projects_decode_together_each_as_alone(worker, adapters, alone):
    _, found = adapters
    sampled = {"temperature": 1.0, "top_p": 0.9, "n": 2}  # seeded: the same draws whatever shares the batch
    asked = [_request(worker.base, found[project], PROMPTS[i], max_tokens=12, **(
             {**sampled, "seed": 7 + k} if i == 3 else {})) for i in range(4) for k, project in enumerate(PROJECTS)]
    replies = [worker.push(r) for r in asked]
    worker.thread.start()
    worker.ended(replies)
    for request, reply in zip(asked, replies):
        assert _outcome(worker.channel.replies(reply)) == _alone(alone, request), reply
    steps = worker.steps()
    assert max(rows for rows, _ in steps) == 12 + 4 * 2  # all sixteen requests' choices in one forward
    assert len(steps) <= 2 * 12  # one forward per step for all rows; alone, one per token of each: 16 * 12
    assert set().union(*(names for _, names in steps)) == {found[p]["id"] for p in PROJECTS}  # each its adapter


def test_an_abandoned_stream_leaves_the_batch_at_the_next_step_while_the_others_go_on(worker, adapters, alone):
    _, found = adapters
    asked = {p: _request(worker.base, found[p], PROMPTS[0], max_tokens=30, **({"n": 2} if p == "delta" else {}))
             for p in PROJECTS}
    replies = {p: worker.push(r) for p, r in asked.items()}
    gone, marked_at = found["delta"]["id"], []

    def hang_up(reply: str, message: dict) -> None:  # delta's caller leaves at its first text, all four running
        if reply == replies["delta"] and message["type"] == "delta" and not marked_at and all(
                any(m["type"] == "start" for m in worker.channel.replies(r)) for r in replies.values()):
            worker.channel.mark_alive(cancel_key(reply), 60)
            marked_at.append(len(worker.forwards))
    worker.channel.on_reply = hang_up
    worker.thread.start()
    worker.ended([replies[p] for p in PROJECTS if p != "delta"])
    assert marked_at
    mark = marked_at[0]
    _, names, _ = worker.forwards[mark]  # the step's forward the mark came too late for: delta beside the others
    assert names.count(gone) == 2 and len(set(names)) > 1
    assert all(gone not in names for _, names, _ in worker.forwards[mark + 1:])  # gone from the next step on
    assert any(rows >= 3 for rows, _, _ in worker.forwards[mark + 1:])  # while the others decoded on
    assert not [m for m in worker.channel.replies(replies["delta"]) if m["type"] in ("finish", "end")]
    for p in PROJECTS[:3]:
        assert _outcome(worker.channel.replies(replies[p])) == _alone(alone, asked[p]), p


def test_a_request_arriving_mid_decode_joins_the_running_batch(worker, adapters, alone):
    _, found = adapters
    first = _request(worker.base, found["alpha"], PROMPTS[0], max_tokens=30)
    later = _request(worker.base, found["beta"], PROMPTS[1], max_tokens=8)
    expected_first = _alone(alone, first)
    assert expected_first[0]["tokens"] > 6  # still decoding when the second arrives
    replies = {"first": worker.push(first)}

    def arrive(reply: str, message: dict) -> None:  # after the first request's third piece of text
        if reply == replies["first"] and message["type"] == "delta" and "later" not in replies and sum(
                m["type"] == "delta" for m in worker.channel.replies(reply)) == 3:
            replies["later"] = worker.push(later)
    worker.channel.on_reply = arrive
    worker.thread.start()
    worker.ended([replies["first"]])
    worker.ended([replies["later"]])
    order = [(k, m["type"]) for k, m in worker.channel.sent]
    assert order.index((replies["later"], "delta")) < order.index((replies["first"], "end"))  # not after it
    assert any({found["alpha"]["id"], found["beta"]["id"]} <= set(names or ()) for _, names in worker.steps())
    assert _outcome(worker.channel.replies(replies["first"])) == expected_first
    assert _outcome(worker.channel.replies(replies["later"])) == _alone(alone, later)


@pytest.mark.parametrize("worker", [{"adapters_kept": 1}], indirect=True)
def test_an_adapter_a_running_request_uses_is_not_the_one_evicted(worker, adapters, alone):
    """One adapter kept, four requests on four adapters decoding together: each loaded adapter stays until no row
    uses it, so every request is answered through its own."""
    _, found = adapters
    asked = [_request(worker.base, found[p], PROMPTS[0], max_tokens=12) for p in PROJECTS]
    replies = [worker.push(r) for r in asked]
    worker.thread.start()
    worker.ended(replies)
    for request, reply in zip(asked, replies):
        assert _outcome(worker.channel.replies(reply)) == _alone(alone, request), reply
    assert max(len(set(names)) for _, names in worker.steps()) == 4  # all four adapters in one forward


def test_an_any_base_worker_finishes_the_running_batch_before_it_switches_base(adapters, toy_dir, tmp_path, alone):
    """Requests for the resident base, another base, and the first again: the other waits for the running batch to
    end, and the one taken after it waits for it in turn (no request for the resident base overtakes it)."""
    root, found = adapters
    base, other = str(toy_dir / "model"), tmp_path / "other-base"
    shutil.copytree(toy_dir / "model", other)  # the same weights under another name: another base to the worker
    channel = WatchedChannel(tmp_path / "serve.db")
    settings = Settings(home=tmp_path / "home", work_dir=tmp_path / "work", storage_url=str(root / "store"))
    worker = ServingWorker(settings, [], channel=channel)
    asked = [_request(base, found["alpha"], PROMPTS[0], max_tokens=12), _request(str(other), None, PROMPTS[1],
             max_tokens=6), _request(base, found["beta"], PROMPTS[2], max_tokens=12)]
    replies = []
    for request in asked:
        replies.append(f"{PREFIX}:reply:{uuid.uuid4().hex}")
        channel.push(request_queue(ANY_BASE), {**request, "reply": replies[-1], "deadline": time.time() + 120},
                     ttl_s=120)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 240
        while not all(any(m["type"] == "end" for m in channel.replies(r)) for r in replies):
            assert thread.is_alive() and time.monotonic() < deadline, channel.sent[-5:]
            time.sleep(0.05)
    finally:
        worker.stop.set()
        thread.join(30)
    order = [(k, m["type"]) for k, m in channel.sent]
    assert order.index((replies[0], "end")) < order.index((replies[1], "start"))
    assert order.index((replies[1], "end")) < order.index((replies[2], "start"))
    same_as_base = {**asked[1], "target": {**asked[1]["target"], "base": base}}
    for request, reply in zip([asked[0], same_as_base, asked[2]], replies):
        assert _outcome(channel.replies(reply)) == _alone(alone, request), reply
