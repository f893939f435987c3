"""Scalar-head models: layout, padding invariance, reward read at the EOS, critic alignment."""

import math

import pytest
import torch

from rlhf_cli.models import (
    Float32Head,
    last_token_index,
    load_scalar_model,
    response_values,
    sequence_scores,
    token_values,
)

ATOL = 1e-5


def test_layout_is_sequence_classification_with_seeded_small_head(tiny_model_cfg, tiny_causal, tiny_scalar):
    from transformers import LlamaForSequenceClassification

    m = tiny_scalar
    H = tiny_model_cfg.arch.hidden_size
    assert isinstance(m, LlamaForSequenceClassification)
    assert m.score.weight.shape == (1, H) and m.score.bias is None
    assert m.config.num_labels == 1 and m.config.pad_token_id == 0
    assert m.config.architectures == ["LlamaForSequenceClassification"]
    assert not hasattr(m, "lm_head")
    # trunk = the causal LM's trunk (same seed), head small and seeded
    causal_trunk = tiny_causal.model.state_dict()
    assert all(torch.equal(v, causal_trunk[k]) for k, v in m.model.state_dict().items())
    assert m.score.weight.std().item() < 3 / math.sqrt(H + 1)
    again = load_scalar_model(tiny_model_cfg, seed=0)
    assert torch.equal(again.score.weight, m.score.weight)
    assert not torch.equal(load_scalar_model(tiny_model_cfg, seed=1).score.weight, m.score.weight)


def test_left_and_right_padding_give_identical_rewards(tiny_scalar, tokenizer, chat_rows, pad_batch):
    right = pad_batch(chat_rows, tokenizer.pad_token_id, "right")
    left = pad_batch(chat_rows, tokenizer.pad_token_id, "left")
    with torch.no_grad():
        r_right, r_left = sequence_scores(tiny_scalar, *right), sequence_scores(tiny_scalar, *left)
        v_right, v_left = token_values(tiny_scalar, *right), token_values(tiny_scalar, *left)
        alone = torch.stack([
            sequence_scores(tiny_scalar, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))[0]
            for r in chat_rows])
    assert r_right.dtype is torch.float32 and r_right.shape == (len(chat_rows),)
    torch.testing.assert_close(r_left, r_right, atol=ATOL, rtol=0)
    torch.testing.assert_close(r_right, alone, atol=ATOL, rtol=0)
    for i, row in enumerate(chat_rows):  # every real position, not just the last
        n = len(row)
        torch.testing.assert_close(v_right[i, :n], v_left[i, -n:], atol=ATOL, rtol=0)
    assert (v_right[right[1] == 0] == 0).all()


def test_reward_is_read_at_the_eos_even_when_pad_equals_eos(tiny_scalar, tokenizer, chat_rows, pad_batch):
    eos = tokenizer.eos_token_id
    row = chat_rows[0]
    assert row[-1] == eos
    pad, n = tokenizer.pad_token_id, len(row)
    ids = torch.tensor([row + [pad] * 3, row + [pad] * 3])
    mask = torch.tensor([[1] * n + [0] * 3] * 2)
    with torch.no_grad():
        r = sequence_scores(tiny_scalar, torch.tensor([row]), torch.ones(1, n, dtype=torch.long))
        v = token_values(tiny_scalar, torch.tensor([row]), torch.ones(1, n, dtype=torch.long))
        # appending padding changes nothing; the reward is the value AT the EOS (index n-1)
        r_padded = sequence_scores(tiny_scalar, ids, mask)
        torch.testing.assert_close(r_padded, r.expand(2), atol=ATOL, rtol=0)
        assert last_token_index(mask).tolist() == [n - 1] * 2
        torch.testing.assert_close(r[0], v[0, n - 1], atol=ATOL, rtol=0)
        # padding WITH the EOS id (pad == eos, as SmolLM2 ships) gives the same reward
        ids_eos_pad, mask_eos_pad = pad_batch([row, chat_rows[2]], eos, "right")
        assert len(chat_rows[2]) > n and (ids_eos_pad[0, n - 1:] == eos).all()
        r_eos_pad = sequence_scores(tiny_scalar, ids_eos_pad, mask_eos_pad)
        torch.testing.assert_close(r_eos_pad[0], r[0], atol=ATOL, rtol=0)
        # ... where pooling by pad id (transformers' rule) would read one token before the EOS
        tiny_scalar.config.pad_token_id = eos
        try:
            hf = tiny_scalar(input_ids=ids_eos_pad[:1], attention_mask=mask_eos_pad[:1]).logits[0, 0]
        finally:
            tiny_scalar.config.pad_token_id = tokenizer.pad_token_id
        torch.testing.assert_close(hf, v[0, n - 2], atol=ATOL, rtol=0)
        assert not torch.isclose(hf, r[0], atol=1e-4)
        # the EOS and the token before it both matter
        ones = torch.ones(1, n, dtype=torch.long)
        no_eos = sequence_scores(tiny_scalar, torch.tensor([row[:-1] + [pad]]), torch.tensor([[1] * (n - 1) + [0]]))
        changed_eos = sequence_scores(tiny_scalar, torch.tensor([row[:-1] + [5]]), ones)
        changed_prev = sequence_scores(tiny_scalar, torch.tensor([row[:-2] + [5, eos]]), ones)
    for other in (no_eos, changed_eos, changed_prev):
        assert not torch.isclose(other[0], r[0], atol=1e-4)


def test_response_values_align_with_logprobs(tiny_scalar, tokenizer, pad_batch):
    """values[:, t] is V of the state before response token t: it equals the head output at position
    P-1+t, ignores response token t itself, and depends on token t-1."""
    P = 6
    prompts = [[10, 11, 12, 13], [20, 21, 22, 23, 24, 25]]  # left-padded to P
    responses = [[30, 31, 32, 2], [40, 41, 2]]  # right-padded
    p_ids, p_mask = pad_batch(prompts, tokenizer.pad_token_id, "left")
    r_ids, r_mask = pad_batch(responses, tokenizer.pad_token_id, "right")
    ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
    with torch.no_grad():
        values = response_values(tiny_scalar, ids, mask, P)
        assert values.shape == r_ids.shape
        torch.testing.assert_close(values, token_values(tiny_scalar, ids, mask)[:, P - 1:-1])
        # V(s_0) = value after the prompt alone
        alone = sequence_scores(tiny_scalar, torch.tensor([prompts[1]]), torch.ones(1, P, dtype=torch.long))
        torch.testing.assert_close(values[1, 0], alone[0], atol=ATOL, rtol=0)
        t = 1
        changed = ids.clone()
        changed[:, P + t] = 7
        v2 = response_values(tiny_scalar, changed, mask, P)
    torch.testing.assert_close(v2[:, : t + 1], values[:, : t + 1], atol=ATOL, rtol=0)
    assert not torch.allclose(v2[:, t + 1], values[:, t + 1], atol=1e-4)
    with pytest.raises(ValueError, match="response_start"):
        response_values(tiny_scalar, ids, mask, 0)


def test_gradients_reach_trunk_and_head(tiny_model_cfg, tokenizer):
    model = load_scalar_model(tiny_model_cfg, seed=0).train()
    ids = torch.tensor([[5, 6, 7, 2], [0, 8, 9, 2]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    sequence_scores(model, ids, mask).sum().backward()
    assert model.score.weight.grad is not None and model.score.weight.grad.abs().sum() > 0
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_init_from_in_memory_models_copies(tiny_causal, tiny_scalar):
    from_causal = load_scalar_model(init_from=tiny_causal, seed=0)
    assert from_causal.model is not tiny_causal.model
    assert torch.equal(from_causal.score.weight, tiny_scalar.score.weight)  # same seed, same head
    with torch.no_grad():
        from_causal.model.embed_tokens.weight.add_(1.0)
    assert not torch.equal(from_causal.model.embed_tokens.weight, tiny_causal.model.embed_tokens.weight)
    assert hasattr(tiny_causal, "lm_head") and tiny_causal.config.architectures in (None, ["LlamaForCausalLM"])

    critic = load_scalar_model(init_from=tiny_scalar, precision="bf16")  # e.g. critic from the reward model
    assert critic.score.weight.dtype is torch.bfloat16
    assert torch.equal(critic.score.weight.float(), tiny_scalar.score.weight.to(torch.bfloat16).float())
    assert tiny_scalar.score.weight.dtype is torch.float32


@pytest.mark.parametrize("precision", ["bf16-autocast", "bf16"])
def test_bf16_scores_are_as_distinct_and_rank_pairs_as_fp32(tiny_model_cfg, tokenizer, pad_batch, precision):
    """The head computes in float32 under every precision: a bf16 head output (8 significant bits) put
    many of 256 scores on the same bf16 value, and a tied pair counts as wrong in accuracy."""
    from rlhf_cli.forwards import batched_scores

    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 2000, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g).tolist()
            + [tokenizer.eos_token_id] for _ in range(256)]
    ids, mask = pad_batch(rows, tokenizer.pad_token_id, "right")
    fp32 = load_scalar_model(tiny_model_cfg, "fp32", seed=0).eval()
    low = load_scalar_model(tiny_model_cfg, precision, seed=0).eval()
    assert isinstance(low.score, Float32Head)
    want = batched_scores(fp32, ids, mask, 64, "fp32")
    got = batched_scores(low, ids, mask, 64, precision)
    assert got.dtype is torch.float32
    assert want.unique().numel() == 256 and got.unique().numel() == 256
    chosen, rejected = got[0::2], got[1::2]  # 128 pairs
    assert torch.equal(chosen > rejected, want[0::2] > want[1::2])
    assert (got - want).abs().max() < 0.1 * want.std()  # bf16 trunk, same function


def test_float32_head_is_a_plain_linear_on_disk(tmp_path, tiny_model_cfg):
    """The head's float32 compute changes no state-dict key: the saved model loads with plain transformers."""
    from transformers import AutoModelForSequenceClassification

    model = load_scalar_model(tiny_model_cfg, "bf16", seed=0)
    assert model.score.weight.dtype is torch.bfloat16  # parameters keep the run's dtype
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.score(x)
    assert out.dtype is torch.float32
    torch.testing.assert_close(out, x.float() @ model.score.weight.float().T, rtol=1e-6, atol=1e-6)
    model.save_pretrained(tmp_path)
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert type(plain.score) is torch.nn.Linear
    assert torch.equal(plain.score.weight.to(torch.bfloat16), model.score.weight)
    again = load_scalar_model(str(tmp_path), "fp32")
    assert isinstance(again.score, Float32Head)
