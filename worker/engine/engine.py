"""The engine: one resident base, LoRA adapters on it, and Tinker's training primitives per adapter.

forward_backward runs every pass of a call, whatever its adapter, in one routed forward over the shared base
(worker/multi/routed.py) and one backward: each adapter's gradient comes from its own rows only
(worker/multi/lora.py), and gradients accumulate across calls until that adapter's optim_step.

sample runs every draw of a call in one decode (worker/rollout/decode.py's sample_jobs), each row through its
source: an adapter's live weights, a sampler version, or the base alone. A sampler version is one more adapter
of the shared base, frozen (no gradient, no optimizer), holding a copy of an adapter's weights as they were at
save_for_sampler, or a saved state's (load_sampler); it lives until drop_sampler, whatever its source does.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer

from service.job_spec.spec import LoraSpec
from worker.checkpoints.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from worker.engine.draws import job_rows, sequences
from worker.engine.losses import loss_fn
from worker.engine.types import AdamParams, AdapterConfig, Draw, DrawResult, Pass, PassResult
from worker.model.loading import load_causal_lm
from worker.multi.checkpoints import AdapterView, restore, restore_adapter
from worker.multi.lora import BASE_ONLY, SharedBase
from worker.multi.routed import collate_rows, routed_hidden, row_slices, rows_logprobs
from worker.rollout.decode import sample_jobs
from worker.trainer.step import optimizer_step

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
UNEMBED = ["lm_head"]  # a LoRA beside the LM head (the base's head stays frozen, tied to the embeddings or not)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def lora_spec(config: AdapterConfig) -> LoraSpec:
    """The adapter as the job spec names LoRA (what SharedBase adds)."""
    targets = (ATTN if config.train_attn else []) + (MLP if config.train_mlp else []) + \
        (UNEMBED if config.train_unembed else [])
    if not targets:
        raise ValueError("an adapter must train some of train_attn, train_mlp and train_unembed")
    alpha = 2.0 * config.rank if config.alpha is None else config.alpha
    return LoraSpec(r=config.rank, alpha=alpha, target_modules=targets)


class Engine:
    def __init__(self, base: torch.nn.Module, tokenizer=None):
        self.shared = SharedBase(base)
        self.tokenizer = tokenizer  # the base's, for stop strings (None: stop token ids only)
        self.configs: dict[str, AdapterConfig] = {}
        self.optimizers: dict[str, torch.optim.AdamW] = {}
        self.samplers: dict[str, str] = {}  # sampler version -> its frozen adapter on the shared base
        self.device = next(base.parameters()).device
        config = base.config
        eos = config.eos_token_id
        self.eos_ids: list[int] = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        self.pad_id = int(pad[0] if isinstance(pad, list) else (pad or 0))

    @classmethod
    def load(cls, where: str | Path) -> Engine:
        """The base from a local directory, float32 on the CPU (as the adapters train), and its tokenizer where
        the directory holds one."""
        where = Path(where)
        tokenizer = AutoTokenizer.from_pretrained(where) if any((where / f).exists() for f in TOKENIZER_FILES) \
            else None
        return cls(load_causal_lm(str(where), dtype=torch.float32), tokenizer)

    # adapters

    def create(self, adapter_id: str, config: AdapterConfig) -> None:
        if adapter_id in self.configs or adapter_id in self.samplers:  # one namespace: sample()'s sources
            raise ValueError(f"adapter {adapter_id!r} already exists")
        spec = lora_spec(config)
        if config.seed is None:
            self.shared.add(adapter_id, spec)
        else:  # the adapter's own RNG: the same seed gives the same adapter, and the global stream is untouched
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(config.seed)
                self.shared.add(adapter_id, spec)
        self.configs[adapter_id] = config

    def drop(self, adapter_id: str) -> None:
        self._config(adapter_id)
        self.shared.remove(adapter_id)
        del self.configs[adapter_id]
        self.optimizers.pop(adapter_id, None)

    def _config(self, adapter_id: str) -> AdapterConfig:
        if adapter_id not in self.configs:
            raise KeyError(f"no adapter {adapter_id!r}")
        return self.configs[adapter_id]

    # training

    def forward_backward(self, passes: list[Pass]) -> list[PassResult]:
        """All passes' datums in one routed forward; one backward over the losses of the passes that train.

        The rows are sorted by adapter (the router needs each adapter's rows contiguous); results come back in
        the passes' order. Each row is a datum's tokens, and its targets are the datum's target_tokens, put in
        the batch in place of the shifted ids (which would tie the targets to the next tokens)."""
        if not passes:
            return []
        for p in passes:
            self._config(p.adapter)
            loss_fn(p.loss)  # an unknown loss is refused before any forward
            for d in p.datums:
                if len(d.inputs["target_tokens"]) != len(d.tokens):
                    raise ValueError("a datum's target_tokens must have one entry per token")
        order = sorted(range(len(passes)), key=lambda i: list(self.configs).index(passes[i].adapter))
        ids, masks, owners, targets = [], [], [], []
        for i in order:
            for d in passes[i].datums:
                # one dummy id after the tokens: collate shifts by one, so its inputs are exactly `tokens`
                ids.append(list(d.tokens) + [self.pad_id])
                masks.append([0] + [1] * len(d.tokens))
                owners.append(passes[i].adapter)
                targets.append(d.inputs["target_tokens"].tolist())
        train = any(not p.forward_only for p in passes)
        batch = collate_rows(ids, masks, owners, pad_id=self.pad_id, device=torch.device("cpu"))
        width = batch.input_ids_BT.shape[1]
        batch.targets_BT = torch.tensor([t + [self.pad_id] * (width - len(t)) for t in targets], dtype=torch.long)
        self.shared.set_training(False)  # no dropout: the engine's adapters have none, and forwards are exact
        results: dict[int, PassResult] = {}
        total = None
        with torch.enable_grad() if train else torch.no_grad():
            hidden = routed_hidden(self.shared, batch, owners, nullcontext)
            for i, rows in zip(order, row_slices([len(passes[i].datums) for i in order])):
                p = passes[i]
                logp_BT, _ = rows_logprobs(self.shared, hidden, batch, rows, temperature=1.0, chunk_size=1024,
                                           owner=p.adapter)
                per_datum = [logp_BT[b, : len(d.tokens)] for b, d in enumerate(p.datums)]
                if p.datums:
                    inputs = {k: torch.cat([d.inputs[k] for d in p.datums])
                              for k in p.datums[0].inputs if k != "target_tokens"}
                    loss, metrics = loss_fn(p.loss)(torch.cat(per_datum), inputs, dict(p.config))
                    if not p.forward_only:
                        total = loss if total is None else total + loss
                else:
                    metrics = {"loss:sum": 0.0}
                results[i] = PassResult([lp.detach().float() for lp in per_datum], metrics)
        if total is not None and total.requires_grad:
            total.backward()
        return [results[i] for i in range(len(passes))]

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        """One AdamW step on the accumulated gradient (hyperparameters from this call), then the gradient is
        zeroed. The optimizer is made at the adapter's first step."""
        self._config(adapter_id)
        weights = self.shared.parameters(adapter_id)
        opt = self.optimizers.get(adapter_id)
        if opt is None:
            opt = self.optimizers[adapter_id] = torch.optim.AdamW(weights, lr=params.learning_rate)
        for group in opt.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        norm = optimizer_step(weights, opt, params.grad_clip_norm if params.grad_clip_norm > 0 else None)
        opt.zero_grad(set_to_none=True)
        return {"grad_norm:mean": norm, "learning_rate:mean": params.learning_rate}

    def steps_taken(self, adapter_id: str) -> int:
        """The optimizer steps behind the adapter's weights (a state loaded with its optimizer counts on)."""
        opt = self.optimizers.get(adapter_id)
        steps = [float(st["step"]) for st in opt.state.values() if "step" in st] if opt is not None else []
        return int(max(steps, default=0))

    # state

    def save_state(self, adapter_id: str, directory: str | Path) -> None:
        """Adapter weights, optimizer state and config as a job's checkpoint (worker/checkpoints/checkpoint.py: atomic, sha256
        manifest, no pickle), one adapter of the shared base presented as PEFT's "default" (AdapterView)."""
        directory = Path(directory)
        config = self._config(adapter_id)
        if directory.exists():
            raise FileExistsError(f"{directory} exists: a saved state is never overwritten")
        save_checkpoint(directory, model=AdapterView(self.shared, adapter_id), optimizer=self.optimizers.get(adapter_id),
                        state={"adapter_config": asdict(config)})

    def load_state(self, adapter_id: str, directory: str | Path, optimizer: bool = True) -> None:
        """A saved state into adapter `adapter_id` (made from the saved config if absent), its hashes checked by
        load_checkpoint before any weight is read; `optimizer` restores the AdamW moments too."""
        checkpoint, config = _saved_state(directory)
        if adapter_id not in self.configs:
            self.create(adapter_id, config)
        elif lora_spec(self.configs[adapter_id]) != lora_spec(config):
            raise CheckpointError(f"{directory}: saved for another LoRA shape than adapter {adapter_id!r}'s")
        self.optimizers.pop(adapter_id, None)
        opt = torch.optim.AdamW(self.shared.parameters(adapter_id))
        if optimizer and checkpoint.optimizer is not None:
            restore(self.shared, adapter_id, checkpoint, opt)
            self.optimizers[adapter_id] = opt
        else:
            restore_adapter(self.shared, adapter_id, checkpoint)

    # sampling

    def save_for_sampler(self, adapter_id: str, version: str) -> None:
        """Freeze a copy of the adapter's current weights as sampler version `version` (a later optim_step, load
        or drop of the adapter leaves it as it is)."""
        config = self._config(adapter_id)
        slot = self._frozen_slot(version, config)
        source = self.shared.adapter_state(adapter_id)
        with torch.no_grad():
            for key, weight in self.shared.adapter_state(slot).items():
                weight.copy_(source[key])

    def load_sampler(self, version: str, directory: str | Path) -> None:
        """A state written by save_state (its adapter weights only, hashes checked as load_state checks them) as
        frozen sampler version `version`."""
        checkpoint, config = _saved_state(directory)
        slot = self._frozen_slot(version, config)
        try:
            restore_adapter(self.shared, slot, checkpoint)
        except Exception:
            self.drop_sampler(version)  # no half-loaded version stays behind
            raise

    def drop_sampler(self, version: str) -> None:
        if version not in self.samplers:
            raise KeyError(f"no sampler version {version!r}")
        self.shared.remove(self.samplers.pop(version))

    def _frozen_slot(self, version: str, config: AdapterConfig) -> str:
        """A new frozen adapter of the adapter's LoRA shape for `version`, its weights to be filled; its name on
        the shared base is the engine's own (a version's name may be any string, a module key may not)."""
        if version in self.samplers or version in self.configs:
            raise ValueError(f"sampler version {version!r} already exists")
        spec = lora_spec(config)
        n = len(self.samplers)
        while f"sampler-{n}" in self.shared.specs:
            n += 1
        slot = f"sampler-{n}"
        with torch.random.fork_rng(devices=[]):  # PEFT's initialisation (overwritten) leaves the global stream be
            self.shared.add(slot, spec, trainable=False)
        self.samplers[version] = slot
        return slot

    def sample(self, draws: list[Draw]) -> list[DrawResult]:
        """Every draw in one decode over the shared base, each through its source (an adapter id, a sampler
        version, or None: the base alone); results in the draws' order (worker/engine/draws.py: what the
        sampling knobs and the recorded log-probs mean).

        A draw that cannot be served (unknown source, bad knobs) is refused before any decode, with a ValueError
        (KeyError for the source) naming it. A draw whose source's weights hold NaN or inf, or whose rows give NaN
        or inf logits, fails alone, in its DrawResult's `error`: such weights are kept out of the decode, since
        in a grouped LoRA forward (worker/multi/lora.py) they would reach every row (NaN * 0 is NaN), while a
        row's own overflow stays in its row."""
        if not draws:
            return []
        jobs = [job_rows(d, self._source(d.source, where=f"draw {i}"), self.tokenizer, where=f"draw {i}")
                for i, d in enumerate(draws)]
        names = {job.name for job in jobs} - {BASE_ONLY}
        diverged = {n for n in names if not all(bool(p.isfinite().all()) for p in self.shared.parameters(n))}
        results: dict[int, DrawResult] = {
            i: DrawResult([], error=f"draw {i}: the weights of {d.source!r} hold NaN or inf (an update diverged); "
                                    "nothing is sampled from them")
            for i, d in enumerate(draws) if jobs[i].name in diverged}
        # the router needs each adapter's rows contiguous: draws of one source go next to each other
        rank: dict[str | None, int] = {}
        order = sorted((i for i in range(len(draws)) if i not in results),
                       key=lambda i: rank.setdefault(jobs[i].name, len(rank)))
        if self.shared.model is None:  # no adapter at all: every draw is the base's
            model = self.shared.base
        else:
            model = self.shared.model
            self.shared.set_training(False)
        decoded = sample_jobs(model, self.shared.router, [jobs[i] for i in order], eos_id=self.eos_ids,
                              pad_id=self.pad_id, device=self.device)
        for i, out in zip(order, decoded):
            if isinstance(out, Exception):
                results[i] = DrawResult([], error=f"draw {i}: {out}")
                continue
            tokens, logprobs, *prompt = out
            results[i] = DrawResult(sequences(jobs[i], tokens, logprobs, self.eos_ids),
                                    prompt_logprobs=prompt[0][0] if prompt else None)
        return [results[i] for i in range(len(draws))]

    def _source(self, source: str | None, *, where: str) -> str | None:
        """The shared base's adapter that serves a draw's source."""
        if source is None:
            return BASE_ONLY
        if source in self.configs:
            return source
        if source in self.samplers:
            return self.samplers[source]
        raise KeyError(f"{where}: no adapter or sampler version {source!r}")


def _saved_state(directory: str | Path):
    """(checkpoint, adapter config) of a state written by save_state, its hashes checked by load_checkpoint."""
    checkpoint = load_checkpoint(Path(directory))
    return checkpoint, AdapterConfig(**checkpoint.state["adapter_config"])
