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
kernels whatever the number of jobs: the segments' A and B are concatenated
along the rank, every row is projected by all of them, and a per-row mask
keeps its own job's block (scaled) before the B matmul (`_grouped_delta`);
the other blocks add exact zeros. Concatenation is differentiable and the
mask zeroes the other jobs' paths, so each adapter still gets exactly its own
rows' gradient.
LoRA dropout in training draws per segment instead (the loop above).

The segments are set per forward by `SegmentRouter.rows(job_index_per_row)`;
rows must be sorted by job (the callers build their batches that way).
`SegmentRouter.only(job)` routes every row of the forwards inside to one job.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import Tensor

from service.job_spec.spec import LoraSpec
from worker.model.policy import enable_gradient_checkpointing, lora_config

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
        self._masks: dict = {}  # the current segments' block masks (block_mask)
        self._only: str | None = None  # the job of every row of any forward without segments (`only`)

    def rows(self, names_per_row: list[str | None]):
        return self._routed(segments_of(names_per_row), {}, self._only)

    def only(self, name: str):
        """Every row of the forwards inside through job `name`'s adapter, whatever their number, unless `rows`
        says otherwise inside: a job's own code that runs the model as alone (a supervised step's forwards)."""
        return self._routed(None, {}, name)

    def checkpoint_contexts(self):
        """torch checkpoint's `context_fn` (training.gradient_checkpointing): (the context of a layer's forward, the
        context of its recompute), so that a layer recomputed in the backward, after the `rows` block of its
        forward has ended, routes its rows as that forward did."""
        return nullcontext(), self._routed(self.segments, self._masks, self._only)

    @contextmanager
    def _routed(self, segments, masks, only):
        previous = self.segments, self._masks, self._only
        self.segments, self._masks, self._only = segments, masks, only
        try:
            yield
        finally:
            self.segments, self._masks, self._only = previous

    def block_mask(self, module, blocks: list[tuple[int, int, float]], device, dtype) -> Tensor:
        """(rows, sum of ranks): for each row, its segment's scale over that segment's block of the concatenated
        ranks, zero elsewhere; made once per routed forward for each layout (layers of one shape share it)."""
        key = (tuple(blocks), device, dtype)
        mask = self._masks.get(key)
        if mask is None:
            rows = self.segments[-1][2]
            mask = torch.zeros((rows, sum(r for _, r, _ in blocks)), dtype=dtype)
            offset = 0
            for s, rank, scale in blocks:
                _, start, end = self.segments[s]
                mask[start:end, offset : offset + rank] = scale
                offset += rank
            mask = self._masks[key] = mask.to(device)
        return mask

    def current(self, batch: int) -> list[tuple[str | None, int, int]]:
        if self.segments is None and self._only is not None:
            return [(self._only, 0, batch)]
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


def _float32_head(head: torch.nn.Linear, router: SegmentRouter, jobs: set[str]):
    """The LM head's forward where rows of `jobs` (training.lm_head_float32) run its matmul on a float32 copy of its
    weight, their input cast up, as a job alone samples (worker/rollout/effective_weights.py): the logits its
    update scores. The others' logits are cast up, exactly, to go with them (the samplers read them in float32)."""
    copies: dict[str, Tensor] = {}  # the float32 weight (and bias), made at the first such row: the head is frozen

    def forward(x: Tensor) -> Tensor:
        result = torch.nn.functional.linear(x, head.weight, head.bias)
        segments = router.segments
        if segments is None or not any(name in jobs for name, _, _ in segments):
            return result
        if not copies:
            copies["weight"] = head.weight.detach().float()
            copies["bias"] = head.bias.detach().float() if head.bias is not None else None
        result = result.float()
        with torch.autocast(x.device.type, enabled=False):  # float32 whatever autocast is on, as the update's head
            for name, start, end in segments:
                if name in jobs:
                    result[start:end] = torch.nn.functional.linear(x[start:end].float(), copies["weight"],
                                                                   copies["bias"])
        return result

    return forward


def _drops(module, segments) -> bool:
    """Whether any segment's adapter on `module` has LoRA dropout."""
    return any(name in module.lora_dropout and not isinstance(module.lora_dropout[name], torch.nn.Identity)
               for name, _, _ in segments)


def _grouped_delta(module, router: SegmentRouter, segments, x: Tensor) -> Tensor:
    """Every row's low-rank path, each through its own segment's adapter, in two matmuls over all rows.

    The segments' A are concatenated along the rank (S*r x in) and their B likewise (out x S*r): x @ A_cat^T
    gives every row every adapter's rank-r projection; a mask keeps only the row's own segment's block (times
    its scale, zero elsewhere) before @ B_cat^T. Every other block adds exact zeros, and no per-row copy of a
    weight is made (the extra cost: the rank dimension S times over, small beside the base matmul)."""
    adapted = [name for name, _, _ in segments if name is not BASE_ONLY and name in module.lora_A]
    if not adapted:
        return x.new_zeros((*x.shape[:-1], module.out_features))
    dtype = module.lora_A[adapted[0]].weight.dtype
    a_parts, b_parts, blocks = [], [], []  # blocks: (segment index, rank, scale) per adapted segment
    for s, (name, _, _) in enumerate(segments):
        if name is BASE_ONLY or name not in module.lora_A:
            continue
        a_parts.append(module.lora_A[name].weight)
        b_parts.append(module.lora_B[name].weight)
        blocks.append((s, a_parts[-1].shape[0], float(module.scaling[name])))
    mask = router.block_mask(module, blocks, x.device, dtype)  # (rows, S*r): the row's own block, scaled
    h = torch.nn.functional.linear(x.to(dtype), torch.cat(a_parts))  # (rows, T, S*r)
    return torch.nn.functional.linear(h * mask[:, None, :], torch.cat(b_parts, dim=1))


class SharedBase:
    """The resident base model with one adapter per job, every LoRA linear routed by segments.

    Adapters are added and removed while the worker runs (a job joining or leaving between cycles); each
    job's trainable parameters are its adapter's only.
    """

    def __init__(self, base: torch.nn.Module, *, slots: int = 1):
        base.requires_grad_(False)
        self.base = base
        self.model: PeftModel | None = None
        self.router = SegmentRouter()
        self.specs: dict[str, LoraSpec | None] = {}  # None: an adapter loaded from a directory (load)
        self.frozen: set[str] = set()  # adapters that never train (add's `trainable` False)
        self.head_float32: set[str] = set()  # jobs whose rows run the LM head in float32 (add's `head_float32`)
        self.rollout_dtypes: dict[str, torch.dtype] = {}  # jobs sampling in a dtype other than the base's (add's)
        self.slots = slots  # how many jobs the worker holds at most
        self.vllm = None  # the vLLM engine of the jobs that sample with one (worker/multi/vllm_engine.py)
        # set_training's module list: None until the next switch lists them (after a join or leave); [] where some
        # module's train() does more than set its flag, so the model's own train() runs
        self._modules: list[torch.nn.Module] | None = None

    def close(self) -> None:
        """Free what outlives the adapters: the vLLM engine, whose state is process-wide."""
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None

    def add(self, name: str, spec: LoraSpec, *, trainable: bool = True, head_float32: bool = False,
            rollout_dtype: torch.dtype | None = None) -> list[torch.nn.Parameter]:
        """Add job `name`'s adapter (PEFT's initialisation, from torch's global RNG); returns its parameters.

        An adapter added with `trainable` False stays frozen (requires_grad False) while others join: a sampler's
        copy of weights that no optimizer steps. With `head_float32` (training.lm_head_float32) the job's rows run
        the LM head's matmul in float32 in every forward that calls the head (sampling: `_float32_head`); its
        update's log-probs take the head_dtype of worker/trainer/update.py. With a `rollout_dtype` other than the
        base's (rollout.dtype) the job's rows are decoded on copies of the base's weights cast to it, as alone
        (worker/multi/rollout.py: jobs of one such dtype decode together, its own forwards unchanged)."""
        if spec.base_quantization != "none":
            raise ValueError("a shared base is held unquantised: base_quantization must be 'none'")
        if self.model is None:
            self.model = get_peft_model(self.base, lora_config(spec), adapter_name=name)
        else:
            if name in self.specs:
                raise ValueError(f"job {name!r} already has an adapter on this base")
            self.model.add_adapter(name, lora_config(spec))
        self.specs[name] = spec
        if not trainable:
            self.frozen.add(name)
        if head_float32:
            self.head_float32.add(name)
        if rollout_dtype is not None and rollout_dtype != next(self.base.parameters()).dtype:
            self.rollout_dtypes[name] = rollout_dtype
        self._modules = None
        self._route_all()
        self._mark_trainable()
        return self.parameters(name)

    def load(self, name: str, adapter_dir: str) -> None:
        """Add a saved adapter (a PEFT adapter directory) under `name`, frozen: a serving worker's, which no
        optimizer steps; its rows are routed like any job's."""
        if name in self.specs:
            raise ValueError(f"adapter {name!r} is already on this base")
        if self.model is None:
            self.model = PeftModel.from_pretrained(self.base, adapter_dir, adapter_name=name, is_trainable=False)
        else:
            self.model.load_adapter(adapter_dir, adapter_name=name, is_trainable=False)
        self.specs[name] = None  # no job spec: it was trained elsewhere
        self.frozen.add(name)
        self._modules = None
        self._route_all()
        self._mark_trainable()

    def remove(self, name: str) -> None:
        """Drop job `name`'s adapter (its memory goes with it)."""
        if name not in self.specs:
            return
        del self.specs[name]
        self.frozen.discard(name)
        self.head_float32.discard(name)
        self.rollout_dtypes.pop(name, None)
        self._modules = None
        if self.specs:
            self.model.delete_adapter(name)
            self._mark_trainable()  # deleting PEFT's active adapter makes another one the only trainable one
        else:  # PEFT keeps at least one adapter: the last one goes with the wrapper
            self.model = None
            self.base = _unwrapped(self.base)

    def set_training(self, mode: bool) -> None:
        """`self.model.train(mode)`, in one flat pass over the modules listed at the last join or leave.

        torch's train() recurses through every module in Python (~300 at K = 4, one more adapter's worth with
        each job: ~2 ms a switch on a 2-core CPU, three switches a cycle); the flags it sets are the same. Where
        any module's class does more in train() than set the flags (an override other than torch's own or
        transformers' PreTrainedModel's, or hub kernels in use), the model's own train() runs instead."""
        if self._modules is None:
            modules = list(self.model.modules())
            self._modules = modules if all(_plain_train(m) for m in modules) else []
        if not self._modules:
            self.model.train(mode)
            return
        for module in self._modules:
            module.__dict__["training"] = mode

    @contextmanager
    def checkpointing(self, on: bool = True):
        """Gradient checkpointing of the base's decoder layers in the training forwards inside, when `on` (a job
        in the forward has training.gradient_checkpointing): every row of such a forward recomputes in the
        backward, whichever job's it is (the same numbers; the other jobs' rows cost their recompute too)."""
        if not on:
            yield
            return
        enable_gradient_checkpointing(self.base, context_fn=self.router.checkpoint_contexts)
        try:
            yield
        finally:
            self.base.gradient_checkpointing_disable()
            self.base.disable_input_require_grads()  # enable's hook on the embeddings (disable leaves it)

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        """Job `name`'s adapter parameters, in a stable order (the model's)."""
        key = f".{name}."
        return [p for n, p in self.model.named_parameters() if key in n and ".lora_" in n]

    def adapter_state(self, name: str) -> dict[str, Tensor]:
        """Job `name`'s adapter weights under PEFT's saved names (".<name>" dropped), detached."""
        key = f".{name}."
        return {n.replace(key, "."): p.detach() for n, p in self.model.named_parameters()
                if key in n and ".lora_" in n}

    def _mark_trainable(self) -> None:
        """PEFT leaves only its active adapter trainable (on every add, and on deleting the active one); every
        job's adapter trains, the frozen ones excepted (one walk over the model's parameters, not one per
        resident job: a join would cost more with every job already resident)."""
        for param_name, param in self.model.named_parameters():
            if ".lora_" in param_name:
                param.requires_grad_(_adapter_of(param_name) not in self.frozen)

    def _route_all(self) -> None:
        """Give every LoRA linear the segmented forward (new layers appear when a job adapts other modules), and a
        plain LM head held below float32 the forward that runs some jobs' rows in float32."""
        for module in self.model.modules():
            if isinstance(module, LoraLayer) and "forward" not in module.__dict__:
                if type(module).__name__ != "Linear":
                    raise ValueError(f"a shared base routes LoRA linears only, not {type(module).__name__}")
                module.forward = _segmented_forward(module, self.router)
        head = self.model.get_output_embeddings()
        if type(head) is torch.nn.Linear and head.weight.dtype != torch.float32 and "forward" not in head.__dict__:
            head.forward = _float32_head(head, self.router, self.head_float32)


def _adapter_of(param_name: str) -> str:
    """The adapter a LoRA parameter belongs to: PEFT names it `...lora_A.<adapter>.weight` (adapter names hold
    no dot: they are module keys)."""
    return param_name.split(".lora_", 1)[1].split(".")[1]


def _plain_train(module: torch.nn.Module) -> bool:
    """Whether `module.train(mode)` only sets the training flags (torch's own train, or transformers' without hub
    kernels, which then does nothing more)."""
    from transformers import PreTrainedModel

    train = type(module).train
    return "training" in module.__dict__ and (train is torch.nn.Module.train or (
        train is PreTrainedModel.train and not getattr(module, "use_kernels", False)))


def _unwrapped(base: torch.nn.Module) -> torch.nn.Module:
    """The base with PEFT's layers replaced by their base layers again."""
    for parent in list(base.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, LoraLayer):
                setattr(parent, child_name, child.get_base_layer())
    return base
