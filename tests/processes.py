"""The processes tests start: stopping one, and which a test left behind. Every process a test starts carries a
tag in its environment, which its children, theirs, and daemons that re-parented to init inherit (sandboxed user
code, whose environment is replaced, lives in a pid namespace its owner kills)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

TAG_VAR = "CISPO_TEST_PROCESS_TAG"


def tagged(env: dict[str, str]) -> tuple[dict[str, str], str]:
    """A copy of env with a fresh tag, and the tag."""
    tag = uuid.uuid4().hex
    return {**env, TAG_VAR: tag}, tag


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within grace_s; returns once it is reaped."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def survivors(tag: str) -> list[str]:
    """'pid: command line' of every live (not zombie) process that carries the tag."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {command[:200]}")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found
