"""One frozen base, many jobs' LoRA adapters, each row of a batch through its own job's adapter.

PEFT runs one active adapter for a whole batch (its `adapter_names` mixed
batches are inference only). Here every LoRA linear of the shared model gets a
forward that computes the base output for all rows at once, then each job's
low-rank path on its own contiguous segment of rows only:

    y = base(x);  y[s:e] += B_j(A_j(drop_j(x[s:e]))) * scale_j   for each segment (j, s, e)

the arithmetic of PEFT's own LoRA forward, per segment (x cast to the
adapter's dtype, the sum cast back to the base output's dtype), so a row
computes what it would in a batch of its own job alone. A job that does not
adapt a layer (other target modules) adds nothing there. Gradients reach
A_j and B_j only through job j's rows: the adapters are disjoint.

With several segments the low-rank paths run grouped, a fixed number of
kernels whatever the number of jobs: the segments' A and B are stacked (ranks
zero-padded to the largest, a missing adapter all zeros, which adds exact
zeros), each row picks its segment's pair, and two batched matmuls do every
row at once (x_b @ A_seg(b)^T @ B_seg(b)^T * scale_seg(b)). Stacking is
differentiable, so each adapter still gets exactly its own rows' gradient.
LoRA dropout in training draws per segment instead (the loop above).

The segments are set per forward by `SegmentRouter.rows(job_index_per_row)`;
rows must be sorted by job (the callers build their batches that way).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import Tensor

from service.job_spec.spec import LoraSpec
from worker.trainer.policy import lora_config

BASE_ONLY = None  # a segment's job name meaning "no adapter" (the reference policy of a KL term)


def segments_of(names_per_row: list[str | None]) -> list[tuple[str | None, int, int]]:
    """[(job name, start, end)] of consecutive rows with one job; a job's rows must be contiguous."""
    segments: list[tuple[str | None, int, int]] = []
    for i, name in enumerate(names_per_row):
        if segments and segments[-1][0] == name:
            segments[-1] = (name, segments[-1][1], i + 1)
        else:
            if any(s[0] == name for s in segments):
                raise ValueError(f"rows of job {name!r} are not contiguous: sort the batch by job")
            segments.append((name, i, i + 1))
    return segments


class SegmentRouter:
    """Which rows of the next forwards belong to which job (shared by every patched layer)."""

    def __init__(self):
        self.segments: list[tuple[str | None, int, int]] | None = None
        self._row_segment: dict = {}  # device -> each row's segment index, for the current segments

    @contextmanager
    def rows(self, names_per_row: list[str | None]):
        previous = self.segments, self._row_segment
        self.segments, self._row_segment = segments_of(names_per_row), {}
        try:
            yield
        finally:
            self.segments, self._row_segment = previous

    def row_segment(self, device) -> Tensor:
        """(rows,) the segment index of each row, made once per routed forward and device."""
        index = self._row_segment.get(device)
        if index is None:
            counts = torch.tensor([end - start for _, start, end in self.segments], device=device)
            index = self._row_segment[device] = torch.repeat_interleave(
                torch.arange(len(self.segments), device=device), counts)
        return index

    def current(self, batch: int) -> list[tuple[str | None, int, int]]:
        if self.segments is None:
            raise RuntimeError("a shared-base forward ran without its rows' jobs (SegmentRouter.rows)")
        if self.segments[-1][2] != batch:
            raise RuntimeError(f"the routed rows cover {self.segments[-1][2]} rows, the forward has {batch}")
        return self.segments


def _segmented_forward(module, router: SegmentRouter):
    base = module.get_base_layer()

    def forward(x: Tensor, *args, **kwargs) -> Tensor:
        result = base(x, *args, **kwargs)
        result_dtype = result.dtype
        segments = router.current(x.shape[0])
        if len(segments) > 1 and x.dim() == 3 and not (module.training and _drops(module, segments)):
            return (result + _grouped_delta(module, router, segments, x)).to(result_dtype)
        deltas = []
        for name, start, end in segments:
            if name is BASE_ONLY or name not in module.lora_A:
                deltas.append(result.new_zeros((end - start, *result.shape[1:])))
                continue
            a, b = module.lora_A[name], module.lora_B[name]
            h = x[start:end].to(a.weight.dtype)
            drop = module.lora_dropout[name]
            deltas.append(b(a(drop(h))) * module.scaling[name])
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas)
        return (result + delta).to(result_dtype)

    return forward


def _drops(module, segments) -> bool:
    """Whether any segment's adapter on `module` has LoRA dropout."""
    return any(name in module.lora_dropout and not isinstance(module.lora_dropout[name], torch.nn.Identity)
               for name, _, _ in segments)


def _grouped_delta(module, router: SegmentRouter, segments, x: Tensor) -> Tensor:
    """Every row's low-rank path, each through its own segment's adapter, in two batched matmuls."""
    in_features, out_features = module.in_features, module.out_features
    adapted = [name for name, _, _ in segments if name is not BASE_ONLY and name in module.lora_A]
    if not adapted:
        return x.new_zeros((*x.shape[:-1], out_features))
    dtype = module.lora_A[adapted[0]].weight.dtype
    rank = max(module.lora_A[name].weight.shape[0] for name in adapted)
    a_parts, b_parts, scales = [], [], []
    for name, _, _ in segments:
        if name is BASE_ONLY or name not in module.lora_A:
            a_parts.append(x.new_zeros((rank, in_features), dtype=dtype))
            b_parts.append(x.new_zeros((out_features, rank), dtype=dtype))
            scales.append(0.0)
            continue
        a, b = module.lora_A[name].weight, module.lora_B[name].weight
        pad = rank - a.shape[0]
        a_parts.append(torch.nn.functional.pad(a, (0, 0, 0, pad)) if pad else a)
        b_parts.append(torch.nn.functional.pad(b, (0, pad)) if pad else b)
        scales.append(float(module.scaling[name]))
    row = router.row_segment(x.device)
    a_rows = torch.stack(a_parts)[row]  # (rows, rank, in)
    b_rows = torch.stack(b_parts)[row]  # (rows, out, rank)
    scale_rows = torch.tensor(scales, dtype=dtype, device=x.device)[row]
    h = torch.bmm(x.to(dtype), a_rows.transpose(1, 2))
    return torch.bmm(h, b_rows.transpose(1, 2)) * scale_rows[:, None, None]


class SharedBase:
    """The resident base model with one adapter per job, every LoRA linear routed by segments.

    Adapters are added and removed while the worker runs (a job joining or leaving between cycles); each
    job's trainable parameters are its adapter's only.
    """

    def __init__(self, base: torch.nn.Module):
        base.requires_grad_(False)
        self.base = base
        self.model: PeftModel | None = None
        self.router = SegmentRouter()
        self.specs: dict[str, LoraSpec] = {}

    def add(self, name: str, spec: LoraSpec) -> list[torch.nn.Parameter]:
        """Add job `name`'s adapter (PEFT's initialisation, from torch's global RNG); returns its parameters."""
        if spec.base_quantization != "none":
            raise ValueError("a shared base is held unquantised: base_quantization must be 'none'")
        if self.model is None:
            self.model = get_peft_model(self.base, lora_config(spec), adapter_name=name)
        else:
            if name in self.specs:
                raise ValueError(f"job {name!r} already has an adapter on this base")
            self.model.add_adapter(name, lora_config(spec))
        self.specs[name] = spec
        self._route_all()
        for job in self.specs:  # PEFT leaves only its active adapter trainable; every job's adapter trains
            for param in self.parameters(job):
                param.requires_grad_(True)
        return self.parameters(name)

    def remove(self, name: str) -> None:
        """Drop job `name`'s adapter (its memory goes with it)."""
        if name not in self.specs:
            return
        del self.specs[name]
        if self.specs:
            self.model.delete_adapter(name)
        else:  # PEFT keeps at least one adapter: the last one goes with the wrapper
            self.model = None
            self.base = _unwrapped(self.base)

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        """Job `name`'s adapter parameters, in a stable order (the model's)."""
        key = f".{name}."
        return [p for n, p in self.model.named_parameters() if key in n and ".lora_" in n]

    def adapter_state(self, name: str) -> dict[str, Tensor]:
        """Job `name`'s adapter weights under PEFT's saved names (".<name>" dropped), detached."""
        key = f".{name}."
        return {n.replace(key, "."): p.detach() for n, p in self.model.named_parameters()
                if key in n and ".lora_" in n}

    def _route_all(self) -> None:
        """Give every LoRA linear the segmented forward (new layers appear when a job adapts other modules)."""
        for module in self.model.modules():
            if isinstance(module, LoraLayer) and "forward" not in module.__dict__:
                if type(module).__name__ != "Linear":
                    raise ValueError(f"a shared base routes LoRA linears only, not {type(module).__name__}")
                module.forward = _segmented_forward(module, self.router)


def _unwrapped(base: torch.nn.Module) -> torch.nn.Module:
    """The base with PEFT's layers replaced by their base layers again."""
    for parent in list(base.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, LoraLayer):
                setattr(parent, child_name, child.get_base_layer())
    return base
