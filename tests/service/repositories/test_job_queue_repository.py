"""The queue through the repository (service/repositories/job_queue.py): a base model's fair-share queue counts
that base's queued and running jobs only, and each queued job's place is read from the queue its worker takes it
from (fair share per base, or every queued job oldest first)."""

from __future__ import annotations

import time

import pytest

from service.db.models import Job
from service.db.session import session_factory
from service.repositories import job_queue, jobs, projects


@pytest.fixture
def queue(database_url):
    """(sessions, add): add(project name, status, model, created_at) -> job id."""
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        ids = {name: projects.get_or_create_project(s, name).id for name in ("a", "b", "c")}

    def add(project: str, status: str = "queued", model: str = "m", created_at: int = 100) -> str:
        with sessions.begin() as s:
            return jobs.add(s, Job(project_id=ids[project], status=status, model=model, training_file="file-t",
                                   spec={}, method={"type": "cispo"}, seed=1, total_steps=1,
                                   created_at=created_at)).id
    return sessions, add


def test_the_fair_queue_of_a_base_counts_its_own_queued_and_running_jobs(queue):
    sessions, add = queue
    add("a", "running")  # a already holds a slot of m: b goes first
    add("a", "running", model="m2")  # another base's slot: not counted
    add("b", "paused")  # holds no slot
    a1, a2 = add("a", created_at=10), add("a", created_at=11)
    b1, b2 = add("b", created_at=20), add("b", created_at=21)
    add("c", model="m2", created_at=1)  # another base's queue
    add("c", "succeeded", created_at=1)
    with sessions() as s:
        # turns (running + n) / weight: b1 1, a1 2, b2 2 (a1 older), a2 3
        assert job_queue.fair_queue(s, "m", {}) == [b1, a1, b2, a2]
        # b weighs 3: b1 1/3, b2 2/3, a1 2, a2 3
        assert job_queue.fair_queue(s, "m", {"b": 3.0}) == [b1, b2, a1, a2]
        assert job_queue.fair_queue(s, "m3", {}) == []


def test_the_fair_queue_counts_each_projects_running_jobs_and_takes_creation_time_before_insertion(queue):
    sessions, add = queue
    add("a", "running"), add("b", "running"), add("b", "running")  # a holds one slot, b two
    b1, c1, c2 = add("b", created_at=10), add("c", created_at=25), add("c", created_at=45)
    a1 = add("a", created_at=20)  # inserted last, created before both of c's (another API process; whole seconds)
    with sessions() as s:
        # turns: c1 1, a1 2 and c2 2 (a1 older), b1 3
        assert job_queue.fair_queue(s, "m", {}) == [c1, a1, c2, b1]


def test_the_waiting_jobs_of_a_base_are_its_fair_queue_less_those_in_backoff_with_their_specs(queue):
    sessions, add = queue
    add("a", "running")
    a1, b1, b2, b3 = add("a", created_at=10), add("b", created_at=20), add("b", created_at=21), add("b", created_at=22)
    add("c", model="m2", created_at=1)  # another base
    add("c", "paused", created_at=1)  # not queued
    with sessions.begin() as s:
        jobs.get_for_worker(s, b1).spec = {"model": "m", "seed": 7}
        jobs.get_for_worker(s, b2).not_before = time.time() + 300  # backing off: skipped, not waited for
        jobs.get_for_worker(s, a1).not_before = time.time() - 1  # its backoff has passed
    with sessions() as s:
        # fair order b1, a1, b2, b3; b2 waits out a backoff
        assert job_queue.waiting_of_base(s, "m", {}, limit=10) == [(b1, {"model": "m", "seed": 7}), (a1, {}),
                                                                   (b3, {})]
        assert job_queue.waiting_of_base(s, "m", {}, limit=3) == [(b1, {"model": "m", "seed": 7}), (a1, {})]
        assert job_queue.waiting_of_base(s, "m3", {}, limit=10) == []


def test_fair_places_are_per_base_and_only_for_queued_jobs(queue):
    sessions, add = queue
    add("a", "running")
    a1, b1, b2 = add("a", created_at=10), add("b", created_at=20), add("b", created_at=21)
    c1 = add("c", model="m2", created_at=30)
    running = add("c", "running", model="m2", created_at=5)
    with sessions() as s:
        listed = [jobs.get_for_worker(s, job_id) for job_id in (a1, b1, b2, c1, running)]
        assert job_queue.positions(s, listed, fair=True, weights={}) == {b1: 1, a1: 2, b2: 3, c1: 1}
        assert job_queue.positions(s, listed[3:], fair=True, weights={}) == {c1: 1}
        assert job_queue.positions(s, [], fair=True, weights={}) == {}


def test_plain_places_count_every_queued_job_ahead_oldest_first(queue):
    sessions, add = queue
    add("a", "running", created_at=1)
    first = add("b", model="m2", created_at=5)
    tied_older, tied_newer = add("a", created_at=7), add("c", created_at=7)  # the same second: seq decides
    last = add("a", created_at=9)
    done = add("b", "failed", created_at=2)
    with sessions() as s:
        listed = [jobs.get_for_worker(s, job_id) for job_id in (last, tied_newer, first, tied_older, done)]
        assert job_queue.positions(s, listed, fair=False, weights={}) == {
            first: 1, tied_older: 2, tied_newer: 3, last: 4}
