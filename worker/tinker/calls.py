"""What each Tinker request does on the engine: the request's body in, its result out.

The API stored the body as the SDK sent it (JSON, or protobuf for forward_backward and forward); here it is
read, run on the engine of the request's base, and answered in the SDK's shapes (service/tinker/wire.py for
the protobuf ones). A caller's mistake raises UserError, whose message the SDK shows ("category": "user").

Adapters are named by their model id ("<session>:train:<n>", unique across sessions), sampler versions by their
sampling session id; a `tinker://` path is resolved for the request's project only (Checkpoints), so another
project's path is "not found", as a 404 is elsewhere.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from service.repositories.tinker import sampler_id_for
from service.tinker import wire
from worker.engine import AdamParams, AdapterConfig, Datum, Draw, Pass, SampleParams
from worker.engine.engine import Engine
from worker.engine.losses import loss_fn

log = logging.getLogger(__name__)


class UserError(Exception):
    """The request cannot be served as sent; the message says why."""


@dataclass(frozen=True)
class Call:
    """One claimed request (a row of the API's requests table)."""

    id: str
    project_id: str
    kind: str
    model_id: str | None
    body: bytes
    session_id: str | None = None

    def json(self) -> dict:
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise UserError(f"{self.kind}: the body is not JSON ({e})") from None


@dataclass(frozen=True)
class Reply:
    body: bytes
    protobuf: bool = False

    @classmethod
    def of(cls, value: dict) -> Reply:
        return cls(json.dumps(value).encode())


class Checkpoints(Protocol):
    """Saved states and sampler weights in the object store, recorded per project (worker/tinker/runner.py)."""

    def save(self, call: Call, engine: Engine, model_id: str, kind: str, name: str) -> str: ...

    def fetch(self, project_id: str, path: str) -> tuple[Path, str]:
        """A saved state's local directory and its base model."""

    def sampler(self, project_id: str, sampler_id: str) -> dict | None: ...


class Engines:
    """One engine per base model, loaded on first use; which engine holds each adapter and sampler version."""

    def __init__(self, load=Engine.load):
        self.load = load
        self.by_base: dict[str, Engine] = {}
        self.base_of: dict[str, str] = {}  # adapter or sampler version -> base

    def of_base(self, base: str) -> Engine:
        if base not in self.by_base:
            start = time.monotonic()
            self.by_base[base] = self.load(base)
            log.info("base %s resident (loaded in %.1f s)", base, time.monotonic() - start)
        return self.by_base[base]

    def of(self, name: str) -> Engine:
        if name not in self.base_of:
            raise UserError(f"model {name!r} is not loaded on this server (released, or never created)")
        return self.by_base[self.base_of[name]]

    def release(self, name: str) -> None:
        base = self.base_of.pop(name, None)
        if base is not None:
            engine = self.by_base[base]
            if name in engine.configs:
                engine.drop(name)
            else:
                engine.drop_sampler(name)


def adapter_config(body: dict) -> AdapterConfig:
    lora = body.get("lora_config") or {}
    if "rank" not in lora:
        raise UserError("create_model: lora_config.rank is required (full fine-tuning is not served)")
    optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
    if optimizer != "adamw":
        raise UserError(f"create_model: optimizer_config.type {optimizer!r} is not served (only 'adamw')")
    return AdapterConfig(rank=int(lora["rank"]), seed=lora.get("seed"), train_attn=lora.get("train_attn", True),
                         train_mlp=lora.get("train_mlp", True), train_unembed=lora.get("train_unembed", True))


def adam_params(body: dict) -> AdamParams:
    if "adam_params" not in body:
        raise UserError("optim_step: only adam_params are served (other optimizer families are not)")
    fields = AdamParams.__dataclass_fields__
    given = body["adam_params"] or {}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise UserError(f"optim_step: adam_params has unknown fields {unknown}")
    params = AdamParams(**{k: float(v) for k, v in given.items()})
    if not all(math.isfinite(getattr(params, k)) for k in fields) or params.learning_rate < 0:
        raise UserError("optim_step: adam_params must be finite and learning_rate >= 0")
    return params


def sample_params(body: dict) -> SampleParams:
    given = body.get("sampling_params") or {}
    if given.get("max_tokens") is None:
        raise UserError("asample: sampling_params.max_tokens is required")
    stop = given.get("stop") or ()
    stop = (stop,) if isinstance(stop, (str, int)) else tuple(stop)
    return SampleParams(max_tokens=int(given["max_tokens"]), temperature=float(given.get("temperature", 1.0)),
                        top_p=float(given.get("top_p", 1.0)), top_k=int(given.get("top_k", -1)), stop=stop,
                        seed=given.get("seed"))


def datums(call: wire.ForwardBackwardCall) -> list[Datum]:
    out = []
    for d in call.datums:
        inputs = {}
        for key, values in d.inputs.items():
            dtype = torch.long if key == "target_tokens" else torch.float32
            inputs[key] = torch.tensor(values, dtype=dtype)
        if "target_tokens" not in inputs:
            raise UserError("forward_backward: every datum needs loss_fn_inputs.target_tokens")
        out.append(Datum(tokens=list(d.tokens), inputs=inputs))
    return out


class Calls:
    def __init__(self, engines: Engines, checkpoints: Checkpoints):
        self.engines, self.checkpoints = engines, checkpoints

    # models

    def create_model(self, call: Call) -> Reply:
        body = call.json()
        base = body.get("base_model")
        if not base:
            raise UserError("create_model: base_model is required")
        engine = self.engines.of_base(base)
        try:
            engine.create(call.model_id, adapter_config(body))
        except ValueError as e:
            raise UserError(f"create_model: {e}") from None
        self.engines.base_of[call.model_id] = base
        return Reply.of({"model_id": call.model_id, "type": "create_model"})

    def unload_model(self, call: Call) -> Reply:
        self.engines.release(call.model_id)
        return Reply.of({"model_id": call.model_id, "type": "unload_model"})

    # training

    def forward_backward_passes(self, calls: list[Call]) -> list[Pass]:
        passes = []
        for call in calls:
            try:
                decoded = wire.decode_forward_backward(call.body)
            except wire.WireError as e:
                raise UserError(f"{call.kind}: {e}") from None
            try:
                loss_fn(decoded.loss_fn)
            except ValueError as e:
                raise UserError(str(e)) from None
            passes.append(Pass(adapter=call.model_id, datums=datums(decoded), loss=decoded.loss_fn,
                               config=dict(decoded.loss_fn_config or {}),
                               forward_only=call.kind == "forward" or decoded.forward_only))
        return passes

    def forward_backward(self, engine: Engine, calls: list[Call]) -> list[Reply]:
        """Several models' passes on one base as one engine call (one routed forward and backward)."""
        passes = self.forward_backward_passes(calls)
        try:
            results = engine.forward_backward(passes)
        except ValueError as e:
            raise UserError(f"forward_backward: {e}") from None
        return [Reply(wire.encode_forward_backward([r.tolist() for r in result.logprobs], result.metrics),
                      protobuf=True) for result in results]

    def optim_step(self, call: Call) -> Reply:
        metrics = self.engines.of(call.model_id).optim_step(call.model_id, adam_params(call.json()))
        return Reply.of({"metrics": metrics, "type": "optim_step"})

    # state

    def save_weights(self, call: Call) -> Reply:
        name = call.json().get("path") or f"{call.id}"
        path = self.checkpoints.save(call, self.engines.of(call.model_id), call.model_id, "weights", name)
        return Reply.of({"path": path, "type": "save_weights"})

    def save_weights_for_sampler(self, call: Call) -> Reply:
        body = call.json()
        engine = self.engines.of(call.model_id)
        if body.get("path"):
            path = self.checkpoints.save(call, engine, call.model_id, "sampler_weights", body["path"])
            return Reply.of({"path": path, "type": "save_weights_for_sampler"})
        if body.get("sampling_session_seq_id") is None:
            raise UserError("save_weights_for_sampler: a path or a sampling_session_seq_id is required")
        sampler_id = sampler_id_for(call.session_id, int(body["sampling_session_seq_id"]))
        engine.save_for_sampler(call.model_id, sampler_id)
        self.engines.base_of[sampler_id] = self.engines.base_of[call.model_id]
        return Reply.of({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

    def load_weights(self, call: Call) -> Reply:
        body = call.json()
        if not body.get("path"):
            raise UserError("load_weights: path is required")
        local, saved_base = self.checkpoints.fetch(call.project_id, body["path"])
        base = self.engines.base_of.get(call.model_id) or body.get("base_model") or saved_base
        engine = self.engines.of_base(base)
        try:
            engine.load_state(call.model_id, local, optimizer=bool(body.get("optimizer", False)))
        except ValueError as e:
            raise UserError(f"load_weights: {e}") from None
        self.engines.base_of[call.model_id] = base
        return Reply.of({"model_id": call.model_id, "path": body["path"], "type": "load_weights"})

    # sampling

    def draw(self, call: Call) -> tuple[Engine, Draw]:
        body = call.json()
        source, base = self.sampling_source(call, body)
        engine = self.engines.of_base(base)
        try:
            prompt = wire.model_input_tokens(body.get("prompt") or {})
        except wire.WireError as e:
            raise UserError(f"asample: {e}") from None
        n = int(body.get("num_samples", 1))
        if not prompt or n < 1:
            raise UserError("asample: the prompt must have tokens and num_samples must be at least 1")
        return engine, Draw(source=source, prompt=prompt, num_samples=n, params=sample_params(body),
                            prompt_logprobs=bool(body.get("prompt_logprobs")))

    def sampling_source(self, call: Call, body: dict) -> tuple[str | None, str]:
        """(the adapter or sampler version to draw from, None for the base alone; the base)."""
        sampler_id = body.get("sampling_session_id")
        if sampler_id:
            if sampler_id in self.engines.base_of:
                return sampler_id, self.engines.base_of[sampler_id]
            sampler = self.checkpoints.sampler(call.project_id, sampler_id)
            if sampler is None:
                raise UserError(f"asample: no sampling session {sampler_id!r}")
            if sampler.get("model_path"):
                return self.load_version(call.project_id, sampler_id, sampler["model_path"], sampler["base_model"])
            if sampler.get("base_model"):
                return None, sampler["base_model"]
            raise UserError(f"asample: sampling session {sampler_id!r} is gone (its weights were not saved by "
                            "path; save_weights_for_sampler with a name keeps them)")
        if body.get("model_path"):
            return self.load_version(call.project_id, body["model_path"], body["model_path"], body.get("base_model"))
        if body.get("base_model"):
            return None, body["base_model"]
        raise UserError("asample: a sampling_session_id, model_path or base_model is required")

    def load_version(self, project_id: str, name: str, path: str, base: str | None) -> tuple[str, str]:
        if name in self.engines.base_of:
            return name, self.engines.base_of[name]
        local, saved_base = self.checkpoints.fetch(project_id, path)
        base = base or saved_base
        self.engines.of_base(base).load_sampler(name, local)
        self.engines.base_of[name] = base
        return name, base

    def sample(self, engine: Engine, calls: list[Call], draws: list[Draw]) -> list[Reply | Exception]:
        """Every draw of the calls in one batched decode; a draw whose logits went non-finite fails alone."""
        try:
            results = engine.sample(draws)
        except ValueError as e:
            raise UserError(f"asample: {e}") from None
        return [UserError(f"asample: {r.error}") if r.error is not None else
                Reply(wire.encode_sample([(s.tokens, s.logprobs, s.stop_reason) for s in r.sequences],
                                         r.prompt_logprobs), protobuf=True) for r in results]

