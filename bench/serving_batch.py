"""Sixteen concurrent chat streams from four projects on four adapters against one stream alone, through a serving
worker (worker/serving/server.py) that decodes the requests it holds together.

    .venv/bin/python bench/serving_batch.py                         # the tiny model, ~1 min on 2 busy cores
    .venv/bin/python bench/serving_batch.py --model runs/SmolLM2-135M-Instruct --max-tokens 32
    .venv/bin/python bench/serving_batch.py --channel redis          # the production transport (CISPO_BENCH_REDIS_URL)

One process: a ServingWorker on the base in a thread, four random LoRA adapters (rank 8, every linear layer)
saved as trainer checkpoints and uploaded to a local object store as a training worker uploads them, and one
client thread per stream reading its reply list as the API does. The channel is an in-process one by default
(the worker's own costs only), or Redis. Each round runs every one of the sixteen requests alone, one after
another, then all sixteen pushed at once; the first round warms up (adapters loaded) and is dropped.

Printed per round and as medians: the wall time of the sixteen together against the slowest of them alone (the
ratio: what sixteen concurrent streams cost beside one; target <= 1.5x), the time to first token p50 and p99 of
the sixteen together, completion tokens per second together and alone, and the 1-minute load average. Greedy
decoding (temperature 0), `--max-tokens` new tokens at most per stream (EOS may end one sooner).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROJECTS = ("alpha", "beta", "gamma", "delta")
PROMPTS = ("Say abc", "Name three colours", "Spell bca backwards", "What comes after a b c")
REDIS_URL = os.environ.get("CISPO_BENCH_REDIS_URL", "redis://127.0.0.1:6379/5")


class MemoryChannel:
    """The serving channel's contract in process: one queue per list, marks with a deadline."""

    def __init__(self):
        self.lists: dict[str, queue.Queue] = defaultdict(queue.Queue)
        self.marks: dict[str, float] = {}
        self.lock = threading.Lock()

    def _list(self, key: str) -> queue.Queue:
        with self.lock:
            return self.lists[key]

    def push(self, key: str, message: dict, ttl_s: float) -> None:
        self._list(key).put(message)

    def push_many(self, messages: list[tuple[str, dict]], ttl_s: float) -> None:
        for key, message in messages:
            self.push(key, message, ttl_s)

    def pop(self, keys: list[str], timeout_s: float):
        (key,) = keys  # one base served, one reply read: one list a pop
        try:
            return key, self._list(key).get(timeout=timeout_s)
        except queue.Empty:
            return None

    def mark_alive(self, key: str, ttl_s: float) -> None:
        self.marks[key] = time.monotonic() + ttl_s

    def alive(self, key: str) -> bool:
        return self.marks.get(key, 0.0) > time.monotonic()

    def alive_many(self, keys: list[str]) -> list[bool]:
        return [self.alive(k) for k in keys]


def tiny_model(toy_dir: Path | None) -> Path:
    """worker/toy's tiny model (built once: CISPO_TEST_TOY_DIR, or a directory under the system's temp)."""
    from worker.toy.__main__ import prepare

    root = toy_dir or Path(os.environ.get("CISPO_TEST_TOY_DIR") or Path(tempfile.gettempdir()) / "cispo-bench-toy")
    if not (root / "model" / "config.json").exists():
        prepare(root)
    return (root / "model").resolve()


def adapters(model_dir: Path, work: Path, store) -> dict[str, dict]:
    """One random adapter per project, saved as a trainer checkpoint and uploaded: {project: wire checkpoint}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from worker.checkpoints.artifacts import upload_checkpoint
    from worker.checkpoints.checkpoint import checkpoint_name, save_checkpoint

    found = {}
    for k, project in enumerate(PROJECTS):
        torch.manual_seed(k)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.5)  # far from zero: answers unlike the base, which ends at once
        local = save_checkpoint(work / project / checkpoint_name(1), model=model, optimizer=None, state={"step": 1})
        prefix, files = upload_checkpoint(store, f"ftjob-{project}", 1, local)
        found[project] = {"id": f"ftckpt-{project}-1", "prefix": prefix, "files": files}
    return found


class Stream:
    """One request pushed to the worker's queue and its replies read by a thread of its own."""

    def __init__(self, channel, base: str, request: dict):
        from service.serving.channel import PREFIX, request_queue

        self.channel, self.reply = channel, f"{PREFIX}:reply:{uuid.uuid4().hex}"
        self.first = self.ended = None
        self.tokens, self.error = 0, None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        self.sent = time.perf_counter()
        channel.push(request_queue(base), {**request, "reply": self.reply, "deadline": time.time() + 600},
                     ttl_s=600)

    def _read(self) -> None:
        while True:
            got = self.channel.pop([self.reply], 600)
            if got is None:
                self.error = "no reply for 600 s"
                return
            message = got[1]
            if message["type"] == "delta" and self.first is None:
                self.first = time.perf_counter()
            elif message["type"] == "finish":
                self.tokens += message["tokens"]
            elif message["type"] in ("end", "error"):
                self.ended = time.perf_counter()
                self.error = message.get("message") if message["type"] == "error" else None
                return

    def wait(self) -> Stream:
        self.thread.join()
        if self.error:
            raise RuntimeError(f"the worker answered an error: {self.error}")
        return self


def requests_of(base: str, checkpoints: dict[str, dict], max_tokens: int, temperature: float) -> list[dict]:
    from service.serving import requests
    from service.serving.targets import Target

    out = []
    for i in range(4):
        for project in PROJECTS:  # the projects interleaved, as they would arrive
            parsed = requests.parse(requests.ChatRequest, {
                "model": "ft:any", "messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": max_tokens,
                "temperature": temperature, "seed": len(out)})
            out.append({"target": Target(base, checkpoints[project]).wire(), "prompts": requests.prompts(parsed),
                        "sampling": requests.sampling(parsed)})
    return out


def one_round(channel, base: str, asked: list[dict]) -> dict:
    alone = []
    for request in asked:
        s = Stream(channel, base, request).wait()
        alone.append((s.ended - s.sent, s.tokens))
    started = time.perf_counter()
    streams = [Stream(channel, base, request) for request in asked]
    for s in streams:
        s.wait()
    wall = max(s.ended for s in streams) - started
    firsts = sorted(s.first - s.sent for s in streams if s.first is not None)
    slowest = max(t for t, _ in alone)
    return {"together": wall, "slowest_alone": slowest, "ratio": wall / slowest,
            "ttft_p50": statistics.median(firsts), "ttft_p99": _quantile(firsts, 0.99),
            "tps_together": sum(s.tokens for s in streams) / wall,
            "tps_alone": sum(n for _, n in alone) / sum(t for t, _ in alone), "load": os.getloadavg()[0]}


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between the sorted values."""
    at = (len(values) - 1) * q
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face model directory (default: worker/toy's tiny model)")
    p.add_argument("--toy-dir", type=Path, help="worker/toy's directory (default CISPO_TEST_TOY_DIR or a temp one)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy (the tiny model then often ends at "
                   "once); seeded either way (request i: seed i)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds, after one warm-up round")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--channel", choices=("memory", "redis"), default="memory")
    p.add_argument("--smoke", action="store_true", help="4 tokens, one measured round: the path, not the figure")
    args = p.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.rounds = 4, 1

    import torch

    from service.serving.channel import RedisChannel
    from service.settings import Settings
    from service.storage import LocalStore
    from worker.serving.server import ServingWorker

    if args.threads:
        torch.set_num_threads(args.threads)
    base = str((args.model or tiny_model(args.toy_dir)).resolve())
    with tempfile.TemporaryDirectory(prefix="serving-batch-") as tmp:
        work = Path(tmp)
        settings = Settings(home=work / "home", work_dir=work / "work", storage_url=str(work / "store"))
        checkpoints = adapters(Path(base), work / "checkpoints", LocalStore(work / "store"))
        channel = MemoryChannel() if args.channel == "memory" else RedisChannel(REDIS_URL, 10.0)
        worker = ServingWorker(settings, [base], channel=channel)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        asked = requests_of(base, checkpoints, args.max_tokens, args.temperature)
        print(f"serving_batch: {Path(base).name}, 16 streams (4 projects x 4 adapters) vs one alone, "
              f"max_tokens {args.max_tokens}, temperature {args.temperature:g}, channel {args.channel}, torch threads {torch.get_num_threads()}, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        one_round(channel, base, asked)  # warm-up: adapters loaded, caches of the allocator filled
        rounds = []
        for r in range(args.rounds):
            rounds.append(one_round(channel, base, asked))
            print(_row(f"round {r + 1}", rounds[-1]), flush=True)
        worker.stop.set()
        thread.join(60)
    print("== summary")
    print(_row("median", {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}))
    return 0


def _row(name: str, f: dict) -> str:
    return (f"{name}: 16 together {f['together']:.3f} s, slowest alone {f['slowest_alone']:.3f} s, ratio "
            f"{f['ratio']:.2f}x; ttft p50 {f['ttft_p50'] * 1000:.1f} ms, p99 {f['ttft_p99'] * 1000:.1f} ms; "
            f"tokens/s together {f['tps_together']:.1f}, alone {f['tps_alone']:.1f}; load {f['load']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
