"""Reward scoring for the worker: builtin verifiers (in-process) and sandboxed user Python.

Torch-free. ``worker.trainer.rewards`` turns a job's reward spec into a Scorer
built from these.
"""

from worker.rewards.builtins import BUILTINS, builtin_reward
from worker.rewards.sandbox import BatchResult, PythonRewardPool, PythonRewardProcess, RewardLoadError

__all__ = ["BUILTINS", "BatchResult", "PythonRewardPool", "PythonRewardProcess", "RewardLoadError", "builtin_reward"]
