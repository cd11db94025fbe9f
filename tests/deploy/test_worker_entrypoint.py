"""The worker entrypoint, run for real: a container's read-only cgroup becomes one the sandbox can use.

Container runtimes mount the cgroup file systems read-only for unprivileged
containers. This recreates that on this host, in a private mount namespace
(nothing of the host changes): every cgroup mount is made read-only there,
and the capability bounding set is cut to exactly what the deployments grant
the worker (SANDBOX_CAPS). The trial sandbox must then fail (so the test can
fail), and succeed once docker/worker-entrypoint.sh has run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.test_manifests import REPO, SANDBOX_CAPS

ENTRYPOINT = REPO / "docker" / "worker-entrypoint.sh"
PROBE = "import json; from service.sandbox.probe import probe; p = probe(); print(json.dumps([p.level, p.reason]))"


def host_can_sandbox() -> bool:
    from service.sandbox.spawn import sandbox_level

    return sandbox_level() == "namespaces"


needs = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and os.geteuid() == 0 and shutil.which("unshare") and shutil.which("setpriv")
         and host_can_sandbox()),
    reason="needs root, unshare, setpriv and a host that can sandbox user code")


@needs
def test_entrypoint_makes_a_read_only_cgroup_usable_with_only_the_granted_capabilities(tmp_path: Path):
    bounding = ",".join(["-all"] + [f"+{c.lower()}" for c in sorted(SANDBOX_CAPS)])
    python = sys.executable
    script = f"""
set -e
for m in $(awk '$3 == "cgroup" || $3 == "cgroup2" {{ print $2 }}' /proc/self/mounts); do
    mount -o remount,bind,ro "$m"
done
{python} -c '{PROBE}' > {tmp_path}/before
CISPO_SANDBOX=auto sh {ENTRYPOINT} {python} -c '{PROBE}' > {tmp_path}/after
"""
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", "--",
                          "setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", "sh", "-c", script],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    before = json.loads((tmp_path / "before").read_text())
    after = json.loads((tmp_path / "after").read_text())
    assert before[0] == "none" and "cgroup" in before[1], before  # read-only: the sandbox fails closed
    assert after == ["namespaces", ""], (after, run.stderr)
