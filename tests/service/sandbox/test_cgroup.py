"""Where sandbox cgroups go and what limits they get: v2 or v1, on a stand-in cgroup tree.

The kernel is the outer edge here: a directory of plain files stands for the
cgroup file system (this machine's v2 hierarchy has no memory controller, so
the v2 path cannot run for real; the v1 path does, in
tests/service/sandbox/test_kernel.py). What is checked is the decision: which
directory, the delegation step a non-root v2 cgroup needs, and the limit
files new_cgroup writes. The real OOM runs in test_sandbox_kernel.py
(test_memory_limit_covers_all_its_processes_together) on whichever version
the host offers: v2 where its hierarchy has the memory controller.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from service.sandbox import cgroup as sandbox_cgroup


def _v2_tree(root: Path, own: str, controllers: str, subtree: str, procs: str = "") -> Path:
    base = root / own.lstrip("/")
    base.mkdir(parents=True, exist_ok=True)
    (base / "cgroup.controllers").write_text(controllers + "\n")
    (base / "cgroup.subtree_control").write_text(subtree + "\n")
    (base / "cgroup.procs").write_text(procs)
    return base


@pytest.fixture
def v2_only(monkeypatch, tmp_path):
    """A host with only a v2 hierarchy at tmp_path, this process in cgroup `own`."""
    own = {"": "/kubepods/pod1"}
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: [(str(tmp_path), "cgroup2", ["rw"])])
    monkeypatch.setattr(sandbox_cgroup, "_own_paths", lambda: own)
    return own


def test_v2_with_delegated_controllers_is_used_as_it_is(v2_only, tmp_path):
    base = _v2_tree(tmp_path, "/kubepods/pod1", "cpu memory pids", "memory pids")
    assert sandbox_cgroup.parents() == ("v2", [base])
    assert not (base / sandbox_cgroup.WORKER_LEAF).exists()  # nothing had to move


def test_v2_moves_its_processes_to_a_leaf_then_delegates(v2_only, tmp_path):
    base = _v2_tree(tmp_path, "/kubepods/pod1", "cpu memory pids", "", procs="12\n34\n")
    assert sandbox_cgroup.parents() == ("v2", [base])
    leaf = base / sandbox_cgroup.WORKER_LEAF
    assert leaf.is_dir() and (leaf / "cgroup.procs").read_text() == "34"  # each pid written in turn
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_the_root_cgroup_delegates_without_moving_anything(v2_only, tmp_path):
    base = _v2_tree(tmp_path, "/", "memory pids", "", procs="1\n2\n")
    v2_only[""] = "/"
    assert sandbox_cgroup.parents() == ("v2", [base])
    assert not (base / sandbox_cgroup.WORKER_LEAF).exists()  # the host's processes stay where they are
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_a_worker_already_in_the_leaf_uses_its_parent(v2_only, tmp_path):
    base = _v2_tree(tmp_path, "/kubepods/pod1", "memory pids", "memory pids")
    v2_only[""] = f"/kubepods/pod1/{sandbox_cgroup.WORKER_LEAF}"
    assert sandbox_cgroup.parents() == ("v2", [base])


def test_v2_without_the_controllers_falls_back_to_v1_or_nothing(v2_only, tmp_path):
    _v2_tree(tmp_path, "/kubepods/pod1", "cpu hugetlb", "")
    assert sandbox_cgroup.parents() == ("", [])
    with pytest.raises(sandbox_cgroup.CgroupUnavailable, match="memory and pids"):
        sandbox_cgroup.new_cgroup(1 << 20, 4)


def test_v1_needs_both_memory_and_pids(monkeypatch, tmp_path):
    for c in ("memory", "pids"):
        (tmp_path / c / "job").mkdir(parents=True)
    mounts = [(str(tmp_path / "memory"), "cgroup", ["rw", "memory"]), (str(tmp_path / "pids"), "cgroup", ["rw", "pids"])]
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: mounts)
    monkeypatch.setattr(sandbox_cgroup, "_own_paths", lambda: {"memory": "/job", "pids": "/job"})
    assert sandbox_cgroup.parents() == ("v1", [tmp_path / "memory" / "job", tmp_path / "pids" / "job"])
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: mounts[:1])
    assert sandbox_cgroup.parents() == ("", [])


# -- what new_cgroup writes --------------------------------------------------------------------------------


@pytest.fixture
def kernel_files(monkeypatch):
    """mkdir of a sandbox cgroup makes its interface files, as the kernel does (each reads "max" at first);
    `swap` says whether swap accounting is on (memory.swap.max / memory.memsw.* exist)."""
    made = {"swap": True}
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if self.name.startswith(sandbox_cgroup.PREFIX):
            v1_memory = self.parent.parent.name == "memory"
            names = {"v2": ["memory.max", "pids.max", "memory.swap.max", "memory.peak"],
                     "memory": ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.swappiness"],
                     "pids": ["pids.max"]}
            kind = "memory" if v1_memory else "pids" if self.parent.parent.name == "pids" else "v2"
            for name in names[kind]:
                if made["swap"] or not sandbox_cgroup._is_swap(name):
                    (self / name).write_text("max\n")

    monkeypatch.setattr(Path, "mkdir", mkdir)
    return made


def _limits(path: Path) -> dict[str, str]:
    return {f.name: f.read_text().strip() for f in sorted(path.iterdir())}


def test_v2_cgroup_gets_its_memory_swap_and_pids_limits(v2_only, kernel_files, tmp_path):
    base = _v2_tree(tmp_path, "/kubepods/pod1", "memory pids", "memory pids")
    cgroup = sandbox_cgroup.new_cgroup(256 << 20, 32)
    assert cgroup.version == "v2" and len(cgroup.paths) == 1 and cgroup.paths[0].parent == base
    assert _limits(cgroup.paths[0]) == {"memory.max": str(256 << 20), "memory.peak": "max",
                                        "memory.swap.max": "0", "pids.max": "32"}


def test_v2_without_swap_accounting_still_bounds_memory_and_pids(v2_only, kernel_files, tmp_path):
    kernel_files["swap"] = False
    _v2_tree(tmp_path, "/kubepods/pod1", "memory pids", "memory pids")
    cgroup = sandbox_cgroup.new_cgroup(64 << 20, 8)
    assert _limits(cgroup.paths[0]) == {"memory.max": str(64 << 20), "memory.peak": "max", "pids.max": "8"}


def test_v1_cgroups_get_memory_memsw_swappiness_and_pids(monkeypatch, kernel_files, tmp_path):
    for c in ("memory", "pids"):
        (tmp_path / c / "job").mkdir(parents=True)
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: [(str(tmp_path / "memory"), "cgroup", ["rw", "memory"]),
                                                            (str(tmp_path / "pids"), "cgroup", ["rw", "pids"])])
    monkeypatch.setattr(sandbox_cgroup, "_own_paths", lambda: {"memory": "/job", "pids": "/job"})
    cgroup = sandbox_cgroup.new_cgroup(128 << 20, 16)
    memory, pids = cgroup.paths
    assert cgroup.version == "v1" and memory.parent == tmp_path / "memory" / "job"
    assert _limits(memory) == {"memory.limit_in_bytes": str(128 << 20),
                               "memory.memsw.limit_in_bytes": str(128 << 20), "memory.swappiness": "0"}
    assert _limits(pids) == {"pids.max": "16"}


def test_v1_without_swap_accounting_writes_no_memsw_limit(monkeypatch, kernel_files, tmp_path):
    kernel_files["swap"] = False
    for c in ("memory", "pids"):
        (tmp_path / c / "job").mkdir(parents=True)
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: [(str(tmp_path / "memory"), "cgroup", ["rw", "memory"]),
                                                            (str(tmp_path / "pids"), "cgroup", ["rw", "pids"])])
    monkeypatch.setattr(sandbox_cgroup, "_own_paths", lambda: {"memory": "/job", "pids": "/job"})
    memory, _ = sandbox_cgroup.new_cgroup(128 << 20, 16).paths
    # The kernel would refuse to create memsw's file; the stand-in would let it be written: it must not be.
    assert _limits(memory) == {"memory.limit_in_bytes": str(128 << 20)}


# -- reading and removing cgroups --------------------------------------------------------------------------


def test_memory_peak_reads_the_versions_file_from_the_first_path_that_has_it(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    assert sandbox_cgroup.SandboxCgroup("v2", [first, second]).memory_peak() is None
    (second / "memory.peak").write_text("4096\n")
    (second / "memory.max_usage_in_bytes").write_text("8192\n")
    assert sandbox_cgroup.SandboxCgroup("v2", [first, second]).memory_peak() == 4096
    (first / "memory.max_usage_in_bytes").write_text("not a number\n")  # unreadable: the next path is tried
    assert sandbox_cgroup.SandboxCgroup("v1", [first, second]).memory_peak() == 8192


def test_remove_cgroup_says_whether_every_directory_went(tmp_path):
    empty, busy = tmp_path / "empty", tmp_path / "busy"
    empty.mkdir(), busy.mkdir()
    (busy / "task").write_text("")  # rmdir fails on it, as on a cgroup that still has a task
    assert sandbox_cgroup.remove_cgroup(None) is True
    assert sandbox_cgroup.remove_cgroup(sandbox_cgroup.SandboxCgroup("v2", [empty, tmp_path / "gone"])) is True
    assert not empty.exists()
    empty.mkdir()
    assert sandbox_cgroup.remove_cgroup(sandbox_cgroup.SandboxCgroup("v1", [busy, empty])) is False
    assert busy.exists() and not empty.exists()  # the rest are still removed


def test_only_old_empty_sandbox_cgroups_are_swept(tmp_path):
    old, young, busy = (tmp_path / f"{sandbox_cgroup.PREFIX}{n}" for n in ("old", "young", "busy"))
    for path in (old, young, busy):
        path.mkdir()
    (busy / "task").write_text("")
    other = tmp_path / "not-a-sandbox"
    other.mkdir()
    long_ago = time.time() - sandbox_cgroup.STALE_S - 60
    for path in (old, busy, other):
        os.utime(path, (long_ago, long_ago))
    sandbox_cgroup._sweep_stale(tmp_path)
    assert (old.exists(), young.exists(), busy.exists(), other.exists()) == (False, True, True, True)


def test_the_proc_files_are_parsed_as_the_kernel_writes_them(monkeypatch, tmp_path):
    proc = {"/proc/self/mounts": "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"
                                 "tmpfs /tmp tmpfs rw 0 0\n"
                                 "cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"
                                 "cgroup /mnt/my\\040pids cgroup rw,pids 0 0\n",
            "/proc/self/cgroup": "0::/kubepods/pod1\n4:memory:/job\n5:pids,cpu:/job2\n6:name=odd:/a:b\n"}
    for name, text in proc.items():
        (tmp_path / name.rsplit("/", 1)[1]).write_text(text)
    real = sandbox_cgroup.Path
    monkeypatch.setattr(sandbox_cgroup, "Path", lambda p: real(tmp_path / p.rsplit("/", 1)[1]) if p in proc
                        else real(p))
    assert sandbox_cgroup._mounts() == [("/sys/fs/cgroup", "cgroup2", ["rw", "nosuid"]),
                                        ("/sys/fs/cgroup/memory", "cgroup", ["rw", "memory"]),
                                        ("/mnt/my pids", "cgroup", ["rw", "pids"])]
    assert sandbox_cgroup._own_paths() == {"": "/kubepods/pod1", "memory": "/job", "pids": "/job2", "cpu": "/job2",
                                           "name=odd": "/a:b"}


def test_v2_without_a_v2_path_for_this_process_is_not_used(v2_only, tmp_path):
    _v2_tree(tmp_path, "/kubepods/pod1", "memory pids", "memory pids")
    del v2_only[""]  # a v1-only process on a host that also mounts v2
    assert sandbox_cgroup.parents() == ("", [])


def test_a_leaf_another_worker_already_made_is_joined(v2_only, tmp_path):
    base = _v2_tree(tmp_path, "/kubepods/pod1", "memory pids", "", procs="12\n")
    (base / sandbox_cgroup.WORKER_LEAF).mkdir()
    assert sandbox_cgroup.parents() == ("v2", [base])


def test_a_limit_that_cannot_be_written_leaves_no_cgroup_behind(v2_only, kernel_files, tmp_path, monkeypatch):
    base = _v2_tree(tmp_path, "/kubepods/pod1", "memory pids", "memory pids")
    real_write = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name == "pids.max" and self.parent.parent == base:
            raise PermissionError(13, "Permission denied", str(self))
        return real_write(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(Path, "rmdir", shutil.rmtree)  # a cgroup's files go with its directory
    with pytest.raises(sandbox_cgroup.CgroupUnavailable, match="cannot set up the sandbox cgroup: .*Permission denied"):
        sandbox_cgroup.new_cgroup(1 << 20, 4)
    assert not list(base.glob(sandbox_cgroup.PREFIX + "*"))
