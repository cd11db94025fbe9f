"""The recipe knobs together in a real (tiny) training run: every one of them reaches the step it changes."""

from __future__ import annotations

import json
import math

from service.job_spec.spec import JobSpec
from worker.toy.__main__ import toy_spec
from worker.trainer.loop import Trainer

ROWS = [{"prompt": f"{w}=", "answer": w[-1]} for w in ("ba", "cda", "ab", "ec", "fd", "be")]


def solved_or_partial(completion: str, answer: str, **_row) -> float:
    """Prompts answered 'a' always pass (1.0); the others never do (0.5 for a completion starting with a, b or c,
    else 0: a spread of rewards below the pass mark)."""
    return 1.0 if answer == "a" else 0.5 * float(completion[:1] in ("a", "b", "c"))


def test_a_run_with_every_recipe_knob_on(toy_dir, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    raw = toy_spec(toy_dir)
    raw["data"] = {"train_file": str(train)}
    raw["dtype"] = "bfloat16"  # the float32 head matters only below float32
    raw["sampling"].update({"min_output_tokens": 2})
    raw["advantages"] = {"scale": "batch_std"}
    raw["loss"] = {"normalization": "prompt", "importance_sampling_level": "sequence",
                   "off_policy_mask": {"sequence_threshold": 0.03}}
    raw["training"].update({"steps": 2, "batch_size": 4, "group_size": 4, "mini_batches": 2, "micro_batch_size": 8,
                            "eval_interval": 0, "eval_max_rows": 4, "checkpoint_interval": 0, "preflight_groups": 0,
                            "lm_head_float32": True, "pass_rate_filter": {"threshold": 0.9}})
    spec = JobSpec.model_validate(raw)
    seen: list[dict] = []

    class Collect:
        def on_step(self, step, metrics): seen.append(metrics)
        def on_eval(self, step, metrics): pass
        def on_checkpoint(self, step, path): pass
        def should_stop(self): return False

    trainer = Trainer(spec, tmp_path / "out", reward_fn=solved_or_partial)
    assert trainer.policy.lm_head_float32
    trainer.run(Collect())
    assert len(seen) == 2 and all(math.isfinite(m["loss"]) for m in seen)
    assert all("off_policy_masked_fraction" in m for m in seen)
    assert all(m["completion_length_mean"] >= 2 for m in seen)  # EOS held back for two tokens
    # Both 'a' prompts were drawn in the first 6 draws (one epoch), passed every time, and are retired.
    assert {ROWS[i]["answer"] for i in trainer.sampler.retired} == {"a"} and seen[-1]["retired_prompts"] == 2.0
    assert trainer.sampler.state()["retired"] == sorted(trainer.sampler.retired)
