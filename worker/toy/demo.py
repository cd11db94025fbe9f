"""`make demo`: the toy job end to end through the service, on the embedded default.

Starts `cispo up` (SQLite, a server-less broker, a local object store; no
servers needed), then acts as a client over REST: uploads the dataset,
registers the reward, submits the job, shows a progress bar while polling,
downloads the final adapter (checking its sha256) and prints the reward
before and after training.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from worker.toy.__main__ import prepare, toy_spec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, log: Path | None = None, timeout: float = 60) -> None:
    """Until GET {base}/healthz answers 200; fails (with the log's tail) if `proc` exits or time runs out."""
    tail = lambda: log.read_text()[-3000:] if log is not None and log.exists() else ""  # noqa: E731
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{tail()}")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{base} did not answer:\n{tail()}")


def check(response: httpx.Response) -> dict:
    if response.status_code >= 400:
        raise SystemExit(f"{response.request.method} {response.request.url.path}: {response.status_code} {response.text}")
    return response.json()


def run_demo(root: Path, *, steps: int) -> None:
    prepare(root, steps=steps)
    home = root / "home"
    shutil.rmtree(home, ignore_errors=True)
    # The toy model is a local directory: the API accepts local models only under CISPO_MODEL_DIRS.
    env = {**os.environ, "CISPO_HOME": str(home), "CISPO_MODEL_DIRS": str(root.resolve())}
    for var in ("DATABASE_URL", "BROKER_URL", "STORAGE_URL", "CISPO_DATABASE_URL", "CISPO_BROKER_URL", "CISPO_STORAGE_URL"):
        env.pop(var, None)  # the embedded default, whatever this shell has set
    cli = [sys.executable, "-m", "worker.cli"]
    subprocess.run(cli + ["db", "upgrade"], env=env, check=True)
    key = subprocess.run(cli + ["keys", "create", "--project", "demo"], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (root / "service.log").open("w")
    # Its own process group, so that everything it started can be stopped as one (stop_process_group).
    server = subprocess.Popen(cli + ["up", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_healthy(base, server)
        print(f"service up at {base} (log: {root / 'service.log'})")
        client = httpx.Client(base_url=f"{base}/v1", headers={"Authorization": f"Bearer {key}"}, timeout=60)
        files = {}
        for split in ("train", "val"):
            with (root / f"{split}.jsonl").open("rb") as f:
                files[split] = check(client.post("/files", files={"file": (f"{split}.jsonl", f)},
                                                 data={"purpose": "fine-tune"}))["id"]
        reward = check(client.post("/reward_functions", json={
            "name": "last-letter", "spec": {"type": "exact_match", "field": "answer", "case_sensitive": True}}))
        spec = toy_spec(root, steps=steps)
        hyper = {k: spec[k] for k in ("lora", "sampling", "optimizer", "training")}
        job = check(client.post("/fine_tuning/jobs", json={
            "model": str(Path(spec["model"]).resolve()), "training_file": files["train"],
            "validation_file": files["val"], "seed": 0,
            "suffix": "demo", "method": {"type": "cispo", "cispo": {"reward_function": reward["id"],
                                                                     "hyperparameters": hyper}}}))
        print(f"job {job['id']} submitted")
        job = poll(client, job)
        if job["status"] != "succeeded":
            raise SystemExit(f"job ended {job['status']}: {job['error']}")
        report(client, job, root)
    finally:
        stop_process_group(server)
        log.close()


def stop_process_group(leader: subprocess.Popen, timeout: float = 90) -> None:
    """SIGTERM the leader of a process group (`cispo up`: a running job checkpoints and goes back to the
    queue, an idle stop takes about a second), then SIGKILL whatever is left in its group, so nothing
    it started outlives it. A KeyboardInterrupt while waiting (Ctrl-C again) kills at once."""
    try:
        leader.terminate()
        leader.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"pid {leader.pid} did not stop within {timeout:.0f} s; killing its process group", file=sys.stderr)
    finally:
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is empty: all stopped by themselves
            pass
        leader.wait()


def poll(client: httpx.Client, job: dict) -> dict:
    with tqdm(total=job["total_steps"], desc="training", unit="step") as bar:
        while job["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.5)
            job = check(client.get(f"/fine_tuning/jobs/{job['id']}"))
            bar.update(job["steps_done"] - bar.n)
            latest = check(client.get(f"/fine_tuning/jobs/{job['id']}/metrics",
                                      params={"name": "reward_mean", "step_min": max(job["steps_done"], 1)}))
            if latest["data"]:
                bar.set_postfix(reward=f"{latest['data'][-1]['value']:.3f}", status=job["status"])
    return job


def report(client: httpx.Client, job: dict, root: Path) -> None:
    evals = check(client.get(f"/fine_tuning/jobs/{job['id']}/metrics", params={"name": "eval_reward_mean"}))["data"]
    ckpt = check(client.get(f"/fine_tuning/jobs/{job['id']}/checkpoints"))["data"][0]
    download = client.get(f"/fine_tuning/jobs/{job['id']}/checkpoints/{ckpt['id']}/content")
    check_status = download.status_code
    if check_status != 200:
        raise SystemExit(f"adapter download failed: {check_status} {download.text}")
    digest = hashlib.sha256(download.content).hexdigest()
    if digest != download.headers["x-sha256"]:
        raise SystemExit("adapter archive sha256 does not match the header")
    out = root / "adapter"
    shutil.rmtree(out, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(download.content)) as tar:
        tar.extractall(root, filter="data")
    print(f"adapter of checkpoint {ckpt['id']} (step {ckpt['step_number']}, sha256 {digest[:12]}) in {out}")
    print(f"eval reward: {evals[0]['value']:.3f} before, {evals[-1]['value']:.3f} after {job['steps_done']} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("runs/demo"))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    run_demo(args.root, steps=args.steps)


if __name__ == "__main__":
    main()
