"""`forwards.pair_logprobs`: a causal LM's summed response log-probs of each pair's chosen and rejected, read from
one forward over a pair batch, against each (prompt + response) run alone, unpadded, through the plain model.

Pairs: prompts of 1 to 13 tokens (some beginning with one shared system prompt, two identical), chosen longer than
rejected and the other way round, responses of 1 to 5 tokens, some sharing their first tokens (the packed layout
computes those once for both). Tolerance 1e-5 in fp32: the sums (up to 5 log-probs of about -11 nats each) stay
under 64 in magnitude, where a float32 ulp is 3.8e-6, so it allows two ulps of the trunk's rounding in two layouts
(measured: one ulp; a response of 11 tokens sums to about -119, where one ulp is 7.6e-6).
"""

import pytest
import torch
from stage_helpers import assert_same_gradients, grads

from rlhf_cli.data import PackedPairCollator, PairCollator, pad_sequences
from rlhf_cli.forwards import pair_logprobs
from rlhf_cli.models import PolicyWithValueHead

PAD, EOS = 0, 2
# (extra prompt tokens, chosen length, rejected length, first response tokens the two share)
SHAPES = [(0, 3, 5, 0), (6, 3, 2, 1), (3, 5, 1, 0), (0, 5, 5, 3), (1, 2, 4, 0), (8, 3, 5, 2), (0, 1, 2, 0)]
LAYOUTS = ["padded", "left-padded", "packed", "packed-wide-rows"]


def make_pairs(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731 (ids 0-2 are pad/bos/eos)
    system = rnd(4)
    pairs = []
    for i, (p, c, r, common) in enumerate(SHAPES):
        chosen = rnd(c - 1) + [EOS]
        rejected = chosen[:common] + rnd(r - 1 - common) + [EOS]
        prompt = (system if i % 2 else []) + rnd(p + 1)
        pairs.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected, "row": i + 1})
    pairs[-1]["prompt_ids"] = list(pairs[1]["prompt_ids"])  # two pairs of one prompt: one trie in wide rows
    return pairs


def collate(pairs, layout):
    if layout.startswith("packed"):
        return PackedPairCollator(PAD, 1e9 if layout == "packed-wide-rows" else None)(pairs)
    batch = PairCollator(PAD)(pairs)
    if layout == "left-padded":
        rows = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
        batch.update(pad_sequences(rows, PAD, side="left"))
    return batch


def alone(model, prompt, response):
    """The plain loop: one unpadded sequence, the log-softmax of every response token summed."""
    ids = torch.tensor([prompt + response])  # (1, n)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # (len(response), V)
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).sum()


@pytest.fixture
def lm(tiny_causal):
    impl = tiny_causal.config._attn_implementation
    yield tiny_causal
    tiny_causal.config._attn_implementation = impl
    tiny_causal.zero_grad()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_pair_logprobs_equal_each_sequence_alone(lm, impl, layout):
    lm.config._attn_implementation = impl  # eager adds the packed mask to the scores: a boolean one would be wrong
    pairs = make_pairs(lm.config.vocab_size)
    batch = collate(pairs, layout)
    if layout.startswith("packed"):
        assert batch["input_ids"].shape[0] < 2 * len(pairs)  # prompts are shared
    with torch.no_grad():
        chosen, rejected = pair_logprobs(lm, batch, "fp32")
        want_c = torch.stack([alone(lm, ex["prompt_ids"], ex["chosen_ids"]) for ex in pairs])
        want_r = torch.stack([alone(lm, ex["prompt_ids"], ex["rejected_ids"]) for ex in pairs])
    assert chosen.shape == rejected.shape == (len(pairs),)
    assert chosen.dtype == rejected.dtype == torch.float32
    torch.testing.assert_close(chosen, want_c, rtol=0, atol=1e-5)
    torch.testing.assert_close(rejected, want_r, rtol=0, atol=1e-5)
    assert (chosen - rejected).abs().min() > 1e-3  # a swapped chosen/rejected read would show
    assert bool((chosen < 0).all() and (rejected < 0).all()) and float(torch.cat([chosen, rejected]).min()) > -64


@pytest.mark.parametrize("layout", ["packed", "packed-wide-rows"])
def test_packed_pairs_give_the_padded_log_probs_and_gradients(lm, layout):
    pairs = make_pairs(lm.config.vocab_size, seed=1)
    out = {}
    for name in ("padded", layout):
        lm.zero_grad()
        chosen, rejected = pair_logprobs(lm, collate(pairs, name), "fp32")
        (chosen - 2 * rejected).sum().backward()  # both sides, weighted apart: a swap would move the gradient
        out[name] = chosen.detach(), rejected.detach(), grads(lm)
    (c0, r0, g0), (c1, r1, g1) = out["padded"], out[layout]
    torch.testing.assert_close(c1, c0, rtol=0, atol=1e-5)
    torch.testing.assert_close(r1, r0, rtol=0, atol=1e-5)
    assert_same_gradients(g1, g0)


def test_a_wrapped_policy_and_bf16_give_float32_sums(lm):
    """A policy with a shared value head is read through its LM; under bf16 autocast the sums stay float32 and
    near the fp32 ones."""
    pairs = make_pairs(lm.config.vocab_size)
    batch = collate(pairs, "packed")
    with torch.no_grad():
        exact = torch.cat(pair_logprobs(lm, batch, "fp32"))
        wrapped = torch.cat(pair_logprobs(PolicyWithValueHead(lm, seed=0), batch, "fp32"))
        bf16 = torch.cat(pair_logprobs(lm, batch, "bf16-autocast"))
    assert torch.equal(wrapped, exact)
    assert bf16.dtype == torch.float32 and 0 < float((bf16 - exact).abs().max()) < 1e-2 * float(exact.abs().max())


def test_a_pair_without_a_prompt_token_is_refused(lm):
    batch = PairCollator(PAD)([{"prompt_ids": [], "chosen_ids": [5, EOS], "rejected_ids": [6, EOS], "row": 1}])
    with pytest.raises(ValueError, match="without a prompt token"):
        pair_logprobs(lm, batch, "fp32")
