"""Does a job's `model` name something the worker can load? Checked by a dry run, without torch.

- A local directory must hold a config.json that parses and describes a
  causal LM (an ``architectures`` entry ending in ForCausalLM or LMHeadModel),
  and a tokenizer (tokenizer.json, or tokenizer_config.json with its vocabulary).
- Anything else must look like a hub id (``name`` or ``owner/name``). A model
  in the Hugging Face cache is checked there. Otherwise its config.json is
  fetched from the configured hub: a model the hub lacks, or one no worker can
  download (the workers are offline, or the hub does not answer), fails the
  check, since the job would fail as invalid_job; with no hub configured the
  check is a warning that says what was not checked. A relative path such as
  models/tiny reads as a hub id, and the message says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.models.hub_cache import cached_config_file

HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
TOKENIZER_VOCABS = ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
HUB_TIMEOUT_S = 3.0


class ModelProblem(ValueError):
    """The model cannot be loaded; the message says why."""


@dataclass(frozen=True)
class ModelInfo:
    source: str  # "local" or "hub"
    status: str  # the dry run's: "passed"; "warning" when only the id's format was checked, or "skipped"
    detail: str
    tokenizer_json: Path | None = None  # a local tokenizer.json, to count prompt tokens with
    config: dict | None = None  # its config.json, when it was read (engine checks)


def _looks_local(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or Path(model).is_dir()


def _causal_lm(config: dict, where: str) -> str:
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ModelProblem(f"{where}: config.json has no model_type, so it is not a transformers model config")
    archs = config.get("architectures") or []
    causal = [a for a in archs if isinstance(a, str) and a.endswith(CAUSAL_SUFFIXES)]
    if not causal:
        raise ModelProblem(f"{where}: config.json describes {', '.join(map(str, archs)) or 'no architecture'}, "
                           "not a causal LM (an architecture ending in ForCausalLM or LMHeadModel)")
    return causal[0]


def _local(model: str) -> ModelInfo:
    root = Path(model).expanduser()
    if not root.is_dir():
        raise ModelProblem(f"{model!r} is not a directory on this host")
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelProblem(f"{model!r} has no config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelProblem(f"{model!r}: config.json is not valid JSON ({e})") from None
    except OSError as e:
        raise ModelProblem(f"{model!r}: config.json cannot be read ({e.strerror})") from None
    arch = _causal_lm(config, model)
    tokenizer_json = root / "tokenizer.json"
    if not tokenizer_json.is_file():
        tokenizer_json = None
        if not ((root / "tokenizer_config.json").is_file() and any((root / v).is_file() for v in TOKENIZER_VOCABS)):
            raise ModelProblem(f"{model!r} has no tokenizer (tokenizer.json, or tokenizer_config.json with "
                               f"one of {', '.join(TOKENIZER_VOCABS)})")
    return ModelInfo("local", "passed", f"local directory: {arch} with a tokenizer", tokenizer_json, config)


# A relative path (models/tiny) has a hub id's shape; whoever meant a directory learns why it was not found.
RELATIVE = ("a relative path such as 'models/tiny' is read as a hub id: name a local model by its absolute path "
            "under the operator's model directories (CISPO_MODEL_DIRS)")


def offline_miss(model: str) -> str:
    return (f"{model!r} is not in the model cache and the workers download nothing (HF_HUB_OFFLINE), so no worker "
            f"can load it; {RELATIVE}")


def _cached(model: str, config_file: Path) -> ModelInfo:
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise ModelProblem(f"{model!r}: its config.json in the model cache cannot be read as JSON") from None
    tokenizer_json = config_file.parent / "tokenizer.json"
    return ModelInfo("hub", "passed", f"hub model in the model cache: {_causal_lm(config, model)}",
                     tokenizer_json if tokenizer_json.is_file() else None, config)


def _hub(model: str, hub_url: str, cache: Path | None, offline: bool) -> ModelInfo:
    if not HUB_ID.match(model) or ".." in model or "--" in model:
        raise ModelProblem(f"{model!r} is neither a local directory nor a hub id ('name' or 'owner/name': letters, "
                           "digits, '-', '_', '.', at most 96 characters each)")
    config_file = cached_config_file(model, cache) if cache is not None else None
    if config_file is not None:
        return _cached(model, config_file)
    if offline:
        raise ModelProblem(offline_miss(model))
    if not hub_url:
        return ModelInfo("hub", "warning", "hub id: format checked only; it is not in the model cache and no hub "
                         "is configured to check it, so the job fails (invalid_job) if no worker can download it; "
                         f"{RELATIVE}")
    url = f"{hub_url.rstrip('/')}/{model}/resolve/main/config.json"
    try:
        response = httpx.get(url, timeout=HUB_TIMEOUT_S, follow_redirects=True)
    except httpx.HTTPError as e:  # an outage says nothing of the model: a warning, as with no hub to ask
        return ModelInfo("hub", "warning", f"hub id: format checked only; it is not in the model cache and the hub "
                         f"({hub_url}) did not answer ({type(e).__name__}), so the job fails (invalid_job) if no "
                         f"worker can download it; {RELATIVE}")
    if response.status_code in (401, 403, 404):
        raise ModelProblem(f"{model!r}: the hub has no config.json for it (HTTP {response.status_code}: "
                           f"no such model, or a gated or private one); {RELATIVE}")
    if response.status_code != 200:
        return ModelInfo("hub", "skipped", f"hub id: format checked; the hub answered HTTP "
                                           f"{response.status_code}, so its config was not checked")
    try:
        config = response.json()
    except ValueError:
        raise ModelProblem(f"{model!r}: the hub's config.json is not valid JSON") from None
    return ModelInfo("hub", "passed", f"hub model: {_causal_lm(config, model)}", config=config)


def check_model(model: str, *, hub_url: str, cache: Path | None = None, offline: bool = False) -> ModelInfo:
    """What was found; raises ModelProblem when the model cannot be the one a job loads. `cache` is the Hugging
    Face cache the workers share, `offline` whether they may download (HF_HUB_OFFLINE)."""
    return _local(model) if _looks_local(model) else _hub(model, hub_url, cache, offline)
