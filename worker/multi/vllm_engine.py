"""One vLLM engine for every resident job that asks for rollout.engine 'vllm', each row through its job's adapter.

The engine runs with enable_lora and max_loras = the worker's slots; before
each rollout every job in it has its current adapter saved (the checkpoint
format, worker/multi/checkpoints.py) and served under a new LoRA id, the
previous one removed, as a job alone hot-loads its adapter
(worker/rollout/vllm_engine.py). Each turn, every pending vLLM job's
sequences go to the engine in one generate call, each with its job's
LoRARequest and sampling parameters (knobs, budget, its stream seed as the
request seed), so vLLM batches them over the one base with its own
multi-LoRA kernels.

Started lazily, sized for the jobs at hand (max_model_len, LoRA rank), and
started again, larger, when a job that needs more joins (a rare cost of
tens of seconds rather than an engine sized for any job). The model, dtype,
memory share (rollout.gpu_memory_utilization), sleep mode and engine seed
are the first vLLM job's; every sample is drawn from its request's seed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from service.job_spec.sampling import SamplingSpec
from service.job_spec.spec import JobSpec
from worker.multi.checkpoints import AdapterView
from worker.multi.lora import SharedBase
from worker.rollout.rollout import TurnRequest
from worker.rollout.vllm_engine import sampled, sampling_params, sleep_level, start_llm


class SharedVLLM:
    def __init__(self, spec: JobSpec, slots: int):
        self.spec, self.slots = spec, slots
        self.sleep_enabled = torch.cuda.is_available() and spec.rollout.sleep_mode
        self.llm = None
        self.limits = (0, 0, 0)  # the running engine's (max_model_len, LoRA rank, max_loras)
        self.served: dict = {}  # job name -> the LoRARequest of its current adapter
        self._adapters = Path(tempfile.mkdtemp(prefix="cispo-shared-vllm-"))
        self._next_id = 1
        self._asleep = False

    def prepare(self, shared: SharedBase, names: list[str], max_model_len: int) -> None:
        """Before a rollout: an engine with room for these jobs, awake, serving each one's adapter as it is now."""
        need = (max_model_len, max(shared.specs[n].r for n in names), max(self.slots, len(names)))
        if self.llm is None or any(n > have for n, have in zip(need, self.limits)):
            self._restart(tuple(max(n, have) for n, have in zip(need, self.limits)))
        self._wake()
        for name in names:
            self._serve(shared, name)

    def sample(self, jobs: list[tuple[str, SamplingSpec, TurnRequest]]) -> list[tuple[list, list]]:
        """One turn of several jobs: per job, in order, (new ids per sequence, their sampling log-probs)."""
        prompts, params, loras = [], [], []
        for name, sampling, asked in jobs:
            seeds = asked.seeds if asked.seeds is not None else [0] * len(asked.seqs)  # greedy: unused
            prompts += [{"prompt_token_ids": ids} for ids in asked.seqs]
            params += sampling_params(sampling, asked.budgets, greedy=asked.greedy, seeds=seeds)
            loras += [self.served[name]] * len(asked.seqs)
        ids, logprobs = sampled(self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False))
        out, start = [], 0
        for _, _, asked in jobs:
            end = start + len(asked.seqs)
            out.append((ids[start:end], logprobs[start:end]))
            start = end
        return out

    def rest(self) -> None:
        """After a rollout: on a GPU with sleep mode, the engine's memory goes to the update."""
        if self.sleep_enabled and self.llm is not None and not self._asleep:
            self.llm.sleep(level=sleep_level(lora=True))
            self._asleep = True

    def forget(self, name: str) -> None:
        """Drop job `name`'s served adapter (it left, or a newer one replaces it)."""
        old = self.served.pop(name, None)
        if old is not None:
            if self.llm is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Shut the engine down and free its process-wide state, so that another can start in this process."""
        self._stop()
        shutil.rmtree(self._adapters, ignore_errors=True)

    # -- the engine -------------------------------------------------------------

    def _serve(self, shared: SharedBase, name: str) -> None:
        from vllm.lora.request import LoRARequest

        lora_id = self._next_id
        self._next_id += 1
        directory = self._adapters / f"adapter-{lora_id}"
        AdapterView(shared, name).save_pretrained(directory)
        self.forget(name)
        self.served[name] = LoRARequest(f"{name}-{lora_id}", lora_id, str(directory))

    def _restart(self, limits: tuple[int, int, int]) -> None:
        self._stop()
        max_model_len, rank, loras = limits
        self.llm = start_llm(self.spec, max_model_len=max_model_len, sleep=self.sleep_enabled, loras=loras,
                             lora_rank=rank)
        self.limits = limits

    def _stop(self) -> None:
        for name in list(self.served):
            self.forget(name)
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        self.llm, self._asleep = None, False
        cleanup_dist_env_and_memory()

    def _wake(self) -> None:
        if self._asleep:
            torch.cuda.empty_cache()  # the update's freed blocks back to the GPU, for the weights and KV cache
            self.llm.wake_up()
            self._asleep = False
