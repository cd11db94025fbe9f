"""A fine-tuned model to serve, recorded the way a worker records one (tests/service/api/trained.py), with real
adapters: LoRA weights drawn at random on the tiny model, saved as trainer checkpoints and uploaded like a worker's,
and what the base plus such an adapter generates greedily in this process (the expected answer)."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.db.session import session_factory
from service.repositories import job_lease, job_records
from service.job_spec.sampling import SamplingSpec
from worker.checkpoints.artifacts import upload_checkpoint
from worker.checkpoints.checkpoint import checkpoint_name, save_checkpoint
from worker.rollout.decode import sample_tokens
from worker.rollout.effective_weights import rollout_weights
from worker.model.turns import encode_prompt

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter_checkpoint(model_dir: Path, out: Path, *, step: int, seed: int) -> Path:
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=LINEAR))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)  # far from zero: the fine-tuned model must answer unlike its base
    return save_checkpoint(out / checkpoint_name(step), model=model, optimizer=None, state={"step": step})


def record_training(database_url: str, store, job_id: str, checkpoints: dict[int, Path]) -> dict[int, str]:
    """Claim the job, upload and record each checkpoint under the lease, then succeed; {step: checkpoint id}."""
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        epoch = job_lease.claim(s, job_id, "test-worker", ttl_s=600)
        assert epoch is not None
    ids = {}
    for step, local in sorted(checkpoints.items()):
        prefix, files = upload_checkpoint(store, job_id, epoch, local)
        with sessions.begin() as s:
            ckpt = job_records.add_checkpoint(s, job_id, epoch, step=step, storage_prefix=prefix, files=files,
                                              metrics={})
            ids[step] = ckpt.id
    with sessions.begin() as s:
        assert job_lease.finish(s, job_id, epoch, "succeeded")
    return ids


def local_greedy(model_dir: Path, adapter_dir: Path | None, prompt: str | list[dict], max_new: int) -> dict:
    """What the base (plus the adapter) generates greedily here: text, finish_reason and token counts."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    ids = encode_prompt(tok, prompt)
    with rollout_weights(model) as m:
        tokens, _ = sample_tokens(m, [ids], max_new=max_new, sampling=SamplingSpec(), greedy=True,
                                  eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, device=torch.device("cpu"))
    new = tokens[0]
    ended = tok.eos_token_id in new
    return {"text": tok.decode(new, skip_special_tokens=True), "finish_reason": "stop" if ended else "length",
            "prompt_tokens": len(ids), "completion_tokens": len(new)}
