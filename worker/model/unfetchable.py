"""Is a load error Hugging Face's "this model cannot be had here"? Then no later attempt will do better.

transformers turns every failure to find a model into an OSError (or a huggingface_hub error under it): no such
repository, a gated or private one, no such file, or the hub unreachable (or HF_HUB_OFFLINE) with nothing in the
cache; a relative path such as models/tiny is read as a hub id and fails the same way. Retried as a transient
training error, each attempt waited out the hub client's retries (minutes) before failing the same way; the job
is invalid as it stands (name a model the workers have, or an allowed local directory).
"""

from __future__ import annotations

# The messages transformers and huggingface_hub raise when a model cannot be found or fetched.
_MARKERS = (
    "is not a local folder and is not a valid model identifier",
    "couldn't connect to",
    "couldn't find them in the cached files",
    "outgoing traffic has been disabled",
    "offline mode",
    "gated repo",
    "does not appear to have a file named",
    "repository not found",
    "is not the path to a directory containing",
)
_HUB_ERRORS = ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError", "LocalEntryNotFoundError",
               "EntryNotFoundError", "RemoteEntryNotFoundError", "DisabledRepoError", "HFValidationError")


def unfetchable_model(error: BaseException) -> bool:
    """Whether `error` (or what caused it) says the model cannot be found or fetched on this worker."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ in _HUB_ERRORS:
            return True
        if isinstance(error, OSError) and any(m in str(error).lower() for m in _MARKERS):
            return True
        error = error.__cause__ or error.__context__
    return False
