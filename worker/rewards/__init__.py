"""Reward scoring: builtin verifiers and graders (in-process), user regexes (a killable child), sandboxed user
Python, remote endpoints.

Torch-free. ``engine.build_scorer`` turns any service reward spec into a
BatchScorer; ``worker.trainer.rewards`` wraps it for the trainer, and
``runner`` serves the API's reward tests from a subprocess.
"""

from worker.rewards.builtins import BUILTINS
from worker.rewards.sandbox import BatchResult, PythonRewardPool, PythonRewardProcess, RewardLoadError

__all__ = ["BUILTINS", "BatchResult", "PythonRewardPool", "PythonRewardProcess", "RewardLoadError"]
