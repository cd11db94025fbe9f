"""The worker's swaps of a module's forward or weights are optimisations, never requirements.

Lean backward (worker/model/lean_backward.py), the fused LoRA forward (worker/model/lora_forward.py), the
rollout's effective weights and lean LoRA forward (worker/rollout/effective_weights.py), packed linears
(worker/rollout/packed_linears.py) and compiled decoding (worker/rollout/static_decode.py) each replace what a
module runs with something faster or leaner that gives the same result. Each depends on the model's classes and
the installed torch, transformers and PEFT, which change under it. So when one raises, whether while swapping,
at a call or while restoring, the model runs its plain path instead, that optimisation stays off for that model
(compiled decoding keeps its own retries), and one message per optimisation and model is kept for the trainer
to report as a warn event (`take_messages`). A job never fails for one.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager

import torch
import torch.utils.checkpoint

__all__ = ["OPTIMISATIONS", "enabled", "fall_back", "report_once", "take_messages", "optional", "guarded",
           "switched_off", "restore_forwards"]

log = logging.getLogger(__name__)

OPTIMISATIONS = ("lean backward", "fused LoRA forward", "effective weights", "lean LoRA rollout forward",
                 "packed linears", "compiled decoding")

_off: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> optimisations that failed on it
_reported: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> optimisations already reported
_off_everywhere: set[str] = set()  # switched_off: the plain path for every model
_messages: list[str] = []  # not yet taken by the trainer


def enabled(model: torch.nn.Module, name: str) -> bool:
    return name not in _off_everywhere and name not in _off.get(model, ())


def report_once(model: torch.nn.Module, name: str, error: BaseException, what: str) -> None:
    """Keep a message for the trainer (the first failure of `name` on `model` only); the traceback goes to the
    log every time."""
    log.warning("%s failed on %s: %s", name, type(model).__name__, what, exc_info=error)
    reported = _reported.setdefault(model, set())
    if name not in reported:
        reported.add(name)
        _messages.append(f"{name} could not run on this model ({type(error).__name__}: {str(error)[:300]}); "
                         f"{what}")


def fall_back(model: torch.nn.Module, name: str, error: BaseException) -> None:
    """`name` failed on `model`: off for it from now on, and said once."""
    _off.setdefault(model, set()).add(name)
    report_once(model, name, error, "the plain path runs instead, with the same results")


def take_messages() -> list[str]:
    """The fallbacks not yet reported, for the trainer's warn events."""
    taken = _messages[:]
    _messages.clear()
    return taken


# Raised through a forward on purpose: non-reentrant activation checkpointing stops a recomputation with it once
# it has what backward needs (torch.utils.checkpoint's early stop). Not a failure; taking it for one and running
# the plain path would recompute past the stop and break the checkpoint's state.
_CONTROL_FLOW = tuple(e for e in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if e)


def _recoverable(error: BaseException) -> bool:
    # Out of memory is the job's size, not the optimisation's fault: the plain path would not fit either.
    return (isinstance(error, Exception) and not isinstance(error, torch.OutOfMemoryError)
            and not isinstance(error, _CONTROL_FLOW))


@contextmanager
def optional(model: torch.nn.Module, name: str, swap):
    """Run the block under the context manager `swap()` makes, or plainly where `name` is off for `model` or
    `swap` fails to enter or to leave (it must undo its own partial work when entering fails). An error of the
    block itself propagates."""
    if not enabled(model, name):
        yield model
        return
    try:
        manager = swap()
        manager.__enter__()
    except Exception as error:
        if not _recoverable(error):
            raise
        fall_back(model, name, error)
        yield model
        return
    try:
        yield model
    except BaseException as error:
        try:
            manager.__exit__(type(error), error, error.__traceback__)
        except Exception as restoring:
            if restoring is not error:
                fall_back(model, name, restoring)
        raise
    try:
        manager.__exit__(None, None, None)
    except Exception as error:
        if not _recoverable(error):
            raise
        fall_back(model, name, error)


def guarded(model: torch.nn.Module, name: str, fast, plain):
    """A forward that runs `fast`, and `plain` (with the same arguments) once `fast` has failed on `model`."""

    def forward(*args, **kwargs):
        if enabled(model, name):
            try:
                return fast(*args, **kwargs)
            except Exception as error:
                if not _recoverable(error):
                    raise
                fall_back(model, name, error)
        return plain(*args, **kwargs)

    return forward


def restore_forwards(patched: dict) -> None:
    """The class's forward again on each module whose forward is still the one set here. Another may have replaced
    it meanwhile (transformers' hub kernels put theirs, or the class's, back at every train() and eval()): that
    one stays."""
    for module, forward in patched.items():
        if module.__dict__.get("forward") is forward:
            del module.__dict__["forward"]


@contextmanager
def switched_off(*names: str):
    """The plain path of `names` for every model within the block (the reference the tests compare with)."""
    unknown = set(names) - set(OPTIMISATIONS)
    if unknown:
        raise ValueError(f"unknown optimisations: {sorted(unknown)}")
    added = set(names) - _off_everywhere
    _off_everywhere.update(added)
    try:
        yield
    finally:
        _off_everywhere.difference_update(added)
