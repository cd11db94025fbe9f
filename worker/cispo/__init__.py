"""CISPO as pure tensor functions: advantages, token log-probs, the loss.

No I/O and no model code here; the trainer composes these. Shape suffixes:
_B sequences, _G group, _T tokens, _V vocabulary.
"""

from worker.cispo.advantages import group_advantages
from worker.cispo.aggregation import sequence_weights
from worker.cispo.logprobs import token_logprobs
from worker.cispo.loss import LossInputs, LossOutput, cispo_loss, truncated_is_weight
from worker.cispo.pass_rate import prompts_to_retire
from worker.cispo.turn_advantages import rewards_to_go, turn_advantages

__all__ = ["group_advantages", "turn_advantages", "rewards_to_go", "token_logprobs", "cispo_loss", "LossInputs",
           "LossOutput", "truncated_is_weight", "sequence_weights", "prompts_to_retire"]
