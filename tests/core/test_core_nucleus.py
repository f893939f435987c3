"""`core.nucleus_logits` (`ppo.top_p` < 1: the policy's log-probs renormalised over the top-p nucleus, trl#6789):
a hand-computed case, a plain-Python loop reference, and the samplers' own filter (transformers'
`TopPLogitsWarper`, the hf engine's) on random inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import TopPLogitsWarper

from rlhf_cli.core import entropy_from_logits, logprobs_from_logits, nucleus_logits

PROPERTY = settings(max_examples=25, deadline=None)


def test_hand_computed():
    # probabilities 0.5, 0.3, 0.15, 0.05; top_p = 0.7: the nucleus is {0, 1} (mass before token 1: 0.5 < 0.7,
    # before token 2: 0.8 >= 0.7), mass 0.8
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64).log().repeat(1, 3, 1)  # (1, 3, 4)
    labels = torch.tensor([[0, 1, 2]])  # token 2 was sampled outside the nucleus: it stays in its own position's set
    z = nucleus_logits(logits, labels, 0.7)
    assert torch.isinf(z[0, 0, 2:]).all() and torch.isinf(z[0, 1, 2:]).all()
    assert torch.isfinite(z[0, 2, :3]).all() and torch.isinf(z[0, 2, 3])
    lp = logprobs_from_logits(z, labels)
    want = [math.log(0.5 / 0.8), math.log(0.3 / 0.8), math.log(0.15 / 0.95)]
    torch.testing.assert_close(lp[0], torch.tensor(want, dtype=torch.float64))
    ent = entropy_from_logits(z)[0, 0].item()
    assert ent == pytest.approx(-(0.625 * math.log(0.625) + 0.375 * math.log(0.375)))
    # the whole softmax's log-prob is log 0.3: renormalising adds -log(0.8), the kept mass (trl#6789's bias)
    assert lp[0, 1].item() - logprobs_from_logits(logits, labels)[0, 1].item() == pytest.approx(-math.log(0.8))


def loop_reference(logits, labels, top_p):
    """Log-probs one position at a time: sort descending, keep a token while the mass before it is < top_p, add
    the label, renormalise."""
    out = []
    for seq, labs in zip(logits.tolist(), labels.tolist()):
        row = []
        for z, a in zip(seq, labs):
            top = max(z)
            p = [math.exp(v - top) for v in z]
            total = sum(p)
            p = [v / total for v in p]
            kept, before = set(), 0.0
            for v in sorted(range(len(z)), key=lambda i: -p[i]):
                if before < top_p:
                    kept.add(v)
                before += p[v]
            kept.add(a)
            row.append(math.log(p[a] / sum(p[v] for v in kept)))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@PROPERTY
@given(seed=st.integers(0, 10_000), top_p=st.sampled_from([0.3, 0.6, 0.9, 0.95]),
       scale=st.sampled_from([0.5, 2.0, 6.0]))
def test_matches_the_loop_reference(seed, top_p, scale):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 13, generator=gen, dtype=torch.float64) * scale
    labels = torch.randint(0, 13, (3, 5), generator=gen)  # some outside the nucleus
    got = logprobs_from_logits(nucleus_logits(logits, labels, top_p), labels)
    torch.testing.assert_close(got, loop_reference(logits, labels, top_p), rtol=1e-9, atol=1e-9)


@PROPERTY
@given(seed=st.integers(0, 10_000), top_p=st.sampled_from([0.5, 0.8, 0.95]))
def test_sampled_tokens_log_probs_are_the_samplers_renormalised_ones(seed, top_p):
    """The hf engine's filter (transformers' TopPLogitsWarper on the temperature-scaled scores, the rule vLLM's
    top-p sampler shares), then a log-softmax: vLLM's processed_logprobs. Tokens drawn from it get the same
    log-probs from `nucleus_logits`, and the same kept set."""
    gen = torch.Generator().manual_seed(seed)
    B, T, V = 2, 6, 50
    logits = torch.randn(B, T, V, generator=gen) * 3
    warped = TopPLogitsWarper(top_p)(None, logits.reshape(B * T, V)).reshape(B, T, V)
    labels = torch.multinomial(warped.softmax(-1).reshape(B * T, V), 1, generator=gen).reshape(B, T)
    want = torch.log_softmax(warped, -1).gather(-1, labels[..., None]).squeeze(-1)
    z = nucleus_logits(logits, labels, top_p)
    assert torch.equal(torch.isinf(z), torch.isinf(warped))
    torch.testing.assert_close(logprobs_from_logits(z, labels), want, rtol=1e-6, atol=1e-6)


def test_top_p_1_is_the_logits_themselves_and_the_gradient_reaches_the_kept_logits_only():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=gen).requires_grad_(True)
    labels = torch.randint(0, 7, (2, 3), generator=gen)
    assert nucleus_logits(logits, labels, 1.0) is logits
    z = nucleus_logits(logits, labels, 0.5)
    logprobs_from_logits(z, labels).sum().backward()
    kept = torch.isfinite(z)
    several = kept.sum(-1, keepdim=True) > 1  # a position whose nucleus is its label alone has log-prob 0: no gradient
    assert several.any() and (logits.grad[~kept] == 0).all() and (logits.grad[kept & several] != 0).all()
    # on the kept logits: the gradient of a log-softmax over them alone
    want = torch.zeros_like(logits)
    for b in range(2):
        for t in range(3):
            idx = kept[b, t].nonzero().flatten()
            sub = logits.detach()[b, t, idx].clone().requires_grad_(True)
            torch.log_softmax(sub, -1)[(idx == labels[b, t]).nonzero().item()].backward()
            want[b, t, idx] = sub.grad
    torch.testing.assert_close(logits.grad, want)


def test_bad_arguments_raise():
    logits, labels = torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long)
    for top_p in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="top_p must be in"):
            nucleus_logits(logits, labels, top_p)
    with pytest.raises(ValueError, match="labels shape"):
        nucleus_logits(logits, labels[:, :1], 0.9)
