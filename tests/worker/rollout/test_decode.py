"""The rollout decode loop: same tokens as transformers' generate, LoRA folded in without touching the base,
the sampling law, finished rows leaving the batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from service.job_spec.sampling import SamplingSpec
from tests.worker.trainer.conftest import forward_shapes
from worker.rollout import decode, static_decode
from worker.rollout.effective_weights import rollout_weights
from worker.rollout.rollout_state import release_rollout_state, rollout_state_bytes
from worker.rollout.token_picking import Picker, logits_processors, pick_tokens

EOS, PAD = 2, 0
CPU = torch.device("cpu")


def prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 10, (n,), generator=g).tolist()
    return [[1] + torch.randint(4, 40, (k,), generator=g).tolist() for k in lengths]


def hf_greedy(model, rows: list[list[int]], max_new: int) -> list[list[int]]:
    P = max(map(len, rows))
    ids = torch.tensor([[PAD] * (P - len(r)) + r for r in rows])
    mask = (ids != PAD).long()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                             pad_token_id=PAD, eos_token_id=EOS)[:, P:].tolist()
    return [r[: r.index(EOS) + 1] if EOS in r else r for r in out]


def spec(**knobs) -> SamplingSpec:
    return SamplingSpec(max_output_tokens=12, max_model_len=64, **knobs)


def static_greedy(model, rows: list[list[int]], max_new: int, *, greedy: bool = True,
                  seeds: list[int] | None = None) -> list[list[int]]:
    """The static-cache loop (the one compiled on CUDA) run eagerly (sampling with `seeds` when not greedy)."""
    B, P = len(rows), max(map(len, rows))
    ids, mask, positions = decode.left_padded(rows, max_new, PAD)
    pick = Picker(spec(), greedy, (B, max_new), CPU, record=False, seeds=seeds)
    lengths = static_decode.static_loop(model, ids, mask, positions, P, max_new, pick, EOS)
    return [r[:n] for r, n in zip(ids[:, P:].tolist(), lengths.tolist())]


def test_greedy_tokens_equal_transformers_generate(lora_model):
    """Left padding, rows that stop at EOS at different steps, the adapter applied: token for token."""
    rows = prompts()
    expected = hf_greedy(lora_model, rows, 6)
    assert any(r[-1] == EOS for r in expected) and any(r[-1] != EOS for r in expected)  # both kinds of row
    with rollout_weights(lora_model) as merged:
        eager, no_logprobs = decode.sample_tokens(merged, rows, max_new=6, sampling=spec(), greedy=True, eos_id=EOS,
                                                  pad_id=PAD, device=CPU)
        static = static_greedy(merged, rows, 6)
        static_again = static_greedy(merged, rows, 6)  # the static cache is reused, emptied first
    assert eager == expected and no_logprobs is None
    assert static == expected
    assert static_again == expected
    with lora_model.disable_adapter():
        assert hf_greedy(lora_model, rows, 6) != expected  # the adapter matters, so the merge was really tested


def test_merging_never_writes_the_base_weights(lora_model):
    before = {n: p.detach().clone() for n, p in lora_model.named_parameters()}
    params_before = {n: p for n, p in lora_model.named_parameters()}
    for _ in range(3):
        with rollout_weights(lora_model):
            pass
    after = dict(lora_model.named_parameters())
    assert after.keys() == before.keys()
    for name, p in after.items():
        assert p is params_before[name], name  # the very same Parameter objects (the optimizer holds them)
        assert torch.equal(p, before[name]), name  # bit for bit: no merge/unmerge drift
    q_proj = lora_model.base_model.model.model.layers[0].self_attn.q_proj
    assert not q_proj.disable_adapters  # the adapter is back on after the block


def test_a_plain_model_decodes_as_it_is(toy_dir):
    model = AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32).eval()
    rows = prompts(3)
    with rollout_weights(model) as same:
        assert same is model
        assert decode.sample_tokens(same, rows, max_new=8, sampling=spec(), greedy=True, eos_id=EOS, pad_id=PAD,
                                    device=CPU)[0] == hf_greedy(model, rows, 8)


def test_finished_rows_leave_the_batch(lora_model):
    """Each forward after a row's EOS runs on fewer rows; the loop ends when every row is done."""
    rows = prompts()
    with forward_shapes(lora_model) as shapes, rollout_weights(lora_model) as merged:
        out, _ = decode.sample_tokens(merged, rows, max_new=40, sampling=spec(), greedy=True, eos_id=EOS,
                                      pad_id=PAD, device=CPU)
    batch_sizes = [b for b, _ in shapes]
    assert batch_sizes[0] == len(rows)
    assert batch_sizes == sorted(batch_sizes, reverse=True)
    still_running = [sum(len(o) > t for o in out) for t in range(1, len(batch_sizes))]
    assert batch_sizes[1:] == still_running  # step t decodes exactly the rows without EOS yet
    assert len(batch_sizes) == max(map(len, out))  # no step after the last row is done


def test_sampling_follows_the_softmax_and_honours_top_k():
    """Draw frequencies match softmax(logits / T); with top_k, tokens outside the top k are never drawn."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 0.0, 1.0, -1.0, 0.5])
    rows = 40_000
    history = torch.zeros((rows, 1), dtype=torch.long)
    picks = pick_tokens(logits.repeat(rows, 1), history, logits_processors(spec(temperature=2.0), greedy=False),
                         greedy=False)
    freq = torch.bincount(picks, minlength=5).float() / rows
    assert torch.allclose(freq, torch.softmax(logits / 2.0, -1), atol=0.01)
    picks = pick_tokens(logits.repeat(rows, 1), history, logits_processors(spec(top_k=2), greedy=False),
                         greedy=False)
    freq = torch.bincount(picks, minlength=5).float() / rows
    assert set(picks.unique().tolist()) == {0, 2}
    assert abs(freq[0] - torch.softmax(torch.tensor([2.0, 1.0]), -1)[0]) < 0.01


def test_a_rows_tokens_depend_on_its_seed_not_on_its_batch(lora_model):
    """Each row samples from its own seeded stream: alone, in another order, or in the static-cache loop, a row
    draws the same tokens; other seeds draw others."""
    rows, seeds = prompts(6), [11, 12, 13, 14, 15, 16]
    kw = dict(max_new=30, sampling=spec(), greedy=False, eos_id=EOS, pad_id=PAD, device=CPU)
    with rollout_weights(lora_model) as merged:
        together, _ = decode.sample_tokens(merged, rows, seeds=seeds, **kw)
        alone = [decode.sample_tokens(merged, [r], seeds=[s], **kw)[0][0] for r, s in zip(rows, seeds)]
        backwards = decode.sample_tokens(merged, rows[::-1], seeds=seeds[::-1], **kw)[0][::-1]
        static = static_greedy(merged, rows, 30, greedy=False, seeds=seeds)
        others, _ = decode.sample_tokens(merged, rows, seeds=[s + 100 for s in seeds], **kw)
    assert len({len(t) for t in together}) > 1  # rows that end at different steps, so the eager batch shrinks
    assert together == alone == backwards == static
    assert others != together


def test_one_job_through_the_shared_entry_is_the_solo_path_exactly(lora_model):
    """sample_jobs with one group of rows and no router runs what sample_tokens runs: the same tokens and log-probs,
    bit for bit (sampled and greedy, groups sharing a prompt, rows ending at EOS at various steps)."""
    rows, seeds = [p for p in prompts(3) for _ in range(2)], list(range(6))
    with rollout_weights(lora_model) as merged:
        for greedy in (False, True):
            knobs = dict(sampling=spec(temperature=0.8, repetition_penalty=1.1), greedy=greedy, logprobs=True,
                         seeds=None if greedy else seeds)
            solo = decode.sample_tokens(merged, rows, max_new=20, eos_id=EOS, pad_id=PAD, device=CPU, **knobs)
            (shared,) = decode.sample_jobs(merged, None, [decode.JobRows(None, rows, 20, **knobs)], eos_id=EOS,
                                           pad_id=PAD, device=CPU)
            assert shared == solo
            assert any(t[-1] == EOS for t in solo[0]) and len({len(t) for t in solo[0]}) > 1

def test_processors_come_from_the_spec_only():
    """The spec's identity knobs add nothing (top_k=0 means no top-k); greedy keeps only the repetition penalty."""
    assert len(logits_processors(spec(), greedy=False)) == 0
    names = [type(p).__name__ for p in logits_processors(
        spec(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.1), greedy=False)]
    assert names == ["RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper",
                     "TopPLogitsWarper", "MinPLogitsWarper"]
    greedy = logits_processors(spec(temperature=0.7, top_k=5, repetition_penalty=1.1), greedy=True)
    assert [type(p).__name__ for p in greedy] == ["RepetitionPenaltyLogitsProcessor"]


def test_each_distinct_prompt_is_prefilled_once(lora_model):
    """Groups share a prompt: the first forward runs on the distinct prompts only, and every row still gets the
    tokens generate() gives it."""
    rows = [p for p in prompts(3) for _ in range(4)]  # three groups of four completions
    with forward_shapes(lora_model) as shapes, rollout_weights(lora_model) as merged:
        out, _ = decode.sample_tokens(merged, rows, max_new=6, sampling=spec(), greedy=True, eos_id=EOS,
                                      pad_id=PAD, device=CPU)
    batch_sizes = [b for b, _ in shapes]
    assert batch_sizes[0] == 3
    assert batch_sizes[1] == sum(len(o) > 1 for o in out)  # then one row per completion
    assert out == hf_greedy(lora_model, rows, 6)


def _effective_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_a_lower_rollout_dtype_runs_every_weight_in_it_and_writes_none(lora_model):
    """bfloat16 rollouts of a float32 model: every weight the forward uses is a bfloat16 copy of the effective
    weight (adapter folded in); afterwards the model's own parameters are the same objects, bit for bit."""
    before = {n: (p, p.detach().clone()) for n, p in lora_model.named_parameters()}
    ids = torch.tensor(prompts(4)[0])[None]
    full = _effective_logits(lora_model, ids)
    with rollout_weights(lora_model, torch.bfloat16) as low:
        used = {n: p.dtype for n, p in low.named_parameters() if ".lora_" not in n}
        low_logits = _effective_logits(low, ids)
    assert set(used.values()) == {torch.bfloat16}
    gap = (low_logits - full).abs().max()
    assert 0 < gap < 0.05 * full.abs().max()  # rounded, yet the adapted model's logits, not the base's
    with lora_model.disable_adapter():
        base_gap = (_effective_logits(lora_model, ids) - full).abs().max()
    assert gap < base_gap / 5
    for name, p in lora_model.named_parameters():
        assert p is before[name][0] and p.dtype == torch.float32 and torch.equal(p, before[name][1]), name


def test_tied_weights_stay_tied_in_a_lower_dtype(toy_dir):
    model = AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32)
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # as a tied checkpoint loads
    with rollout_weights(model, torch.bfloat16) as low:
        assert low.get_input_embeddings().weight is low.get_output_embeddings().weight
        assert low.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert model.get_input_embeddings().weight.dtype == torch.float32


def _trainer_logprobs(model, rows, outs, temperature):
    from worker.trainer.scoring import collate_sequences, sequence_logprobs

    batch = collate_sequences([r + o for r, o in zip(rows, outs)], [[0] * len(r) + [1] * len(o)
                                                                     for r, o in zip(rows, outs)],
                              pad_id=PAD, device=CPU)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, batch, temperature=temperature, chunk_size=64)
    return [logp[i][batch.action_mask_BT[i].bool()] for i in range(len(rows))]


@pytest.mark.parametrize("dtype, tolerance", [(None, 1e-4), (torch.bfloat16, 0.2)])
def test_reported_logprobs_are_what_the_trainer_scores(lora_model, dtype, tolerance):
    """Each sampled token's reported log-prob is log softmax(logits / T) at that token: equal to the trainer's score
    in the same precision, off by the rounding (not more) in bfloat16."""
    rows = prompts(6)
    torch.manual_seed(3)
    with rollout_weights(lora_model, dtype) as sampler:
        outs, reported = decode.sample_tokens(sampler, rows, max_new=8, sampling=spec(temperature=0.7),
                                              greedy=False, eos_id=EOS, pad_id=PAD, device=CPU, logprobs=True)
    assert [len(r) for r in reported] == [len(o) for o in outs]
    trainer = _trainer_logprobs(lora_model, rows, outs, 0.7)
    gaps = torch.cat([torch.tensor(r) - t for r, t in zip(reported, trainer)]).abs()
    assert gaps.max() < tolerance
    if dtype is not None:
        assert gaps.mean() > 1e-4  # the bfloat16 sampler really is a different computation


def test_min_output_tokens_suppresses_eos_until_then():
    """EOS is the best token by far: without a minimum greedy picks it at once; with min_output_tokens 2 the runner-up
    is picked at steps 0 and 1 and EOS at step 2; the recorded log-prob is the unmasked distribution's."""
    logits = torch.tensor([[0.0, 0.0, 5.0, 1.0, 0.0]])  # EOS = 2
    history = torch.zeros((1, 1), dtype=torch.long)
    plain = Picker(spec(), True, (1, 4), CPU, record=True, eos_id=EOS)
    assert plain(logits, history, slice(None), 0).tolist() == [EOS]
    held = Picker(spec(min_output_tokens=2), True, (1, 4), CPU, record=True, eos_id=EOS)
    assert [held(logits, history, slice(None), t).item() for t in range(3)] == [3, 3, EOS]
    expected = torch.log_softmax(logits, -1)[0]
    torch.testing.assert_close(held.logprobs_BT[0, :3], expected[[3, 3, EOS]])


def test_min_output_tokens_in_the_decode_loop(lora_model):
    rows = prompts()
    with rollout_weights(lora_model) as merged:
        free, _ = decode.sample_tokens(merged, rows, max_new=6, sampling=spec(), greedy=True, eos_id=EOS,
                                       pad_id=PAD, device=CPU)
        held, _ = decode.sample_tokens(merged, rows, max_new=6, sampling=spec(min_output_tokens=4), greedy=True,
                                       eos_id=EOS, pad_id=PAD, device=CPU)
    assert any(len(r) < 4 for r in free)  # some rows end early without a minimum
    assert all(len(r) >= 4 and EOS not in r[:4] for r in held)


def test_a_float32_head_in_a_bf16_rollout(lora_model):
    """The head's weight is a float32 copy and its input is cast up, so the logits are float32 matmuls; the
    model is left as it was."""
    ids = torch.tensor(prompts(4)[0])[None]
    head = lora_model.get_output_embeddings()
    before = head.weight
    with rollout_weights(lora_model, torch.bfloat16, head_float32=True) as low:
        assert low.get_output_embeddings().weight.dtype == torch.float32
        assert low.get_input_embeddings().weight.dtype == torch.bfloat16
        logits = low(input_ids=ids).logits
    assert logits.dtype == torch.float32
    assert head.weight is before and not head._forward_pre_hooks
def test_the_adapter_runs_unmerged_giving_peft_logits_bit_for_bit_without_weight_copies(lora_model):
    """No copy of any adapted weight is made for a rollout (a full copy of the linears: 1.4 GB at 0.5B in float32),
    and the lean unmerged forward gives PEFT's own logits exactly, not a merge's rounding of them."""
    lora_model.eval()
    release_rollout_state(lora_model, above_bytes=0)  # what earlier tests' lower-dtype rollouts kept
    ids = torch.tensor(prompts(4)[0])[None]
    expected = _effective_logits(lora_model, ids)
    with rollout_weights(lora_model) as sampler:
        got = _effective_logits(sampler, ids)
        assert rollout_state_bytes(lora_model) == 0
    assert torch.equal(got, expected)
    with lora_model.disable_adapter():
        assert not torch.equal(_effective_logits(lora_model, ids), expected)  # the adapter does change the logits
    assert _effective_logits(lora_model, ids).equal(expected)  # PEFT's forward is back
