"""A serving worker that keeps several adapters loaded (CISPO_SERVE_ADAPTERS_CACHED >= 2, the default 8) answers
each request with the adapter it names, not with whichever was loaded first or last: requests alternate between
checkpoints of two projects' fine-tuned models, with the cache holding both and, later, evicting one, and every
answer equals what the base plus that checkpoint's adapter generates greedily in this process.

The worker's own path end to end, in this process: the request built by the API's parser, the checkpoints uploaded
as a worker uploads them and fetched from the object store, the answer streamed by worker/serving/answer.py."""

from __future__ import annotations

import pytest

from service.serving import requests
from service.serving.targets import Target
from service.storage import LocalStore
from worker.checkpoints.artifacts import upload_checkpoint
from worker.serving.answer import Cancelled, answer
from worker.serving.engine import ResidentModel

from tests.worker.serving.served import local_greedy, random_adapter_checkpoint

CHAT = [{"role": "user", "content": "Say abc"}]
MAX_NEW = 10


@pytest.fixture(scope="module")
def checkpoints(toy_dir, tmp_path_factory):
    """Two checkpoints each of two projects' jobs, uploaded: {(project, step): (wire checkpoint, local dir)}."""
    root = tmp_path_factory.mktemp("switching")
    store = LocalStore(root / "store")
    found = {}
    for k, project in enumerate(("alpha", "beta")):
        for step in (1, 2):
            local = random_adapter_checkpoint(toy_dir / "model", root / project, step=step, seed=10 * k + step)
            prefix, files = upload_checkpoint(store, f"ftjob-{project}", 1, local)
            found[project, step] = ({"id": f"ftckpt-{project}-{step}", "prefix": prefix, "files": files}, local)
    return store, root, found


def _served(resident: ResidentModel, base: str, checkpoint: dict) -> str:
    parsed = requests.parse(requests.ChatRequest, {"model": "ft:any", "messages": CHAT, "max_tokens": MAX_NEW,
                                                   "temperature": 0})
    message = {"target": Target(base, checkpoint).wire(), "prompts": requests.prompts(parsed),
               "sampling": requests.sampling(parsed)}
    sent = []
    answer(resident, message, lambda **m: sent.append(m))
    assert not [m for m in sent if m["type"] == "error"], sent
    return "".join(m["text"] for m in sent if m["type"] == "delta")


@pytest.mark.parametrize("cached", [2, 8])
def test_alternating_requests_are_answered_by_the_adapter_each_names(toy_dir, checkpoints, cached):
    store, root, found = checkpoints
    base = str(toy_dir / "model")
    expected = {key: local_greedy(toy_dir / "model", local / "adapter", CHAT, MAX_NEW)["text"]
                for key, (_, local) in found.items()}
    assert len(set(expected.values())) == len(expected), expected  # each adapter answers its own way
    resident = ResidentModel(base, store=store, scratch=root / f"scratch-{cached}", max_adapters=cached)
    # alpha and beta back and forth with both kept, then the others joining (with 2 kept: evictions), and back
    order = [("alpha", 2), ("beta", 2), ("alpha", 2), ("beta", 2), ("beta", 1), ("alpha", 1), ("alpha", 2),
             ("beta", 2), ("alpha", 1)]
    for key in order:
        assert _served(resident, base, found[key][0]) == expected[key], key
    assert len(resident.adapters) == min(cached, len(found))


def test_a_request_whose_caller_hung_up_stops_at_the_next_decode_step(toy_dir, checkpoints):
    store, root, found = checkpoints
    resident = ResidentModel(str(toy_dir / "model"), store=store, scratch=root / "scratch-cancel", max_adapters=1)
    parsed = requests.parse(requests.ChatRequest, {"model": "ft:any", "messages": CHAT, "max_tokens": 50, "n": 3,
                                                   "temperature": 1, "seed": 1})
    message = {"target": Target(str(toy_dir / "model"), found["alpha", 1][0]).wire(),
               "prompts": requests.prompts(parsed), "sampling": requests.sampling(parsed)}
    looks = []

    def cancelled() -> bool:  # the caller hangs up after the 3rd decode step
        looks.append(1)
        return len(looks) > 3

    sent = []
    with pytest.raises(Cancelled) as e:
        answer(resident, message, lambda **m: sent.append(m), cancelled=cancelled)
    assert len(looks) == 4  # one look per decode step (for all 3 choices): nothing more was decoded once it was gone
    finished = {m["index"]: m["tokens"] for m in sent if m["type"] == "finish"}
    decoded = sum(finished.values()) + 3 * (3 - len(finished))  # the 3 choices decode together, 3 steps each
    assert str(e.value) == f"after {decoded} tokens"
    assert not [m for m in sent if m["type"] == "end"]
