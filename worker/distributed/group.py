"""The process group: rank, world size, and the collectives the trainer needs (identity in one process)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

# Rank 0 relays every checkpoint to the object store while the others wait in the next collective.
COLLECTIVE_TIMEOUT = timedelta(hours=1)


# Set when this process joins a training group (init_from_env). A group some library made for itself (vLLM's
# in-process engine initialises a one-process one) is not the trainer's and must not shard the policy.
_joined = False


def active() -> bool:
    return _joined and dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def init_from_env() -> torch.device:
    """Join the group torchrun describes in the environment; returns this rank's device."""
    global _joined
    _joined = True
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=torch.device("cuda", local))
        return torch.device("cuda", local)
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    return torch.device("cpu")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def sum_all(value: float) -> float:
    """The sum of `value` over all ranks (in float64, so token counts stay exact)."""
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return float(t)


def max_all(value: int) -> int:
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def gather_objects(obj) -> list:
    """`obj` from every rank, in rank order (small picklable things: metrics, rewards; never from users)."""
    if not active():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj):
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scatter_from_rank0(parts: list | None):
    """Rank r's item of rank 0's `parts` (one per rank, rank order; None on the other ranks)."""
    if not active():
        return parts[0]
    box = [None]
    dist.scatter_object_list(box, parts if rank() == 0 else None, src=0)
    return box[0]
