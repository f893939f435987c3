"""Packed preference pairs (`data.packing`): the prompt computed once, pairs sharing rows, give the scores, loss and
gradients of the plain layout (chosen and rejected as two padded rows).

Tolerances. fp32: the two layouts run the same arithmetic on the same keys at the same positions, only in matrices
of other shapes, so results differ by reduction order: 1e-5 absolute on scores of magnitude ~1, and on each gradient
tensor 1e-5 of its largest entry, a few ulps of float32 (1.2e-7) accumulated over a 2-layer trunk. bf16: rounding to
8 significant bits happens at other places in the two layouts, so the packed scores may differ from the padded ones
by bf16 noise; the test holds packing to no more error against the fp32 scores than the padded layout itself has.
"""

import logging

import pytest
import torch
from stage_helpers import assert_same_gradients, grads

from rlhf_cli.core import pairwise_loss
from rlhf_cli.data import PackedPairCollator, PairCollator
from rlhf_cli.forwards import forward_pairs, packing, pair_collator, score_pairs
from rlhf_cli.models import sequence_scores

PAD, EOS = 0, 2
MAX_LENGTH = 12
# (prompt, chosen, rejected) lengths: one-token prompts, one-token responses, a response ending at the max length
# (P + C == MAX_LENGTH), chosen and rejected that differ from their first token on, rows of very different lengths
SHAPES = [(1, 3, 5), (7, 2, 2), (4, 8, 1), (1, 11, 11), (2, 2, 2), (9, 3, 3), (1, 1, 1)]


def make_pairs(vocab, shapes=SHAPES, seed=1):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731 (ids 0-2 are pad/bos/eos)
    pairs = []
    for p, c, r in shapes:
        chosen, rejected = rnd(c - 1) + [EOS], rnd(r - 1) + [EOS]
        rejected[0] = chosen[0] + 1 if chosen[0] + 1 < vocab else 3  # differ in the first response token
        pairs.append({"prompt_ids": rnd(p), "chosen_ids": chosen, "rejected_ids": rejected, "row": len(pairs) + 1})
    assert any(p + c == MAX_LENGTH for p, c, _ in shapes)
    return pairs


def loss_and_grads(model, batch, precision):
    model.zero_grad()
    chosen, rejected = forward_pairs(model, batch, precision)
    loss, _ = pairwise_loss(chosen, rejected)
    loss.backward()
    return chosen.detach(), rejected.detach(), loss.detach(), grads(model)


@pytest.fixture
def scalar(tiny_scalar):
    model = tiny_scalar
    impl = model.config._attn_implementation
    yield model
    model.config._attn_implementation = impl
    model.zero_grad()


@pytest.mark.parametrize("attention_tokens", [None, 1e9], ids=["rows-of-the-longest", "wide-rows"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_pairs_give_the_padded_scores_loss_and_gradients_fp32(scalar, impl, attention_tokens):
    scalar.config._attn_implementation = impl  # eager adds the mask to the scores: a boolean one would be wrong
    pairs = make_pairs(scalar.config.vocab_size)
    packed = PackedPairCollator(PAD, attention_tokens)(pairs)
    assert packed["input_ids"].shape[0] < len(pairs)  # some pairs really share a row
    longest = max(len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"]) for ex in pairs)
    assert (packed["input_ids"].shape[1] > longest) == (attention_tokens is not None)  # wide rows where asked
    c0, r0, loss0, g0 = loss_and_grads(scalar, PairCollator(PAD)(pairs), "fp32")
    c1, r1, loss1, g1 = loss_and_grads(scalar, packed, "fp32")
    torch.testing.assert_close(c1, c0, rtol=0, atol=1e-5)
    torch.testing.assert_close(r1, r0, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-6)
    assert_same_gradients(g1, g0)
    assert (c0 - r0).abs().min() > 1e-3  # the test would see a swapped chosen/rejected read


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_pairs_sharing_a_system_prompt_and_first_response_tokens_give_the_padded_results(scalar, impl):
    """Tries beyond one pair's prompt: every prompt begins with the same 4 tokens (a chat template's system prompt)
    and some chosen/rejected share their first tokens; cheap attention lets pairs share tries."""
    scalar.config._attn_implementation = impl
    pairs = make_pairs(scalar.config.vocab_size)
    for i, ex in enumerate(pairs):
        ex["prompt_ids"] = [5, 6, 7, 8] + ex["prompt_ids"]
        if i % 2 and len(ex["chosen_ids"]) > 1 and len(ex["rejected_ids"]) > 1:
            ex["rejected_ids"][0] = ex["chosen_ids"][0]  # the same first response token
    packed = PackedPairCollator(PAD, 1e9)(pairs)
    unshared = sum(len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"]) for ex in pairs)
    assert int(packed["attention_mask"].sum()) < unshared - 4 * 2  # the system prompt computed once in some tries
    c0, r0, loss0, g0 = loss_and_grads(scalar, PairCollator(PAD)(pairs), "fp32")
    c1, r1, loss1, g1 = loss_and_grads(scalar, packed, "fp32")
    torch.testing.assert_close(c1, c0, rtol=0, atol=1e-5)
    torch.testing.assert_close(r1, r0, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-6)
    assert_same_gradients(g1, g0)


def test_packed_scores_equal_left_padded_sequences(scalar, pad_batch):
    """Against the plain per-sequence forward on LEFT-padded rows (the rollout layout), not only PairCollator's."""
    pairs = make_pairs(scalar.config.vocab_size)
    with torch.no_grad():
        c, r = forward_pairs(scalar, PackedPairCollator(PAD)(pairs), "fp32")
        for key, got in (("chosen_ids", c), ("rejected_ids", r)):
            ids, mask = pad_batch([ex["prompt_ids"] + ex[key] for ex in pairs], PAD, "left")
            torch.testing.assert_close(got, sequence_scores(scalar, ids, mask), rtol=0, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16-autocast", "bf16"])
def test_packing_adds_no_error_beyond_bf16s_own(tiny_model_cfg, precision):
    from rlhf_cli.models import load_scalar_model

    pairs = make_pairs(256)
    with torch.no_grad():
        fp32 = load_scalar_model(tiny_model_cfg, "fp32", seed=0).eval()
        exact = torch.cat(forward_pairs(fp32, PairCollator(PAD)(pairs), "fp32"))
        model = load_scalar_model(tiny_model_cfg, precision, seed=0).eval()
        padded = torch.cat(forward_pairs(model, PairCollator(PAD)(pairs), precision))
        packed = torch.cat(forward_pairs(model, PackedPairCollator(PAD)(pairs), precision))
    assert packed.dtype == torch.float32  # the float32 head survives the packed path
    bf16_error = (padded - exact).abs().max()
    assert 0 < bf16_error < 0.1
    assert (packed - exact).abs().max() <= 2 * bf16_error


def test_score_pairs_packed_equals_plain_and_keeps_the_order(scalar):
    pairs = make_pairs(scalar.config.vocab_size)
    plain = score_pairs(scalar, pairs, PAD, 3, "fp32", packing=False)
    packed = score_pairs(scalar, pairs, PAD, 3, "fp32", packing=True)
    for a, b in zip(plain, packed):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_an_attention_implementation_without_custom_masks_falls_back_once(scalar, caplog):
    from rlhf_cli.models import trunk_hidden

    scalar.config._attn_implementation = "flash_attention_2"
    with caplog.at_level(logging.WARNING, logger="rlhf_cli"):
        assert isinstance(pair_collator(scalar, PAD, packing=True), PairCollator)
        assert isinstance(pair_collator(scalar, PAD, packing=True), PairCollator)
    said = [r.getMessage() for r in caplog.records if "data.packing=true is off" in r.getMessage()]
    assert len(said) == 1 and "flash_attention_2" in said[0]
    batch = PackedPairCollator(PAD)(make_pairs(scalar.config.vocab_size))
    with pytest.raises(ValueError, match="takes no custom attention mask"):
        trunk_hidden(scalar, batch["input_ids"], batch["pair_attention"], batch["position_ids"])
    scalar.config._attn_implementation = "sdpa"
    assert isinstance(pair_collator(scalar, PAD, packing=True), PackedPairCollator)
    assert isinstance(pair_collator(scalar, PAD, packing=False), PairCollator)
    with pytest.raises(ValueError, match="needs explicit position_ids"):
        trunk_hidden(scalar, batch["input_ids"], batch["pair_attention"])


def test_a_model_with_sliding_window_layers_is_not_packed(caplog, monkeypatch):
    """A custom 4D mask replaces the model's per-layer sliding-window mask: such a model falls back, once."""
    from transformers import MistralConfig

    class Model:
        config = MistralConfig(sliding_window=16)

    Model.config._attn_implementation = "sdpa"
    with caplog.at_level(logging.WARNING, logger="rlhf_cli"):
        assert isinstance(pair_collator(Model(), PAD, packing=True), PairCollator)
    assert any("sliding-window" in r.getMessage() for r in caplog.records)
    Model.config.sliding_window = None
    monkeypatch.setattr(packing, "packing_probe", lambda model: None)  # a stand-in: no forward to probe
    assert isinstance(pair_collator(Model(), PAD, packing=True), PackedPairCollator)


def test_row_width_takes_the_cheapest_candidate():
    from rlhf_cli.data import row_width
    from rlhf_cli.data.collate import _first_fit

    assert row_width([10, 9, 3, 2], None) == row_width([10, 9, 3, 2], 0) == 10  # rows of the longest segment
    assert row_width([10, 9, 3, 2], 3072) == 12  # [10, 2] and [9, 3]: two rows, no padding
    assert row_width([10, 10], 3072) == 10  # one wide row would save no position and cost attention
    assert row_width([100] * 9, 1e9) == 100  # ties go to the narrower row
    # one row of 350 would save 50 positions but hold 3x the attention memory of four rows of 100
    assert row_width([100, 100, 100, 50], 1e9) == 100
    lengths = [57, 31, 88, 12, 40, 40, 63, 9, 50, 45, 70, 22]  # 527 tokens: 7 rows of 88 are 616 positions
    rows = lambda w: len(_first_fit(lengths, w))  # noqa: E731
    best = row_width(lengths, 500)
    assert best > 88 and rows(best) * best < 616  # wider rows, fewer positions
    assert rows(best) * best * (1 + best / 500) < 616 * (1 + 88 / 500)  # at a lower estimated cost
    assert rows(best) * best ** 2 <= 2 * rows(88) * 88 ** 2  # within twice the attention memory
    with pytest.raises(ValueError, match="no segments"):
        row_width([], 3072)


def test_attention_tokens_from_the_config():
    """SmolLM2-135M's shape: (2·576·576 + 2·576·3·64 + 3·576·1536) / (2·576) = 3072 keys."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from rlhf_cli.models import attention_tokens

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    assert attention_tokens(SimpleNamespace(config=cfg)) == 3072
    assert attention_tokens(SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: object()))) is None
