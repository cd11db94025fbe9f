"""FSDP2 sharding of a policy, and unsharding it for the phases that run without gradients.

Each decoder layer is its own FSDP unit (one all-gather per layer in forward,
one reduce-scatter per layer in backward), the transformers model the root
unit (inside a PeftModel: generate() enters there, and FSDP needs the root's
forward to run first).
FSDP2 shards parameter by parameter, so a LoRA layer's frozen base weights
and trainable adapters share a unit.
With a compute dtype below float32 the units gather their parameters in that
dtype and reduce gradients in float32 into the float32 shards, which are the
master weights the optimizer updates (worker/model/precision.py).

Generation runs a different number of forward passes on each rank (sequences
end at different lengths), so it cannot all-gather per forward: `unsharded`
gathers every unit once, all ranks together, and the forwards inside it are
local. No-grad scoring (logp_old, reference log-probs) uses it too, which keeps
the ranks' micro-batch counts free to differ there.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from worker.distributed import group


def shard_model(model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype = torch.float32) -> None:
    """Shard `model` in place across the process group (one unit per decoder layer, plus the root).

    Works on a model built on the meta device too: its shards stay on meta until materialized.
    """
    mesh = init_device_mesh(device.type, (group.world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    root = _transformer(model)
    layer_types = set(getattr(root, "_no_split_modules", None) or ())
    for module in root.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(root, mesh=mesh, mp_policy=mp)


def _transformer(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PeftModel (which names the decoder layer classes)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model


def units(model: torch.nn.Module | None) -> list[FSDPModule]:
    """The FSDP units of a model shard_model sharded (its root is always one); none, without walking the modules
    (hundreds; several walks a step), for a model it did not."""
    if model is None or not isinstance(_transformer(model), FSDPModule):
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def unsharded(*models: torch.nn.Module | None):
    """Inside the block the models hold whole parameters and their forwards need no collectives.

    Every rank must enter and leave together (the gathers are collectives); costs the unsharded memory.
    """
    fsdp = [m for model in models for m in units(model)]
    roots = {id(_transformer(model)) for model in models if model is not None}  # a root never reshards after forward (FSDP2's default for it)
    for m in fsdp:
        if id(m) not in roots:
            m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in fsdp:
            m.reshard()
            if id(m) not in roots:
                m.set_reshard_after_forward(True, recurse=False)  # fully_shard's default for a non-root unit
