"""Multi-turn rollouts on the tiny model: token bookkeeping, the action mask, zero gradient on environment tokens."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from service.job_spec.spec import JobSpec
from tests.specs import job_spec
from worker.cispo import LossInputs, cispo_loss
from worker.envs.protocol import Outcome, failed
from service.sandbox.spawn import sandbox_level
from worker.toy.__main__ import toy_spec
from worker.toy.task import write_jsonl
from worker.toy.two_turn import environment_spec, plain_chat_model
from worker.trainer.callbacks import NoCallbacks
from worker.trainer.loop import Trainer
from worker.model.policy import load_policy
from worker.rollout import rollout as rollout_module
from worker.rollout.rollout import generate
from worker.trainer.scoring import collate_sequences, sequence_logprobs
from worker.model.turns import chat_ids, environment_turn_ids

ROWS = [{"prompt": "abc="}, {"prompt": "fed="}, {"prompt": "bb="}]


def env_spec(toy_dir: Path, **training) -> JobSpec:
    return job_spec(toy_spec(toy_dir), reward=None, environment=environment_spec(),
                    sampling={"temperature": 1.0, "max_output_tokens": 4, "max_model_len": 64},
                    training={"steps": 2, "batch_size": 2, "group_size": 4, "mini_batches": 2, "micro_batch_size": 8,
                              "eval_interval": 0, "eval_max_rows": 4, "checkpoint_interval": 0, "max_turns": 2,
                              **training})


class Scripted:
    """An in-process Environment test double: observation and reward from `reply(turn, action, row)`."""

    def __init__(self, reply, first: str = "letter?"):
        self.reply, self.first = reply, first
        self.rows: dict[str, dict] = {}
        self.actions: dict[str, list[str]] = defaultdict(list)
        self.released: list[str] = []

    def reset(self, episodes):
        for eid, _seed, row in episodes:
            self.rows[eid] = row
        return [Outcome(observation=self.first) for _ in episodes]

    def step(self, actions):
        out = []
        for eid, action in actions:
            self.actions[eid].append(action)
            out.append(self.reply(len(self.actions[eid]), action, self.rows[eid]))
        return out

    def release(self, ids):
        self.released += ids

    def close(self):
        pass


def word_then_done(turn, action, row):
    if turn == 1:
        return Outcome(observation=row["prompt"], reward=0.5)
    return Outcome(reward=1.0, terminated=True)


@pytest.fixture(scope="module")
def policy(toy_dir):
    torch.manual_seed(0)
    return load_policy(env_spec(toy_dir), resume_from=None, warm_start=None)


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_generated_ids_are_trained_verbatim_and_environment_turns_are_masked(policy, toy_dir, monkeypatch):
    """Each turn's sampled ids appear unchanged under mask 1; the context fed to the sampler is the sequence so far."""
    spec = env_spec(toy_dir)
    tok = policy.tokenizer
    calls = []
    real_sample = rollout_module.sample_tokens

    def spy(model, prompts, **kw):
        out = real_sample(model, prompts, **kw)
        calls.append(([list(p) for p in prompts], out[0]))
        return out

    env = Scripted(word_then_done)
    monkeypatch.setattr(rollout_module, "sample_tokens", spy)
    torch.manual_seed(1)
    rollout = generate(policy, ROWS, spec.sampling, group_size=2, environment=env, max_turns=2, seeds=[1, 2, 3])
    assert len(calls) == 2 and len(rollout) == 6
    assert rollout.turns == [2] * 6 and rollout.turn_rewards == [[0.5, 1.0]] * 6
    assert sorted(env.released) == sorted(env.actions)
    tag = next(iter(env.actions)).rsplit("-", 1)[0]
    for i, (ids, mask) in enumerate(zip(rollout.token_ids, rollout.action_mask)):
        assert len(ids) == len(mask) <= spec.sampling.max_model_len
        runs = _runs(mask)
        assert len(runs) == 2, "one run of action tokens per turn"
        for turn, (start, end) in enumerate(runs):
            fed, new = calls[turn][0][i], calls[turn][1][i]
            assert fed == ids[:start]  # the context is the sequence so far (an EOS that ended turn 0 included)
            assert ids[start:end] == new[:end - start]  # sampled ids, verbatim
            assert tok.decode(ids[start:end], skip_special_tokens=True) == env.actions[f"{tag}-{i}"][turn]
        assert rollout.action_turns[i] == [0] * (runs[0][1] - runs[0][0]) + [1] * (runs[1][1] - runs[1][0])
        between = tok.decode(ids[runs[0][1]:runs[1][0]])
        assert between == f"\nuser: {ROWS[i // 2]['prompt']}\nassistant: "  # the environment turn, mask 0
        assert tok.decode(ids[:runs[0][0]]) == "user: letter?\nassistant: "


def test_environment_tokens_get_exactly_zero_gradient(policy, toy_dir):
    """d loss / d logits and d loss / d logp are exactly 0 on environment (and prompt) targets, non-zero on actions."""
    spec = env_spec(toy_dir)
    torch.manual_seed(2)
    rollout = generate(policy, ROWS[:2], spec.sampling, group_size=2, environment=Scripted(word_then_done),
                       max_turns=2, seeds=[0, 0])
    batch = collate_sequences(rollout.token_ids, rollout.action_mask, pad_id=policy.tokenizer.pad_token_id,
                              device="cpu")
    action = batch.action_mask_BT.bool()
    context = batch.attention_mask_BT.bool() & ~action & (batch.targets_BT != policy.tokenizer.pad_token_id)
    env_targets = torch.zeros_like(action)
    for i, mask in enumerate(rollout.action_mask):
        (s0, e0), (s1, _) = _runs(mask)
        env_targets[i, e0 - 1:s1 - 1] = True  # targets are shifted by one
    assert env_targets.any() and not (env_targets & action).any()
    advantages_BT = torch.tensor([1.0, -0.5, 0.25, -2.0])[:, None].expand_as(action).clone()

    model = policy.model
    model.train()
    logp, _ = sequence_logprobs(model, batch, temperature=1.0, chunk_size=16)
    logp.retain_grad()
    cispo_loss(LossInputs(logp, logp.detach(), advantages_BT, batch.action_mask_BT),
               normalizer=float(batch.num_action_tokens)).loss.backward()
    assert (logp.grad[env_targets] == 0).all() and (logp.grad[context] == 0).all()
    assert (logp.grad[action] != 0).all()

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    logits.retain_grad()
    logp_full = torch.log_softmax(logits.float(), -1).gather(-1, batch.targets_BT[..., None]).squeeze(-1)
    cispo_loss(LossInputs(logp_full, logp_full.detach(), advantages_BT, batch.action_mask_BT),
               normalizer=float(batch.num_action_tokens)).loss.backward()
    assert (logits.grad[env_targets] == 0).all()  # every vocabulary entry, at every environment position
    assert (logits.grad[action].abs().sum(-1) > 0).all()
    lora_grads = [p.grad for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    assert lora_grads and any(g.abs().sum() > 0 for g in lora_grads)
    model.zero_grad(set_to_none=True)


def test_max_model_len_cuts_episodes_and_flags_truncation(policy, toy_dir):
    """An environment turn that does not fit ends the episode (flagged); a turn cut by the budget is flagged too."""
    tok = policy.tokenizer
    prompt = len(chat_ids(tok, [{"role": "user", "content": "letter?"}]))
    long_word = "abcdef" * 6

    def long_then_done(turn, action, row):
        return Outcome(observation=long_word, reward=1.0) if turn == 1 else Outcome(reward=1.0, terminated=True)

    max_len = prompt + 4 + 20  # room for the first answer, not for the second observation
    spec = env_spec(toy_dir).model_copy(update={"sampling": env_spec(toy_dir).sampling.model_copy(
        update={"max_model_len": max_len})})
    env = Scripted(long_then_done)
    rollout = generate(policy, ROWS, spec.sampling, group_size=2, environment=env, max_turns=3, seeds=[0, 0, 0])
    assert rollout.truncated == [True] * 6 and rollout.turns == [1] * 6
    assert all(len(ids) <= max_len and sum(m) == len(ids) - prompt for ids, m in
               zip(rollout.token_ids, rollout.action_mask))  # nothing of the environment turn was appended
    assert rollout.turn_rewards == [[1.0]] * 6

    # Room for the observation but not for a whole answer: the second turn is cut at max_model_len.
    short = "ab"
    segment = len(tok("\nuser: " + short + "\nassistant: ", add_special_tokens=False)["input_ids"])
    spec2 = spec.model_copy(update={"sampling": spec.sampling.model_copy(update={
        "max_model_len": prompt + 4 + segment + 1, "max_output_tokens": 4})})

    def short_then_done(turn, action, row):
        return Outcome(observation=short) if turn == 1 else Outcome(reward=1.0, terminated=True)

    torch.manual_seed(3)
    rollout = generate(policy, ROWS * 4, spec2.sampling, group_size=2, environment=Scripted(short_then_done),
                       max_turns=2, seeds=[0] * 12)
    cut = 0
    for ids, turns, truncated in zip(rollout.token_ids, rollout.turns, rollout.truncated):
        assert turns == 2 and len(ids) <= spec2.sampling.max_model_len
        if len(ids) == spec2.sampling.max_model_len and ids[-1] != tok.eos_token_id:
            assert truncated
            cut += 1
    assert cut > 0, "some second answer should have hit max_model_len"


def test_environment_segment_does_not_repeat_an_eos_the_template_closes_with(policy):
    """With a ChatML-like template whose assistant turn ends in EOS, a sampled EOS is not added twice."""
    tok = policy.tokenizer
    template = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    try:
        history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        after_eos = environment_turn_ids(tok, history, [{"role": "user", "content": "ab"}], action_ended_with_eos=True)
        cut = environment_turn_ids(tok, history, [{"role": "user", "content": "ab"}], action_ended_with_eos=False)
    finally:
        tok.chat_template = template
    assert tok.decode(after_eos) == "\nuser: ab</s>\nassistant: "
    assert tok.decode(cut) == "</s>\nuser: ab</s>\nassistant: "


def test_environment_failures_are_counted_not_fatal(toy_dir, tmp_path):
    """A step that fails for some episodes gives them the failure score and counts them in reward_errors."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": p} for p in ("abc=", "fed=", "bb=", "cc=")])
    spec = env_spec(toy_dir, reward_failure_score=-1.0, batch_size=4, group_size=2)
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"train_file": str(train),
                                                                        "validation_file": None})})

    def flaky(turn, action, row):
        if row["prompt"] == "abc=" and turn == 2:
            return failed("boom")
        return word_then_done(turn, action, row)

    trainer = Trainer(spec, tmp_path / "run", environment=Scripted(flaky))
    metrics = trainer.train_step()
    assert metrics["reward_errors"] == 2.0  # the group of 'abc=' failed at its second step
    assert metrics["reward_mean"] == pytest.approx((2 * -1.0 + 6 * 1.5) / 8)
    assert metrics["turns_mean"] == 2.0 and metrics["optimizer_steps"] == 2.0


@pytest.mark.slow
@pytest.mark.skipif(sandbox_level() != "namespaces", reason="this host cannot sandbox user code")
def test_cispo_learns_a_two_turn_environment(toy_dir, tmp_path):
    """A sandboxed two-turn environment whose reward depends only on the second answer: the reward rises.

    About 15 s on 2 CPU cores (100 steps; see worker/toy/two_turn.py for why the model gets a plain chat template).
    """
    raw = toy_spec(toy_dir)
    raw.pop("reward")
    raw["model"] = str(plain_chat_model(toy_dir / "model", tmp_path / "model"))
    raw["environment"] = environment_spec()
    raw["sampling"] = {"temperature": 1.0, "max_output_tokens": 2, "max_model_len": 64}  # a letter and EOS
    raw["optimizer"] = {"lr": 2e-3}
    raw["training"].update({"steps": 100, "max_turns": 2, "eval_interval": 0, "checkpoint_interval": 0})
    spec = JobSpec.model_validate(raw)
    rewards, turns = [], []

    class Collect(NoCallbacks):
        def on_step(self, step, metrics):
            rewards.append(metrics["reward_mean"])
            turns.append(metrics["turns_mean"])
            assert metrics["reward_errors"] == 0

    result = Trainer(spec, tmp_path / "run").run(Collect())
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    before, after = result.first_eval["eval_reward_mean"], result.last_eval["eval_reward_mean"]
    print(f"two-turn train reward {first:.3f} -> {last:.3f}; eval (greedy) {before:.3f} -> {after:.3f}")
    assert set(turns) == {2.0}
    assert last > first + 0.05
    assert after >= before + 0.25


def test_a_trainer_step_against_an_http_environment(toy_dir, tmp_path):
    """The job's ScoringContext (egress policy, secrets) reaches the HTTP environment; episodes run two turns."""
    from service.egress import EgressPolicy
    from tests.worker.envs.test_http_env import env_server
    from worker.rewards.engine import ScoringContext

    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "unused", "q": w} for w in ("ab", "cd")])
    with env_server() as (base, server):
        raw = env_spec(toy_dir, batch_size=2, group_size=2, max_turns=4).model_dump(mode="json")
        raw["environment"] = {"type": "http", "url": f"{base}/good", "auth_secret": "env-key"}
        raw["data"] = {"train_file": str(train)}
        raw["sampling"]["max_model_len"] = 128  # the server's observations are long
        spec = JobSpec.model_validate(raw)
        context = ScoringContext(secrets={"env-key": "Bearer t"}, egress=EgressPolicy.from_setting("127.0.0.1"))
        trainer = Trainer(spec, tmp_path / "run", scoring=context)
        try:
            metrics = trainer.train_step()
        finally:
            trainer.environment.close()
    assert metrics["reward_errors"] == 0 and metrics["turns_mean"] == 2.0  # the server ends episodes at turn 2
    assert metrics["reward_mean"] == pytest.approx(1.0)  # 0.5 per turn
    assert {r["auth"] for r in server.requests} == {"Bearer t"}
    resets = [r["body"] for r in server.requests if r["op"] == "reset"]
    assert len(resets) == 4 and len({r["episode_id"] for r in resets}) == 4
    assert len({r["seed"] for r in resets}) == 2  # one seed per prompt, shared by its group


@pytest.mark.skipif(sandbox_level() != "namespaces", reason="this host cannot sandbox user code")
def test_sandboxed_python_environment_errors_are_recorded(toy_dir, tmp_path):
    """An exception in step and a malformed return end those episodes with the failure score; the step goes on."""
    source = '''
class Picky:
    def reset(self, seed, row):
        self.word = row["prompt"]
        return "letter?"

    def step(self, action):
        if self.word == "abc=":
            raise KeyError("no such letter")
        if self.word == "fed=":
            return "not", "a", "tuple"
        return None, 1.0, True, False, {}
'''
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": p} for p in ("abc=", "fed=", "bb=", "cc=")])
    spec = env_spec(toy_dir, reward_failure_score=-1.0, batch_size=4, group_size=2, reward_error_threshold=1.0)
    raw = spec.model_dump(mode="json")
    raw["environment"] = {"type": "python", "source": source, "class_name": "Picky"}
    raw["data"] = {"train_file": str(train)}
    trainer = Trainer(JobSpec.model_validate(raw), tmp_path / "run")
    errors = []
    trainer.callbacks.on_reward_errors = lambda step, messages: errors.extend(messages)
    try:
        metrics = trainer.train_step()
    finally:
        trainer.environment.close()
    assert metrics["reward_errors"] == 4.0 and metrics["reward_mean"] == pytest.approx((4 * -1.0 + 4 * 1.0) / 8)
    assert sum("KeyError: 'no such letter'" in e for e in errors) == 2
    assert sum("step must return" in e for e in errors) == 2


def test_a_groups_prompt_is_encoded_once_not_once_per_completion(toy_dir):
    from unittest import mock

    from transformers import AutoTokenizer

    from service.job_spec.sampling import SamplingSpec
    from worker.rollout.rollout import rollout_turns

    tok = AutoTokenizer.from_pretrained(toy_dir / "model")
    encoded, real = [], type(tok).__call__
    rows = [{"prompt": "ab="}, {"prompt": "cd="}]
    with mock.patch.object(type(tok), "__call__", lambda self, text, *a, **k: encoded.append(text) or real(
            self, text, *a, **k)):
        turns = rollout_turns(tok, rows, SamplingSpec(max_output_tokens=4), group_size=4, sampling_seeds=[1, 2])
        asked = next(turns)
        with pytest.raises(StopIteration) as done:
            turns.send(([[tok.eos_token_id] for _ in asked.seqs], None))
    assert encoded == ["ab=", "cd="]
    rollout = done.value.value
    assert len(rollout) == 8 and rollout.token_ids[0][:-1] == rollout.token_ids[3][:-1] == real(tok, "ab=")["input_ids"]
    assert rollout.token_ids[0] is not rollout.token_ids[1]  # each completion's sequence is its own list


def _counting_weights(monkeypatch) -> list[dict]:
    """Every rollout_weights hold the transformers sampler takes, by its keyword arguments."""
    holds = []
    real = rollout_module.rollout_weights

    def counting(model, dtype=None, **kw):
        holds.append(kw)
        return real(model, dtype, **kw)

    monkeypatch.setattr(rollout_module, "rollout_weights", counting)
    return holds


def test_a_multi_turn_rollout_makes_its_sampling_weights_once_not_once_per_turn(policy, toy_dir, monkeypatch):
    """Every turn of a rollout samples the same weights, so their copies (cast, folded, float32-packed: 1.1 s at
    the 0.5B shape) are made at its first turn and held to its end; the model's own weights and mode come back."""
    sampling = env_spec(toy_dir).sampling.model_copy(update={"max_model_len": 128})
    holds = _counting_weights(monkeypatch)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    policy.model.train()
    rollout = generate(policy, ROWS, sampling, group_size=2, environment=Scripted(lambda turn, action, row:
                       Outcome(observation="a", terminated=turn == 3)), max_turns=3, seeds=[1, 2, 3])
    assert rollout.turns == [3] * 6 and len(holds) == 1
    assert policy.model.training  # eval for the rollout only
    for n, p in policy.model.named_parameters():
        assert torch.equal(p, before[n]), n

    holds.clear()  # a failing environment still ends the hold (the model back in train mode)
    with pytest.raises(RuntimeError, match="environment down"):
        generate(policy, ROWS, sampling, group_size=2, environment=Scripted(_fail_on_second_turn), max_turns=3,
                 seeds=[1, 2, 3])
    assert len(holds) == 1 and policy.model.training
    rollout = generate(policy, ROWS, sampling, group_size=2, environment=Scripted(word_then_done), max_turns=2,
                       seeds=[1, 2, 3])  # and the next rollout makes its own
    assert rollout.turns == [2] * 6 and len(holds) == 2


def _fail_on_second_turn(turn, action, row):
    if turn == 2:
        raise RuntimeError("environment down")
    return Outcome(observation="again")


@pytest.mark.parametrize("max_output_tokens, packs", [(4, False), (7, False), (8, True), (32, True)])
def test_float32_packing_waits_for_a_rollout_long_enough_to_repay_it(policy, toy_dir, monkeypatch,
                                                                     max_output_tokens, packs):
    """Packing a float32 weight costs 1-3 of its matmuls: a rollout of fewer than PACK_MIN_NEW_TOKENS new
    tokens runs the weights as they are."""
    holds = _counting_weights(monkeypatch)
    sampling = env_spec(toy_dir).sampling.model_copy(update={"max_output_tokens": max_output_tokens})
    generate(policy, ROWS[:1], sampling, group_size=2)
    assert [h["pack"] for h in holds] == [packs]
