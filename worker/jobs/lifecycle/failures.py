"""How a run that raised ends, one classification for jobs alone, resident jobs and eval runs: a run that lost
its lease writes nothing more, a cancel ends it `cancelled`, anything else fails it with an error code, a message
and whether another attempt may succeed (a bad job fails at once; an outage or a crashed step may be transient)."""

from __future__ import annotations

import logging
from typing import NamedTuple

from service.models.engine_check import EngineUnsupported
from service.sandbox.channel import Interrupted
from service.storage import NotFound as StorageNotFound
from service.storage import StorageError
from worker.checkpoints.checkpoint import CheckpointError
from worker.model.unfetchable import unfetchable_model
from worker.ray_driver.errors import RAY_CAPACITY, RayCapacity
from worker.rewards.errors import EnvironmentErrorRateExceeded, RewardErrorRateExceeded
from worker.trainer.data import DataError
from worker.trainer.learning_signal import NoLearningSignal

log = logging.getLogger(__name__)

STORAGE_UNAVAILABLE = "storage_unavailable"  # the error code of a run stopped by an object-store outage
OUTAGES = {STORAGE_UNAVAILABLE: "The object store is unavailable", RAY_CAPACITY: "The Ray cluster lacks capacity"}
MESSAGE_CHARS = 2000  # the most of a failure's message its row keeps


class LeaseLost(Exception):
    """The run's lease is another worker's now: it stops without writing."""


class Cancelled(Exception):
    """A cancel was asked and the run stops between two pieces of its work."""


class Failure(NamedTuple):
    code: str
    message: str
    retryable: bool  # whether another attempt may succeed


class Ending(NamedTuple):
    status: str | None  # "cancelled" or "failed"; None: the run lost its lease and must write nothing more
    failure: Failure | None = None


def ending_of(e: BaseException, *, lost: bool, what: str) -> Ending:
    """How a run that raised `e` ends; `lost`: whether its lease was already seen lost (then nothing it raised
    afterwards is its job's failure); `what` names the run in the log."""
    if lost or isinstance(e, LeaseLost):
        return Ending(None)
    if isinstance(e, (Interrupted, Cancelled)):  # a cancel stopped it: user code mid-batch, or between chunks
        return Ending("cancelled")
    log.error("%s failed", what, exc_info=e)
    return Ending("failed", failure_of(e))


def failure_of(e: BaseException) -> Failure:
    """The failure an exception out of a run is."""
    if isinstance(e, EnvironmentErrorRateExceeded):
        return Failure("environment_error_rate", str(e), False)
    if isinstance(e, RewardErrorRateExceeded):
        return Failure("reward_error_rate", str(e), False)
    if isinstance(e, NoLearningSignal):
        return Failure("no_learning_signal", str(e), False)
    if isinstance(e, EngineUnsupported):
        return Failure("engine_unsupported", str(e), False)
    if isinstance(e, (DataError, CheckpointError, ValueError)):
        return Failure("invalid_job", str(e), False)
    if unfetchable_model(e):
        return Failure("invalid_job", f"the model cannot be loaded on this worker: {type(e).__name__}: "
                       f"{str(e)[:500]} (name a model the workers have, or an absolute path under an allowed model "
                       "directory; a relative path is read as a hub id)", False)
    if isinstance(e, StorageError):
        return Failure(STORAGE_UNAVAILABLE if _is_outage(e) else "storage_error", f"the object store failed: {e}",
                       True)
    if isinstance(e, RayCapacity):  # no gang, or a node lost: the cluster's, waited out as an outage
        return Failure(RAY_CAPACITY, f"the Ray cluster cannot carry the job now: {e}", True)
    return Failure("training_error", f"{type(e).__name__}: {e}", True)


def _is_outage(e: StorageError) -> bool:
    """The store could not be used at all (unreachable, timing out, refusing), not a missing object."""
    return not isinstance(e, StorageNotFound)
