"""Which base models a job may name: hub ids, and local directories the operator allowed.

`model` reaches the worker's from_pretrained(), which reads any path it is
given. So a path is accepted only under a directory of the `model_dirs`
setting (after resolving symlinks and `..`), and every refusal says the same
thing whether or not the path exists: the API is no oracle for the
filesystem. Existence is the worker's to find out, where a model it cannot
load fails the job as invalid_job on its first attempt; only where the
workers download nothing (HF_HUB_OFFLINE) is a hub id missing from the
shared model cache refused here, since no worker could load it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from service.errors import InvalidRequest
from service.models.check import offline_miss
from service.models.hub_cache import cached_config_file
from service.settings import Settings

# A hub repo id: "name" or "owner/name", letters, digits, '-', '_', '.', no '..' (huggingface_hub's rule).
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def _refused(settings: Settings) -> InvalidRequest:
    # One message for every refused name, relative paths included: it names the setting, never the filesystem.
    rule = ("or an absolute path under one of the operator's model directories (CISPO_MODEL_DIRS); relative paths "
            "are not accepted" if settings.resolved_model_dirs() else
            "(this service accepts no local paths: the operator allows directories with CISPO_MODEL_DIRS)")
    return InvalidRequest(f"model: must be a hub id such as 'org/name' {rule}", param="model", code="invalid_model")


def check_model(model: str, settings: Settings) -> None:
    """Raise InvalidRequest (param 'model') unless the model is a hub id or an allowed local directory."""
    if not model.startswith("/"):
        if not _HUB_ID.match(model) or ".." in model:
            raise _refused(settings)
        if settings.hf_hub_offline and cached_config_file(model, settings.resolved_hf_hub_cache()) is None:
            raise InvalidRequest(f"model: {offline_miss(model)}", param="model", code="model_not_found")
        return
    resolved = Path(os.path.realpath(model))
    for allowed in settings.resolved_model_dirs():
        if resolved != allowed and resolved.is_relative_to(allowed):
            return
    raise _refused(settings)
