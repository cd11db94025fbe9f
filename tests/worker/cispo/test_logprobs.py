"""token_logprobs (chunked: fused for linear heads, checkpointed otherwise) against the naive full log-softmax."""

from __future__ import annotations

import pytest
import torch

from worker.cispo.logprobs import token_logprobs

B, T, H, V = 2, 5, 6, 11  # B * T = 10 token rows
TOL = dict(rtol=1e-5, atol=1e-5)


def _setup(seed=0):
    torch.manual_seed(seed)
    head = torch.nn.Linear(H, V)
    hidden = (2 * torch.randn(B, T, H)).requires_grad_()
    targets = torch.randint(0, V, (B, T))
    return head, hidden, targets


def _naive(head, hidden, targets, temperature):
    logp_BTV = torch.log_softmax(head(hidden).float() / temperature, dim=-1)
    logp = logp_BTV.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return logp, entropy


CASES = pytest.mark.parametrize(
    "chunk_size,temperature", [(c, t) for c in (1, 3, 7, 64) for t in (1.0, 0.7, 2.0)]
)


@CASES
def test_values_match_naive(chunk_size, temperature):
    """Log-probs and entropy equal the naive full-vocabulary computation for any chunking."""
    head, hidden, targets = _setup()
    logp, entropy = token_logprobs(head, hidden, targets, temperature=temperature, chunk_size=chunk_size)
    ref_logp, ref_entropy = _naive(head, hidden, targets, temperature)
    assert logp.shape == entropy.shape == (B, T)
    torch.testing.assert_close(logp, ref_logp, **TOL)
    torch.testing.assert_close(entropy, ref_entropy.detach(), **TOL)
    assert logp.requires_grad and not entropy.requires_grad


@CASES
def test_gradients_match_naive(chunk_size, temperature):
    """Gradients w.r.t. hidden states and the head's weight and bias equal the naive ones."""
    head, hidden, targets = _setup(1)
    cot = torch.randn(B, T)  # arbitrary upstream gradient, so every row's gradient is checked

    logp, _ = token_logprobs(head, hidden, targets, temperature=temperature, chunk_size=chunk_size)
    got = torch.autograd.grad((logp * cot).sum(), [hidden, head.weight, head.bias])
    ref_logp, _ = _naive(head, hidden, targets, temperature)
    want = torch.autograd.grad((ref_logp * cot).sum(), [hidden, head.weight, head.bias])

    for g, w in zip(got, want):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, w, **TOL)


def test_head_gradient_when_hidden_is_frozen():
    """With hidden states that need no gradient the head's parameters still get the naive gradient."""
    head, hidden, targets = _setup(2)
    hidden = hidden.detach()
    logp, _ = token_logprobs(head, hidden, targets, temperature=0.7, chunk_size=3)
    (got,) = torch.autograd.grad(logp.sum(), [head.weight])
    (want,) = torch.autograd.grad(_naive(head, hidden, targets, 0.7)[0].sum(), [head.weight])
    torch.testing.assert_close(got, want, **TOL)


def test_frozen_head_as_under_lora():
    """LoRA leaves the LM head frozen (weight and bias need no gradient): the hidden states get the naive gradient."""
    head, hidden, targets = _setup(7)
    head.requires_grad_(False)
    logp, _ = token_logprobs(head, hidden, targets, temperature=0.7, chunk_size=3)
    (got,) = torch.autograd.grad(logp.sum(), [hidden])
    (want,) = torch.autograd.grad(_naive(head, hidden, targets, 0.7)[0].sum(), [hidden])
    torch.testing.assert_close(got, want, **TOL)


def test_works_under_no_grad():
    """Under torch.no_grad the result matches the naive one and carries no graph."""
    head, hidden, targets = _setup(3)
    with torch.no_grad():
        logp, entropy = token_logprobs(head, hidden, targets, temperature=0.7, chunk_size=4)
        ref_logp, ref_entropy = _naive(head, hidden, targets, 0.7)
    assert not logp.requires_grad and not entropy.requires_grad
    torch.testing.assert_close(logp, ref_logp, **TOL)
    torch.testing.assert_close(entropy, ref_entropy, **TOL)


def test_low_precision_head_scored_in_float32():
    """A bfloat16 head still returns float32 log-probs that match the naive upcast computation."""
    head, hidden, targets = _setup(4)
    head = head.to(torch.bfloat16)
    hidden = hidden.detach().to(torch.bfloat16)
    logp, entropy = token_logprobs(head, hidden, targets, temperature=0.7, chunk_size=3)
    ref_logp, ref_entropy = _naive(head, hidden, targets, 0.7)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, **TOL)
    torch.testing.assert_close(entropy, ref_entropy.detach(), **TOL)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_any_head_module_goes_through_the_checkpointed_path(chunk_size):
    """A head that is not a plain Linear (e.g. one with its own adapter) gets the same values and gradients."""
    head, hidden, targets = _setup(3)
    wrapped = torch.nn.Sequential(head)  # not `type(head) is Linear`: takes the checkpointed path
    logp, entropy = token_logprobs(wrapped, hidden, targets, temperature=0.8, chunk_size=chunk_size)
    (logp * torch.arange(B * T).view(B, T)).sum().backward()
    got_h, got_w = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    want, want_entropy = _naive(head, hidden, targets, 0.8)
    (want * torch.arange(B * T).view(B, T)).sum().backward()
    torch.testing.assert_close(logp, want, **TOL)
    torch.testing.assert_close(entropy, want_entropy, **TOL)
    torch.testing.assert_close(got_h, hidden.grad, **TOL)
    torch.testing.assert_close(got_w, head.weight.grad, **TOL)


def test_any_head_module_under_no_grad():
    """Scoring with no gradient (old-policy and reference log-probs) through a head that is not a plain Linear."""
    head, hidden, targets = _setup(8)
    wrapped = torch.nn.Sequential(head)
    with torch.no_grad():
        logp, entropy = token_logprobs(wrapped, hidden, targets, temperature=0.9, chunk_size=4)
        want, want_entropy = _naive(head, hidden, targets, 0.9)
    assert not logp.requires_grad
    torch.testing.assert_close(logp, want, **TOL)
    torch.testing.assert_close(entropy, want_entropy, **TOL)


def test_any_head_module_keeps_no_logits_for_backward():
    """The checkpointed path saves only each chunk's hidden states and targets for backward, nothing the size of
    the vocabulary (a 7B model's float32 logits are ~0.6 MB a token)."""
    torch.manual_seed(9)
    vocab = 1000
    head = torch.nn.Sequential(torch.nn.Linear(H, vocab))
    hidden = torch.randn(B, T, H, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = token_logprobs(head, hidden, torch.randint(0, vocab, (B, T)), chunk_size=4)
    assert saved and not any(vocab in shape for shape in saved), saved
    logp.sum().backward()
    assert hidden.grad.abs().sum() > 0


def test_backward_runs_its_matmuls_in_the_autocast_dtype():
    """Float32 master weights under a bf16 autocast: the head's backward matmuls run in bf16 as its forward did
    (not in float32, several times slower on a GPU), and the gradients match autograd through a bf16 head."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.seen.append({a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() == 2})
            return func(*args, **(kwargs or {}))

    head, hidden, targets = _setup()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = token_logprobs(head, hidden, targets, chunk_size=3)
    with MatmulDtypes() as recorded:
        logp.sum().backward()
    assert recorded.seen and all(dtypes == {torch.bfloat16} for dtypes in recorded.seen), recorded.seen
    assert head.weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    grads = head.weight.grad.clone(), hidden.grad.clone()
    head.weight.grad, hidden.grad = None, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = _naive(head, hidden, targets, 1.0)
    ref.sum().backward()
    torch.testing.assert_close(grads[0], head.weight.grad, rtol=0.05, atol=0.05)
    torch.testing.assert_close(grads[1], hidden.grad, rtol=0.05, atol=0.05)


def test_a_float32_head_under_bf16_autocast_is_exact_and_so_is_its_gradient():
    """Under a bf16 autocast the head's matmul rounds every logit to bf16; head_dtype=float32 computes it in float32:
    log-probs and the gradient to the hidden states then match a float64 reference to float32's precision."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = (3 * torch.randn(1, 40, 16)).requires_grad_()
    targets = torch.randint(0, 50, (1, 40))
    ref = torch.log_softmax(hidden.double() @ head.weight.double().T + head.bias.double(), -1)
    ref = ref.gather(-1, targets[..., None]).squeeze(-1)
    (ref_grad,) = torch.autograd.grad(ref.sum(), hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded, _ = token_logprobs(head, hidden, targets, chunk_size=7)
        exact, _ = token_logprobs(head, hidden, targets, chunk_size=7, head_dtype=torch.float32)
    assert (rounded.double() - ref).abs().max() > 1e-2  # bf16 logits: visibly off
    torch.testing.assert_close(exact.double(), ref, rtol=0, atol=1e-4)
    (grad,) = torch.autograd.grad(exact.sum(), hidden)
    torch.testing.assert_close(grad.double(), ref_grad.double(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_a_bf16_models_head_with_head_dtype_float32_is_scored_in_float32(bias):
    """A bfloat16 model with training.lm_head_float32 (no autocast: the weights are bf16 themselves): the head's
    weight, bias and input are cast up, so log-probs and the gradients of the hidden states and the head match a
    float64 computation on the same bf16 values to float32's precision, and the gradients come back in bf16."""
    torch.manual_seed(3)
    head = torch.nn.Linear(16, 50, bias=bias).to(torch.bfloat16)
    hidden = (3 * torch.randn(1, 40, 16)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (1, 40))
    logits = hidden.double() @ head.weight.double().T + (head.bias.double() if bias else 0)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
    params = [hidden, head.weight] + ([head.bias] if bias else [])
    want = torch.autograd.grad(ref.sum(), params)
    logp, _ = token_logprobs(head, hidden, targets, temperature=0.7, chunk_size=7, head_dtype=torch.float32)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref, rtol=0, atol=1e-5)
    got = torch.autograd.grad(logp.sum(), params)
    for g, w, p in zip(got, want, params):
        assert g.dtype == torch.bfloat16 and g.abs().sum() > 0
        torch.testing.assert_close(g.double(), w.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)


def test_head_without_bias_as_lm_heads_are():
    """The usual LM head has no bias: values and gradients still match the naive computation."""
    head, hidden, targets = _setup(5)
    head = torch.nn.Linear(H, V, bias=False)
    logp, entropy = token_logprobs(head, hidden, targets, temperature=0.7, chunk_size=3)
    got = torch.autograd.grad(logp.sum(), [hidden, head.weight])
    ref_logp, ref_entropy = _naive(head, hidden, targets, 0.7)
    want = torch.autograd.grad(ref_logp.sum(), [hidden, head.weight])
    torch.testing.assert_close(logp, ref_logp, **TOL)
    torch.testing.assert_close(entropy, ref_entropy.detach(), **TOL)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_bf16_head_gradients_are_summed_over_chunks_in_float32():
    """A bf16 head trained directly (no float32 master): its weight and bias gradients are sums over every chunk,
    kept in float32 until the end. Summed in bf16, 256 one-row chunks of same-sign terms would drift by several
    percent (bf16 keeps 8 bits: past 128, adding 0.9 adds 1)."""
    torch.manual_seed(6)
    n = 256
    head = torch.nn.Linear(H, V).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.mul_(0.01)
        head.bias.zero_()
    hidden = (torch.rand(1, n, H) + 1).to(torch.bfloat16)  # positive: the weight gradient's terms add up too
    targets = torch.full((1, n), 2)
    logp, _ = token_logprobs(head, hidden, targets, chunk_size=1)
    grad_w, grad_b = torch.autograd.grad(logp.sum(), [head.weight, head.bias])
    assert grad_w.dtype == grad_b.dtype == torch.bfloat16
    exact = torch.nn.Linear(H, V).double()
    with torch.no_grad():
        exact.weight.copy_(head.weight.double())
        exact.bias.copy_(head.bias.double())
    ref_logp, _ = _naive(exact, hidden.double(), targets, 1.0)
    want_w, want_b = torch.autograd.grad(ref_logp.double().sum(), [exact.weight, exact.bias])
    torch.testing.assert_close(grad_b.double(), want_b, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_w.double(), want_w, rtol=1e-2, atol=1e-2)


def test_entropy_under_bf16_autocast_is_computed_in_float32():
    """Under a bf16 autocast without a float32 head the logits are bf16-rounded, but the entropy of those logits
    must still be float32-exact: a reduction left to autocast (vecdot, matmul) would round it to bf16 (~1e-2)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 2000, bias=False)
    hidden = torch.randn(1, 64, 32, requires_grad=True)
    targets = torch.randint(0, 2000, (1, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(hidden)  # the bf16 logits the function sees
        _, entropy = token_logprobs(head, hidden, targets, chunk_size=16)
    ref = logits.double().log_softmax(-1)
    ref_entropy = -(ref.exp() * ref).sum(-1)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), rtol=0, atol=1e-5)


def test_hidden_gradient_at_large_logits_is_float32_exact():
    """At logits around 40, as an LM's top logits are, grad_h matches float64 to float32's precision. Integer
    hidden states and weights in steps of 1/8 make every logit exact in float32, so the float64 reference sees
    the very logits the function does and only the softmax's own rounding is measured. A softmax rebuilt as
    exp(logits - log Z) with log Z rounded to float32 (half an ulp of 40 is 2e-6) is 4-7x further off."""
    torch.manual_seed(0)
    n, h_dim, vocab = 64, 16, 1000
    head = torch.nn.Linear(h_dim, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randint(-16, 17, (vocab, h_dim)) / 8)
    hidden = torch.randint(-3, 4, (1, n, h_dim)).float().requires_grad_()
    targets = torch.randint(0, vocab, (1, n))
    cot = torch.randn(1, n)
    logits64 = hidden.double() @ head.weight.double().T
    assert logits64.amax(-1).median() > 25
    ref = logits64.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    (want,) = torch.autograd.grad((ref * cot).sum(), hidden)
    logp, _ = token_logprobs(head, hidden, targets, chunk_size=16)
    (got,) = torch.autograd.grad((logp * cot).sum(), hidden)
    assert (got.double() - want).norm() / want.norm() < 2.5e-7


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 4, 13, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_linear_head_passes_float64_gradcheck(temperature, chunk_size, bias):
    """The fused head's hand-written backward equals finite differences of its forward, in float64."""
    torch.manual_seed(0)
    n, h_dim, vocab = 13, 6, 11
    hidden = torch.randn(1, n, h_dim, dtype=torch.float64, requires_grad=True)
    weight = (3 * torch.randn(vocab, h_dim, dtype=torch.float64)).requires_grad_()  # a peaked softmax
    bias_v = [torch.randn(vocab, dtype=torch.float64, requires_grad=True)] if bias else []
    targets = torch.randint(0, vocab, (1, n))

    def logp(hidden, weight, *bias_v):  # a plain Linear (the fused path) holding gradcheck's inputs as its tensors
        head = torch.nn.Linear(h_dim, vocab, bias=bool(bias_v), dtype=torch.float64)
        del head.weight
        head.weight = weight
        if bias_v:
            del head.bias
            head.bias = bias_v[0]
        return token_logprobs(head, hidden, targets, temperature=temperature, chunk_size=chunk_size)[0]

    assert torch.autograd.gradcheck(logp, (hidden, weight, *bias_v))
