"""Whole state dicts of a sharded model and optimizer, gathered for checkpoints and spread back on resume.

The model itself is read from disk by rank 0 alone: the other ranks build it
on the meta device and receive rank 0's weights once it is sharded
(`receive_from_rank0`), so no rank but 0 ever holds the whole model.

Checkpoints hold whole tensors (not per-rank shards), so a run saved at one
world size resumes at any other. The optimizer state keeps torch's own layout
(parameters numbered in param-group order), which is the same at every world
size and the same as a one-process optimizer's state_dict().
With one process these are the plain state_dict() / load_state_dict().
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from worker.distributed import group

# Gathered to rank 0 only, in CPU memory: the other ranks get empty dicts.
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: torch.nn.Module | None) -> dict[str, torch.Tensor] | None:
    """Whole tensors on rank 0 ({} elsewhere); None with one process (the model's own state_dict serves)."""
    if model is None or not group.active():
        return None
    return get_model_state_dict(model, options=_GATHER)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict() as one process would have it, with whole tensors (on rank 0; collective)."""
    if not group.active():
        return optimizer.state_dict()
    by_name = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if not by_name:  # ranks other than 0
        return {}
    index = {name: i for i, name in enumerate(n for g in by_name["param_groups"] for n in g["params"])}
    return {
        "state": {index[name]: value for name, value in by_name["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]],
    }


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Load a whole optimizer.state_dict() (every rank holds it) into a possibly sharded optimizer."""
    if not group.active():
        optimizer.load_state_dict(state_dict)
        return
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_name = {
        "state": {ordered[i]: value for i, value in state_dict["state"].items()},
        "param_groups": [{**g, "params": [ordered[i] for i in g["params"]]} for g in state_dict["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def receive_from_rank0(model: torch.nn.Module, full_state: dict[str, torch.Tensor] | None,
                       device: torch.device) -> None:
    """Fill a sharded model with rank 0's whole weights (`full_state`, its state_dict before sharding).

    The other ranks built `model` on the meta device: their shards get memory here, and each whole
    tensor arrives by broadcast one at a time, so they never hold more than one of them at once.
    """
    if group.rank():
        model.to_empty(device=device)
    set_model_state_dict(model, full_state if group.rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():  # non-persistent buffers (rotary inv_freq) are not in a state dict
        dist.broadcast(buffer, src=0)
