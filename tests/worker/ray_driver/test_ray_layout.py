"""Who is which rank on Ray (torchrun's variables from where the actors landed), and the file bundles that
carry a job's files to the ranks (no shared filesystem). Pure functions: no Ray needed."""

from __future__ import annotations

import pytest

from worker.ray_driver.files import pack, unpack, unpack_dir
from worker.ray_driver.layout import rank_envs


def test_cpu_ranks_are_numbered_node_by_node_with_rank_0_as_master():
    places = [{"node": "a", "ip": "10.0.0.1", "gpus": []}, {"node": "b", "ip": "10.0.0.2", "gpus": []}]
    envs = rank_envs(places, 29500)
    assert envs == [
        {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
         "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"},
        {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
         "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1"},
    ]


def test_gpu_ranks_of_a_node_see_its_gpus_and_pick_their_own_by_local_rank():
    """Ray shows each actor only its own GPU; as under torchrun, a node's ranks see all of theirs instead."""
    places = [{"node": "a", "ip": "h1", "gpus": ["3"]}, {"node": "a", "ip": "h1", "gpus": ["1"]},
              {"node": "b", "ip": "h2", "gpus": ["0"]}, {"node": "b", "ip": "h2", "gpus": ["5"]}]
    envs = rank_envs(places, 1234)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,1", "3,1", "0,5", "0,5"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert {e["MASTER_ADDR"] for e in envs} == {"h1"} and {e["WORLD_SIZE"] for e in envs} == {"4"}


def test_files_travel_whole_and_never_outside_the_root(tmp_path):
    ckpt = tmp_path / "step-00000001"
    (ckpt / "adapter").mkdir(parents=True)
    (ckpt / "adapter" / "a.safetensors").write_bytes(b"\x00\x01")
    (ckpt / "manifest.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"x": 1}\n')
    files = pack({"run/checkpoints/step-00000001": ckpt, "data/train.jsonl": tmp_path / "train.jsonl"})
    assert set(files) == {"run/checkpoints/step-00000001/adapter/a.safetensors",
                          "run/checkpoints/step-00000001/manifest.json", "data/train.jsonl"}
    unpack(files, tmp_path / "rank")
    assert (tmp_path / "rank" / "run/checkpoints/step-00000001/adapter/a.safetensors").read_bytes() == b"\x00\x01"
    moved = unpack_dir(pack({".": ckpt}), tmp_path / "driver" / "step-00000001")
    assert sorted(p.name for p in moved.rglob("*") if p.is_file()) == ["a.safetensors", "manifest.json"]
    assert [p.name for p in (tmp_path / "driver").iterdir()] == ["step-00000001"]  # no staging left behind
    for bad in ("../escape", "/etc/passwd", "a/../../b"):
        with pytest.raises(ValueError, match="not relative"):
            unpack({bad: b""}, tmp_path / "rank")
