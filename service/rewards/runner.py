"""Scoring samples for the API (reward tests, graders/run) in a subprocess, never in the API process.

The API process must not run user code or import the worker (or torch), so
it starts ``python -m worker.rewards.runner`` (torch-free; python rewards go
on into the sandbox from there), hands it the spec, samples, secret values
and egress settings on stdin, and reads the scores back. The subprocess gets
a clean environment (no database or cloud credentials), a private temporary
directory, and a wall-clock limit after which its process group is killed.
It is awaited on the event loop (asyncio subprocess), so a slow reward holds
neither a thread of the pool other routes need nor the loop itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from service.errors import ServiceError
from service.settings import Settings

PROJECT_ROOT = Path(__file__).resolve().parents[2]
MAX_ANSWER_BYTES = 8 << 20


class RunnerFailed(ServiceError):
    status = 502
    code = "reward_runner_failed"


class RewardLoadFailed(ServiceError):
    status = 400
    code = "reward_load_error"


def _env(home: str, settings: Settings) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": "C.UTF-8",
           "PYTHONPATH": str(PROJECT_ROOT), "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
           "HOME": home, "TMPDIR": home}
    # The sandbox reads its own settings (CISPO_SANDBOX, CISPO_SANDBOX_UID, ...): the runner gets the API's.
    for name, value in settings.model_dump().items():
        if name.startswith("sandbox") and value is not None:
            env[f"CISPO_{name.upper()}"] = str(value)
    return env


async def run_reward(spec: dict, completions: list[str], rows: list[dict], *, secrets: dict[str, str],
                     settings: Settings) -> dict:
    """The runner's answer (see worker/rewards/runner.py); RewardLoadFailed / RunnerFailed otherwise."""
    judge = {"base_url": settings.judge_base_url, "api_key": settings.judge_api_key or None,
             "max_tokens": settings.judge_max_tokens} if settings.judge_base_url else None
    request = json.dumps({"spec": spec, "completions": completions, "rows": rows, "secrets": secrets,
                          "egress_allow": settings.egress_allow, "judge": judge})
    timeout_s = settings.scoring_timeout_s
    with tempfile.TemporaryDirectory(prefix="cispo-reward-test-") as home:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "worker.rewards.runner", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=home, env=_env(home, settings),
            start_new_session=True, close_fds=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(request.encode()), timeout=timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            # Also when the client went away (cancelled): the scoring must not outlive the request.
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise RunnerFailed(f"scoring took more than {timeout_s:g} s (the limit); try fewer samples",
                               code="reward_test_timeout") from None
    if proc.returncode != 0 or len(out) > MAX_ANSWER_BYTES:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RunnerFailed(_scrub(f"the scoring process failed (exit code {proc.returncode}): {tail[0][:300]}",
                                  secrets))
    answer = json.loads(out)
    if "load_error" in answer:
        raise RewardLoadFailed(_scrub(f"the reward could not start: {answer['load_error']}", secrets))
    return answer


def _scrub(message: str, secrets: dict[str, str]) -> str:
    for value in secrets.values():
        if value:
            message = message.replace(value, "***")
    return message
