"""LoRA through peft (`models/lora.py`): adapters added in place, the merge into plain weights, the saved adapter,
the adapters switched off, the float32 head kept, and the one-line errors."""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_cli.config import ConfigError, LoraSettings
from rlhf_cli.forwards import policy_forward
from rlhf_cli.models import (
    Float32Head,
    adapters_disabled,
    add_lora,
    has_lora,
    load_causal_lm,
    load_scalar_model,
    merged_state_dict,
    save_adapter,
    sequence_scores,
    without_adapters,
)


def lora(**kw):
    return OmegaConf.structured(LoraSettings(**{"r": 4, "alpha": 8.0, **kw}))


def randomise_adapters(model, seed=0):
    """B = 0 at the start (a new adapter changes nothing): give every adapter weight random values instead."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.05)
    return model


@pytest.fixture
def ids(tokenizer, chat_rows, pad_batch):
    return pad_batch(chat_rows, tokenizer.pad_token_id, "right")


def test_only_adapters_and_named_heads_train_and_a_new_adapter_changes_nothing(tiny_model_cfg, ids):
    plain = load_scalar_model(tiny_model_cfg, seed=0).eval()
    model = add_lora(copy.deepcopy(plain), lora(), heads=("score",), what="reward model").eval()
    assert has_lora(model) and not has_lora(plain)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n or n.startswith("score.modules_to_save.") for n in trained)
    assert sum("lora_A" in n for n in trained) == 2 * 7  # 2 blocks × q k v o gate up down
    torch.testing.assert_close(sequence_scores(model, *ids), sequence_scores(plain, *ids), rtol=0, atol=0)


def test_merged_state_dict_equals_peft_merge_and_loads_into_the_plain_class(tiny_model_cfg, ids, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    plain = load_scalar_model(tiny_model_cfg, seed=0).eval()
    model = randomise_adapters(add_lora(copy.deepcopy(plain), lora(), heads=("score",)).eval())
    merged = merged_state_dict(model, model.state_dict())
    assert set(merged) == set(plain.state_dict())
    want = sequence_scores(model, *ids)

    # peft's own merge of the same adapter gives the same weights
    config = LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear", modules_to_save=["score"])
    peft_model = get_peft_model(copy.deepcopy(plain), config)
    peft_model.base_model.model.load_state_dict(model.state_dict())
    peft_merged = peft_model.merge_and_unload().state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(v, peft_merged[k], rtol=0, atol=1e-7, msg=k)

    # a plain transformers model with the merged weights scores as the LoRA model does (fp32 tolerance)
    plain.save_pretrained(tmp_path / "m", state_dict=merged)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "m").eval()
    torch.testing.assert_close(sequence_scores(loaded, *ids), want, rtol=0, atol=1e-5)


def test_bf16_merge_adds_the_delta_in_fp32_and_rounds_once(tiny_model_cfg):
    model = randomise_adapters(add_lora(load_scalar_model(tiny_model_cfg, "bf16", seed=0), lora(), heads=("score",)))
    sd = model.state_dict()
    merged = merged_state_dict(model, sd)
    layer = model.model.layers[0].self_attn.q_proj
    w0, a, b = (sd[f"model.layers.0.self_attn.q_proj.{k}"] for k in
                ("base_layer.weight", "lora_A.default.weight", "lora_B.default.weight"))
    once = (w0.float() + (b.float() @ a.float()) * layer.scaling["default"]).to(torch.bfloat16)
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], once)
    in_bf16 = w0 + (b @ a) * layer.scaling["default"]  # the delta rounded, then the sum rounded again
    assert not torch.equal(in_bf16, once)


def test_the_head_computes_in_float32_after_peft_copies_it(tiny_model_cfg, ids):
    model = add_lora(load_scalar_model(tiny_model_cfg, "bf16", seed=0), lora(), heads=("score",))
    head = model.score.modules_to_save["default"]
    assert isinstance(head, Float32Head) and head.weight.requires_grad
    rewards = sequence_scores(model, *ids)
    assert rewards.dtype == torch.float32
    assert not torch.equal(rewards, rewards.to(torch.bfloat16).float())  # not on the bf16 grid


def test_saved_adapter_loads_with_peft_onto_the_base_model(tiny_model_cfg, ids, tmp_path):
    from peft import PeftModel

    model = randomise_adapters(add_lora(load_scalar_model(tiny_model_cfg, seed=0), lora(), heads=("score",))).eval()
    save_adapter(model, model.state_dict(), tmp_path / "adapter", base="tiny")
    base = load_scalar_model(tiny_model_cfg, seed=0)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    got = sequence_scores(loaded.base_model.model, *ids)
    torch.testing.assert_close(got, sequence_scores(model, *ids), rtol=0, atol=1e-6)
    assert loaded.peft_config["default"].base_model_name_or_path == "tiny"


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16"])
def test_adapters_off_give_the_base_model_and_the_policy_keeps_its_own(tiny_model_cfg, tokenizer, ids, precision):
    """Bit-exact in each precision: with the adapters off, peft's layer runs the base layer's own forward."""
    base = load_causal_lm(tiny_model_cfg, precision, seed=0, tokenizer=tokenizer).eval()
    policy = randomise_adapters(add_lora(copy.deepcopy(base), lora())).eval()
    flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    P = 4
    want, _, _ = policy_forward(base, *ids, P, 0.7)
    ref, _, _ = policy_forward(without_adapters(policy), *ids, P, 0.7)
    torch.testing.assert_close(ref, want, rtol=0, atol=0)
    own, _, _ = policy_forward(policy, *ids, P, 0.7)
    assert (own - want).abs().max() > 1e-3  # the view switched the adapters off for its own call only
    with adapters_disabled(policy):
        off, _, _ = policy_forward(policy, *ids, P, 0.7)
    torch.testing.assert_close(off, want, rtol=0, atol=0)
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == flags


def test_target_modules_naming_nothing_lists_the_linear_modules(tiny_model_cfg):
    model = load_scalar_model(tiny_model_cfg, seed=0)
    with pytest.raises(ConfigError) as e:
        add_lora(model, lora(target_modules=["qkv_proj"]), heads=("score",), what="reward model")
    msg = str(e.value)
    assert "\n" not in msg and "qkv_proj" in msg and "reward model" in msg
    assert "q_proj" in msg and "down_proj" in msg


def test_target_modules_naming_an_embedding_or_the_lm_head_is_refused(tiny_model_cfg, tokenizer):
    model = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match=r"model\.embed_tokens \(Embedding\), not a linear layer"):
        add_lora(model, lora(target_modules=["embed_tokens"]))
    # the LM head is read by the reference with the adapters off, and tied to the embeddings here
    model = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match="takes lm_head, outside the trunk"):
        add_lora(model, lora(target_modules=["q_proj", "lm_head"]))
