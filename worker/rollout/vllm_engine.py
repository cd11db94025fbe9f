"""The vLLM engine, colocated with the trainer in the worker process.

Before each rollout the engine takes the policy's current weights:
- LoRA: the adapter is saved with PEFT's save_pretrained to a fresh
  directory and served under a new LoRARequest id (the previous one is
  removed, with its directory), so no cached adapter or prefix KV of the old
  weights is ever reused;
- full fine-tuning: the model's state dict is loaded in place through
  vLLM's reload_weights (it re-runs the post-load weight processing), and the
  prefix cache, computed with the old weights, is dropped.

On a GPU with rollout.sleep_mode the engine sleeps between rollouts, so the
update has the memory: level 1 (weights offloaded to the CPU, KV cache
freed) with a LoRA, level 2 (weights discarded too) for full fine-tuning,
whose sync reloads every weight anyway. Before waking, the trainer's cached
allocator blocks go back to the GPU (empty_cache), else the wake-up can
find the memory the update freed still held by the trainer's caching allocator. Each sampled token's log-prob comes back from vLLM
after temperature (logprobs_mode 'processed_logprobs'), the same quantity
the trainer scores, for the truncated importance-sampling correction.

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): weights are
handed over by reference, and no engine process re-imports the worker's
main module.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import typing
from pathlib import Path

import torch
from peft import PeftModel

from service.models.engine_check import EngineUnsupported
from service.job_spec.sampling import SamplingSpec
from service.job_spec.spec import JobSpec
from worker.envs.protocol import Environment
from worker.model.policy import Policy
from worker.model.precision import compute_dtype
from worker.rollout.rollout import Rollout, generate


def _configure_vllm_process() -> None:
    """vLLM reads these at import and engine start; a deployment's own values win."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would take a share of all RAM


def engine_dtype(spec: JobSpec, cuda: bool) -> str:
    """rollout.dtype, else the dtype the trainer computes in (worker/model/precision.py's rule)."""
    if spec.rollout.dtype != "auto":
        return spec.rollout.dtype
    return str(compute_dtype(spec.dtype, spec.model, torch.device("cuda" if cuda else "cpu"))).removeprefix("torch.")


def vllm_lora_rank(r: int) -> int:
    """vLLM accepts a few max_lora_rank values; the smallest one that holds rank r."""
    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(typing.get_args(MaxLoRARanks))
    for rank in allowed:
        if rank >= r:
            return rank
    raise EngineUnsupported(f"lora.r is {r}, but the vllm rollout engine serves LoRA ranks up to {allowed[-1]}")


def sleep_level(*, lora: bool) -> int:
    """1 keeps the weights (offloaded to the CPU): a LoRA is served on them. 2 drops them: full fine-tuning
    reloads every weight at the next sync, so offloading them would copy GBs for nothing."""
    return 1 if lora else 2


def start_llm(spec: JobSpec, *, max_model_len: int, sleep: bool, loras: int = 0, lora_rank: int = 0):
    """A vLLM engine for `spec`'s model, with room for `loras` adapters of rank up to `lora_rank` (0: none)."""
    _configure_vllm_process()
    from vllm import LLM

    cuda = torch.cuda.is_available()
    kwargs: dict = dict(
        model=spec.model,
        dtype=engine_dtype(spec, cuda),
        max_model_len=max_model_len,
        seed=spec.seed,
        logprobs_mode="processed_logprobs",
        enable_sleep_mode=sleep,
        enforce_eager=not cuda,  # on CPU, compiling costs more than it saves for rollouts this size
    )
    if cuda:
        kwargs["gpu_memory_utilization"] = spec.rollout.gpu_memory_utilization
    if loras:
        kwargs.update(enable_lora=True, max_loras=loras, max_lora_rank=vllm_lora_rank(lora_rank))
    threads = torch.get_num_threads()
    try:
        llm = LLM(**kwargs)
    except (ValueError, NotImplementedError) as e:  # vLLM's refusals of a configuration: they would repeat
        raise EngineUnsupported(f"rollout.engine 'vllm' refused this job's model or settings: "
                                f"{type(e).__name__}: {e}") from e
    torch.set_num_threads(threads)  # vLLM drops the process to one thread for serving; the trainer needs them
    return llm


def sampling_params(s: SamplingSpec, budgets: list[int], *, greedy: bool, seeds: list[int]) -> list:
    """One SamplingParams per sequence: the job's knobs, its budget, its stream seed as the request seed."""
    from vllm import SamplingParams

    knobs = dict(temperature=0.0) if greedy else dict(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p)
    return [
        SamplingParams(**knobs, repetition_penalty=s.repetition_penalty, max_tokens=budget, logprobs=0,
                       min_tokens=min(s.min_output_tokens, budget),
                       seed=None if greedy else seed % 2**31, detokenize=False)
        for budget, seed in zip(budgets, seeds, strict=True)
    ]


def sampled(outputs) -> tuple[list[list[int]], list[list[float]]]:
    """Each request's new ids and their sampling log-probs, in request order."""
    ids, logprobs = [], []
    for out in outputs:
        sample = out.outputs[0]
        ids.append(list(sample.token_ids))
        logprobs.append([step[t].logprob for t, step in zip(sample.token_ids, sample.logprobs, strict=True)])
    return ids, logprobs


class VLLMEngine:
    def __init__(self, spec: JobSpec, *, lora: bool):
        cuda = torch.cuda.is_available()
        self.sampling_spec = spec.sampling
        self.sleep_enabled = cuda and spec.rollout.sleep_mode
        self.sleep_level = sleep_level(lora=lora)
        self.llm = start_llm(spec, max_model_len=spec.sampling.max_model_len, sleep=self.sleep_enabled,
                             loras=1 if lora else 0, lora_rank=spec.lora.r if lora else 0)
        self._adapters = Path(tempfile.mkdtemp(prefix="cispo-vllm-adapters-"))
        self._lora = None  # the LoRARequest now served
        self._next_lora_id = 1
        self._asleep = False

    # -- weights ----------------------------------------------------------------

    def sync(self, model: torch.nn.Module) -> None:
        """Make the engine sample from the model's current weights."""
        self._wake()
        if isinstance(model, PeftModel):
            self.load_adapter(model)
        else:
            self._drop_adapter()  # a full model is served as it is
            self.load_weights(model.state_dict())

    def load_adapter(self, model: PeftModel) -> None:
        """Serve the model's active adapter as a new LoRA (new directory, new id); drop the previous one."""
        from vllm.lora.request import LoRARequest

        lora_id = self._next_lora_id
        self._next_lora_id += 1
        directory = self._adapters / f"adapter-{lora_id}"
        model.save_pretrained(directory, selected_adapters=[model.active_adapter])
        self._drop_adapter()
        self._lora = LoRARequest(f"policy-{lora_id}", lora_id, str(directory))

    def _drop_adapter(self) -> None:
        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
            self._lora = None

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full weights (checkpoint names, e.g. a transformers state dict) into the served model."""
        self._wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state_dict.items())})
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    # -- sampling ---------------------------------------------------------------

    def generate(self, policy: Policy, rows: list[dict], sampling: SamplingSpec, *, group_size: int,
                 greedy: bool = False, environment: Environment | None = None, max_turns: int = 1,
                 seeds: list[int] | None = None, sampling_seeds: list[int] | None = None) -> Rollout:
        self.sampling_spec = sampling
        self.sync(policy.model)
        try:
            return generate(policy, rows, sampling, group_size=group_size, greedy=greedy, environment=environment,
                            max_turns=max_turns, seeds=seeds, sampling_seeds=sampling_seeds, sampler=self.sample)
        finally:
            self._sleep()

    def sample(self, seqs: list[list[int]], budgets: list[int], *, greedy: bool,
               seeds: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """One turn: new ids for each sequence (EOS included when it ended) and each id's sampling log-prob.

        `seeds`: each sequence's stream seed (worker/model/streams.py), used as its request seed."""
        # Per-sequence streams, as in our decode loop: a resumed run samples alike. Without them (a direct
        # call), request seeds come from the job's RNG (saved in checkpoints).
        if seeds is None:
            first = int(torch.randint(0, 2**31 - 1 - len(seqs), ()))
            seeds = [first + i for i in range(len(seqs))]
        params = sampling_params(self.sampling_spec, budgets, greedy=greedy, seeds=seeds)
        return sampled(self.llm.generate([{"prompt_token_ids": ids} for ids in seqs], params,
                                         lora_request=self._lora, use_tqdm=False))

    # -- memory -----------------------------------------------------------------

    def _sleep(self) -> None:
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=self.sleep_level)  # KV cache freed, weights offloaded or dropped: the update's
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            torch.cuda.empty_cache()  # the update's freed blocks back to the GPU, for the weights and KV cache
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine down and free its process-wide state, so a later job in this worker can start one."""
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        self.llm, self._lora = None, None
        cleanup_dist_env_and_memory()
        shutil.rmtree(self._adapters, ignore_errors=True)
