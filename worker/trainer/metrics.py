"""Accumulates the loss function's per-micro-batch sums into one step's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.cispo import LossOutput


@dataclass
class UpdateStats:
    sums: dict[str, float] = field(default_factory=dict)
    ratios: list[torch.Tensor] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    entropy_sum: float = 0.0

    def add(self, out: LossOutput, entropy_sum: float) -> None:
        for k, v in out.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        self.ratios.append(out.ratio_N.float().cpu())
        self.entropy_sum += entropy_sum

    @classmethod
    def combined(cls, ranks: list[UpdateStats]) -> UpdateStats:
        """One step's stats from every rank's; losses and grad norms are already global (equal on every rank)."""
        if len(ranks) == 1:
            return ranks[0]
        out = cls(step_losses=ranks[0].step_losses, grad_norms=ranks[0].grad_norms)
        for part in ranks:
            for k, v in part.sums.items():
                out.sums[k] = out.sums.get(k, 0.0) + v
            out.ratios.extend(part.ratios)
            out.entropy_sum += part.entropy_sum
        return out

    def metrics(self) -> dict[str, float]:
        tokens = self.sums.get("tokens", 0.0)
        if tokens == 0:
            return {"optimizer_steps": 0.0}
        ratio = torch.cat(self.ratios)
        p05, p50, p95 = torch.quantile(ratio.double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
        out = {
            "loss": sum(self.step_losses) / len(self.step_losses),
            "clip_fraction": self.sums["clipped"] / tokens,
            "is_ratio_p05": p05,
            "is_ratio_p50": p50,
            "is_ratio_p95": p95,
            "kl_old": self.sums["kl_old"] / tokens,
            "entropy": self.entropy_sum / tokens,
            "trained_tokens": tokens,
            "optimizer_steps": float(len(self.step_losses)),
        }
        if "sampler_kl" in self.sums:  # the rollout engine reported its log-probs (vLLM)
            out["sampler_logprob_abs_diff"] = self.sums["sampler_abs_diff"] / tokens
            out["sampler_kl"] = self.sums["sampler_kl"] / tokens
        if "tis_weight" in self.sums:
            out["tis_weight_mean"] = self.sums["tis_weight"] / tokens
            out["tis_capped_fraction"] = self.sums["tis_capped"] / tokens
        if "kl_ref" in self.sums:
            out["kl_ref"] = self.sums["kl_ref"] / tokens
            out["kl_ref_clamped_fraction"] = self.sums["kl_ref_clamped"] / tokens
        if "off_policy_masked" in self.sums:  # loss.off_policy_mask is set
            out["off_policy_masked_fraction"] = self.sums["off_policy_masked"] / tokens
        if self.grad_norms:
            out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        return out
