"""A job driven on a real two-node Ray cluster (no mocks): it trains as one process does, a cancel leaves no
rank running, a gang the cluster cannot grant leaves nothing held, and a node lost mid-job is NodeLost, after
which the job resumes from its checkpoint and finishes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from service.settings import Settings
from tests import specs
from tests.worker.ray_driver.conftest import pids_alive
from tests.worker.distributed.test_distributed import Recorder, job_spec

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

TRAINING = dict(steps=2, batch_size=2, group_size=4, mini_batches=1, micro_batch_size=4, checkpoint_interval=1)


def ray_spec(toy_dir: Path, nodes: int, **training):
    return specs.job_spec(job_spec(toy_dir, "lora", **{**TRAINING, **training}).model_dump(mode="json"),
                          resources={"nodes": nodes})


def _settings(cluster, **extra) -> Settings:
    return Settings(ray_address=cluster.address, **extra)


def _cpus_back(n: int, wait_s: float = 30.0) -> bool:
    """Whether the cluster's free CPUs return to n: a removed placement group's bundles come back asynchronously
    (None free CPUs was read right after a removal in a run at load ~4)."""
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU") != n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _actor_pids(*classes: str) -> list[int]:
    """The running processes of this cluster's Ray actors of `classes`, whatever their state in the GCS's actor
    table (an actor marked dead whose process still runs is a leak). The table, not a /proc scan by process title:
    other test modules run clusters of their own beside this one, and a scan by title and raylet ancestry once
    missed a rank that was running."""
    pids = {info["Pid"] for info in ray._private.state.actors().values()
            if info["ActorClassName"] in classes and info["Pid"]}
    return sorted(pids_alive(pids))


def _rank_pids() -> list[int]:
    """This cluster's running processes of rank actors and the channel's queues."""
    return _actor_pids("RankActor", "_QueueActor")


def test_two_nodes_train_as_one_process(toy_dir, tmp_path, two_nodes):
    """2 ranks on 2 Ray nodes (gloo) sample what 1 process samples and end with the same adapter (the bound of
    the FSDP tests); steps and checkpoints reach the driver's callbacks, the checkpoints' files in its run_dir."""
    from worker.ray_driver.driver import run_on_ray
    from worker.trainer.loop import Trainer

    calls = Recorder()
    result = run_on_ray(ray_spec(toy_dir, nodes=2), tmp_path / "ray", calls, settings=_settings(two_nodes))
    assert result.steps_done == 2 and not result.stopped
    assert [s for s, _ in calls.checkpoints] == [1, 2]
    assert result.last_checkpoint == tmp_path / "ray" / "checkpoints" / "step-00000002"
    assert (result.last_checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    assert any("on 2 Ray node(s)" in e for e in calls.events)

    one = Recorder()
    single = Trainer(job_spec(toy_dir, "lora", **TRAINING), tmp_path / "one").run(one)
    assert [s for s, _ in calls.steps] == [s for s, _ in one.steps] == [1, 2]
    for (_, m2), (_, m1) in zip(calls.steps, one.steps):
        assert (m2["reward_mean"], m2["completion_length_mean"]) == (m1["reward_mean"], m1["completion_length_mean"])
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-6)
    sharded = load_file(str(result.last_checkpoint / "adapter" / "adapter_model.safetensors"))
    expected = load_file(str(single.last_checkpoint / "adapter" / "adapter_model.safetensors"))
    assert sharded.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert _gone(_rank_pids())  # every rank of the job ended with it


def test_a_cancel_stops_at_a_step_boundary_and_leaves_no_rank_running(toy_dir, tmp_path, two_nodes):
    from worker.ray_driver.driver import run_on_ray

    class CancelAfterFirstStep(Recorder):
        pids: list[int] = []

        def on_step(self, step, metrics):
            super().on_step(step, metrics)
            self.pids = _rank_pids()  # the ranks and queues, alive mid-job

        def should_stop(self):
            return bool(self.steps)

    calls = CancelAfterFirstStep()
    result = run_on_ray(ray_spec(toy_dir, nodes=2, steps=3), tmp_path, calls, settings=_settings(two_nodes))
    assert result.stopped and result.steps_done == 1
    assert [s for s, _ in calls.checkpoints] == [1]  # the stop's checkpoint
    assert len(calls.pids) >= 2  # both ranks (and the queues) ran as processes
    assert _gone(calls.pids)
    assert _cpus_back(2)  # the placement group is removed


def test_a_gang_the_cluster_cannot_grant_is_gang_unavailable_holding_nothing(toy_dir, tmp_path, two_nodes):
    from worker.ray_driver.driver import run_on_ray
    from worker.ray_driver.errors import GangUnavailable, RayCapacity

    with pytest.raises(GangUnavailable, match="did not grant 3 node") as raised:
        run_on_ray(ray_spec(toy_dir, nodes=3, batch_size=3), tmp_path, Recorder(),
                   settings=_settings(two_nodes, ray_gang_timeout_s=5))
    assert isinstance(raised.value, RayCapacity)  # the job runner waits it out using no attempt
    assert _cpus_back(2)


def _gone(pids, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return not pids_alive(pids)


def test_a_cancel_while_the_job_waits_for_its_nodes_ends_the_wait(toy_dir, tmp_path, two_nodes):
    """The gang timeout is long; a stop request (cancel, pause, drain) ends the wait within a second or so."""
    from worker.ray_driver.driver import run_on_ray

    class CancelSoon(Recorder):
        asked_at = time.monotonic() + 2.0

        def should_stop(self):
            return time.monotonic() > self.asked_at

    calls = CancelSoon()
    result = run_on_ray(ray_spec(toy_dir, nodes=3, batch_size=3), tmp_path, calls,
                        settings=_settings(two_nodes, ray_gang_timeout_s=600))
    assert result.stopped and result.steps_done == 0 and result.last_checkpoint is None
    assert time.monotonic() - calls.asked_at < 30  # not the 600 s gang timeout
    assert calls.events == ["Waiting for 3 Ray node(s) x 1 CPU(s)"]
    assert _cpus_back(2)
