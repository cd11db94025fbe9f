"""Admission (service/api/access.py): at most `api_threads` /v1 requests inside the app at once.

Driven as raw ASGI with an app that blocks until the test lets it go, so each test can see who is inside
and who waits. The bound is what keeps threads and pooled connections from deadlocking at 200 pollers;
a request leaves at its response start (a slow download holds no place) or through leave_admission().
"""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from service.api.access import Admission

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _scope(places, path: str = "/v1/jobs", kind: str = "http") -> dict:
    return {"type": kind, "path": path, "app": SimpleNamespace(state=SimpleNamespace(admission=places))}


async def _receive():
    return {"type": "http.disconnect"}


class Gate:
    """An app that records who is inside and holds each request until `open` is set."""

    def __init__(self):
        self.inside, self.most, self.entered = 0, 0, 0
        self.open = anyio.Event()

    async def __call__(self, scope, receive, send):
        self.inside += 1
        self.entered += 1
        self.most = max(self.most, self.inside)
        try:
            await self.open.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        finally:
            self.inside -= 1


async def _sent(message):
    pass


async def test_no_more_than_the_places_are_inside_and_the_next_waits_until_one_leaves():
    places, gate = anyio.Semaphore(2), Gate()
    admission = Admission(gate)
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(admission, _scope(places), _receive, _sent)
        await anyio.wait_all_tasks_blocked()
        assert (gate.inside, gate.entered) == (2, 2)  # the third waits at the door, not in the app
        gate.open.set()
    assert (gate.entered, gate.most) == (3, 2)
    assert places.value == 2  # every place given back


async def test_a_request_leaves_at_its_response_start_so_a_slow_body_holds_no_place():
    places = anyio.Semaphore(1)
    body_may_go, second_in = anyio.Event(), anyio.Event()

    async def streaming(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await body_may_go.wait()  # a slow download
        await send({"type": "http.response.body", "body": b"ok"})

    async def quick(scope, receive, send):
        second_in.set()
        await send({"type": "http.response.start", "status": 200, "headers": []})

    starts: list[str] = []

    async def send(message):
        starts.append(message["type"])

    async with anyio.create_task_group() as tg:
        tg.start_soon(Admission(streaming), _scope(places), _receive, send)
        await anyio.wait_all_tasks_blocked()
        with anyio.fail_after(5):
            await Admission(quick)(_scope(places), _receive, send)  # gets the place while the body is held
        assert second_in.is_set()
        body_may_go.set()
    assert starts.count("http.response.start") == 2  # the messages still reach the server
    assert places.value == 1


async def test_leave_and_join_admission_give_the_place_back_once_and_take_it_again():
    places = anyio.Semaphore(1)
    seen: list[int] = []

    async def app(scope, receive, send):
        state = scope["state"]
        seen.append(places.value)  # 0: this request holds the only place
        state["leave_admission"]()
        state["leave_admission"]()  # a second leave must not free a place it no longer holds
        seen.append(places.value)
        await state["join_admission"]()
        seen.append(places.value)
        await state["join_admission"]()  # already inside: takes nothing more (it would wait forever)
        seen.append(places.value)

    with anyio.fail_after(5):
        await Admission(app)(_scope(places), _receive, _sent)
    assert seen == [0, 1, 0, 0]
    assert places.value == 1


async def test_a_failing_request_gives_its_place_back():
    places = anyio.Semaphore(1)

    async def failing(scope, receive, send):
        raise RuntimeError("route bug")

    with pytest.raises(RuntimeError):
        await Admission(failing)(_scope(places), _receive, _sent)
    assert places.value == 1


@pytest.mark.parametrize("path, kind", [("/healthz", "http"), ("/v1", "http"), ("/v1/jobs", "websocket")])
async def test_only_http_requests_under_v1_need_a_place(path, kind):
    places, gate = anyio.Semaphore(1), Gate()
    await places.acquire()  # every place taken
    gate.open.set()
    with anyio.fail_after(5):
        await Admission(gate)(_scope(places, path, kind), _receive, _sent)
    assert gate.entered == 1


async def test_without_the_lifespan_s_places_everyone_is_admitted():
    gate = Gate()
    gate.open.set()
    with anyio.fail_after(5):
        await Admission(gate)(_scope(None), _receive, _sent)
    assert gate.entered == 1


async def test_a_database_failure_during_authentication_is_503_and_logged_with_the_request(caplog):
    """The key lookup's OperationalError: a 503 to retry, and a log line naming what failed and why."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import sessionmaker

    from service.api.access import Authenticate
    from service.auth import PrincipalCache

    unreachable = sessionmaker(create_engine("sqlite:////nonexistent-dir/cispo.db"))
    gate = Gate()
    middleware = Authenticate(gate, reads=unreachable, writes=unreachable, limits=None,
                              principals=PrincipalCache(0))
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/v1/jobs", "headers": [(b"authorization", b"Bearer sk-x")]}
    await middleware(scope, _receive, send)
    assert gate.entered == 0
    start = sent[0]
    assert start["status"] == 503 and (b"retry-after", b"5") in start["headers"]
    [record] = [r for r in caplog.records if "database failure" in r.getMessage()]
    assert record.getMessage() == "database failure on GET /v1/jobs"
    assert isinstance(record.exc_info[1], OperationalError)
