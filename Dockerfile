# syntax=docker/dockerfile:1
#
# Two images from one file:
#
#   docker build --target api    -t cispo-api .     # HTTP API + `cispo db upgrade`; no torch
#   docker build --target worker -t cispo-worker .  # Celery GPU worker: torch + CUDA, vLLM, a C compiler
#
# Both keep the repository layout under /app and install it editable, because
# service/db/migrate.py finds the migrations at <repo>/migrations.
#
# CUDA: the worker gets its CUDA runtime (cudart, cuBLAS, cuDNN, NCCL) from the
# torch wheels, which depend on the nvidia-* wheels; only the host's NVIDIA
# driver is needed, and the NVIDIA container toolkit mounts it (compose's GPU
# reservation, Kubernetes' nvidia.com/gpu). The default PyPI torch wheel for
# linux/x86_64 is a CUDA build; pass --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# (or another cuXXX index) to pick a CUDA version. Both targets share one
# Python 3.11 base, the version the project is tested with.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    CISPO_HOME=/var/lib/cispo \
    HF_HOME=/var/lib/cispo/huggingface

# tini: PID 1 that forwards SIGTERM (graceful Celery shutdown) and reaps the
# processes reward code leaves behind. util-linux: `unshare`, which starts the
# user-code sandbox (service/sandbox/spawn.py); mount: the worker entrypoint's remount
# of its cgroup; Debian ships both already, they are named so that they stay.
# (psycopg[binary] brings its own libpq.)
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini ca-certificates util-linux mount \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/venv \
 && groupadd --system --gid 10001 cispo \
 && useradd --system --uid 10001 --gid cispo --home-dir /var/lib/cispo --shell /usr/sbin/nologin cispo \
 && mkdir -p /var/lib/cispo \
 && chown cispo:cispo /var/lib/cispo

WORKDIR /app

# ---------------------------------------------------------------------------
# The API: the project's dependencies and the tinker extra (the Tinker SDK's schema, service/tinker/), no [worker]
# extra, so no torch, at the locked CPU set's versions (the set CI tests the API on).
FROM base AS api

# Dependencies first, from pyproject.toml alone, so a source change does not
# reinstall them: install the project once with empty packages, then drop it.
COPY pyproject.toml README.md ./
COPY constraints/cpu.txt constraints/
RUN mkdir -p service worker \
 && touch service/__init__.py worker/__init__.py \
 && pip install -c constraints/cpu.txt ".[tinker]" \
 && pip uninstall -y cispo-service \
 && rm -rf service worker build ./*.egg-info

# The whole tree (see .dockerignore): service/, worker/, migrations/ side by side.
COPY . .
# Import what a deployment uses, so an image with a missing dependency fails here, not at run time.
RUN pip install --no-deps -e . \
 && python -c "import uvicorn, psycopg, redis, service.api.app, service.queue, service.tinker.wire, worker.cli; from service.db.migrate import MIGRATIONS; assert MIGRATIONS.is_dir(), MIGRATIONS"

USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["cispo", "api", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------
# The GPU worker: the [worker] extra (torch, transformers, peft, ...), vLLM and the tinker extra, at the locked CUDA
# set's versions.
FROM base AS worker

ARG TORCH_INDEX_URL=""
# Every version comes from the locked CUDA set (constraints/cuda.txt, `make lock`), the one the GPU checks ran
# on: torch and vLLM as a pair (each vLLM release is built against one torch), in one pip run with the project's
# extras, so nothing re-resolves them. A TORCH_INDEX_URL of another CUDA than the lock's may need other nvidia-*
# wheels than the lock names: pip then refuses the pair, and the lock is the place to change them.

ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# A C compiler: Triton builds its launcher stubs with it at the first compiled kernel (torch.compile's
# Inductor, our compiled decode step, vLLM's compiled mode); without one they fail at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md ./
COPY constraints/cuda.txt constraints/
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install -c constraints/cuda.txt --index-url "$TORCH_INDEX_URL" torch; fi \
 && mkdir -p service worker \
 && touch service/__init__.py worker/__init__.py \
 && pip install -c constraints/cuda.txt torch vllm ".[worker,vllm,tracking,ray,tinker]" \
 && pip uninstall -y cispo-service \
 && rm -rf service worker build ./*.egg-info

# The whole tree (see .dockerignore): service/, worker/, migrations/ side by side.
COPY . .
# Import what a deployment uses, so an image with a missing dependency fails here, not at run time.
RUN pip install --no-deps -e . \
 && python -c "import torch, transformers, peft, psycopg, redis, service.tinker.wire, worker.cli, worker.jobs.job_runner; from service.db.migrate import MIGRATIONS; assert MIGRATIONS.is_dir(), MIGRATIONS" \
 && python -c "import shutil, torch, triton, vllm; v = [l.split('==')[1].strip() for l in open('constraints/cuda.txt') if l.startswith('torch==')][0]; assert torch.__version__.split('+')[0] == v, (torch.__version__, v); assert shutil.which('cc'), 'no C compiler for Triton'" \
 && python -c "import shutil; from service.sandbox.probe import SYSTEM_SEARCH; assert shutil.which('unshare', path=SYSTEM_SEARCH), 'no unshare: the sandbox cannot start'" \
 && sh -n /app/docker/worker-entrypoint.sh

# The worker runs as root, unlike the API. User Python code (python rewards,
# environments) is only ever run in a sandbox (service/sandbox/spawn.py), and building
# one takes root: new network/pid/mount/IPC namespaces, mounts, a chroot, a
# memory+pids cgroup per sandbox, and a switch of the user code to a uid of
# its own, leased from CISPO_SANDBOX_UID .. +CISPO_SANDBOX_UID_COUNT-1
# (default 100000-100999; flock files in /run/cispo-sandbox-uids), with no
# capabilities and no_new_privs. As any other user the worker refuses user
# code (fail closed). The trainer itself needs no root, yet runs as root too,
# with the container's capabilities: a flaw in the trainer (not in user code)
# would have them. So the container gets what the sandbox needs and nothing
# more (docker-compose.yml, the chart's worker.*SecurityContext).
# docker/worker-entrypoint.sh makes the container's cgroup writable for the
# sandboxes' cgroups, then execs the command.
USER 0:0
ENTRYPOINT ["/usr/bin/tini", "--", "/bin/sh", "/app/docker/worker-entrypoint.sh"]
CMD ["cispo", "worker", "--pool", "prefork"]
