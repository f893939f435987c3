import pytest
import torch


@pytest.fixture(scope="module")
def tiny_scalar(tiny_model_cfg):
    """A seeded tiny scalar-head model (float32, eval mode)."""
    from rlhf_cli.models import load_scalar_model

    return load_scalar_model(tiny_model_cfg, seed=0).eval()


def _pad_batch(rows, pad_id, side):
    """Pad lists of token ids to one length on `side`; returns (input_ids, attention_mask), (B, T)."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(T - len(r), T)
        ids[i, sl] = torch.tensor(r)
        mask[i, sl] = 1
    return ids, mask


@pytest.fixture(scope="session")
def pad_batch():
    """`pad_batch(rows, pad_id, side)`: pad token lists on the left or right."""
    return _pad_batch


@pytest.fixture(scope="module")
def chat_rows(tokenizer):
    """Three chat-rendered prompt+response token lists of different lengths, each ending at EOS."""
    convs = [("What is 2+3?", "2+3 = 5."), ("Name a colour.", "Blue."),
             ("Say something longer, please.", "Here is a somewhat longer reply with more tokens in it.")]
    rows = []
    for q, a in convs:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True)
        rows.append(tokenizer(prompt + a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    return rows
