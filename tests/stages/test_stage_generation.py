"""The sampling-engine seam (`rollout/generation.py`) and its HF engine, on the tiny random model (CPU, fp32).

What issue 39's generator seam asks these tests to prove: `HFGenerator` + `rollout_batch` give bit for bit the
tensors the sampling before the seam gave (`old_sample_responses` below is that code, as it was); a prompt's
response depends only on (weights, prompt, seed, sampling), not on chunk size or prompt order, and two models
given the same seeds draw the same noise; a response ends at whichever id of `eos_ids` comes first, in the mask
and in HF `generate`; `rollout.engine` takes only the registry's names and only the commands that sample read it.
"""

from typing import Any

import pytest
import torch
from stage_helpers import compose
from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from rlhf_cli import config, engine
from rlhf_cli.commands import by_config
from rlhf_cli.config import ConfigError
from rlhf_cli.data import PromptCollator
from rlhf_cli.overrides import check_override_keys
from rlhf_cli.rollout import (
    GENERATORS,
    EngineSettings,
    Generation,
    Generator,
    HFGenerator,
    PerRowSampler,
    Sampling,
    describe_engine,
    generation,
    make_generator,
    resolve_dtype,
    resolve_engine,
    response_mask,
    rollout_batch,
    sample_responses,
)
from rlhf_cli.seeds import derive_seed

# ----------------------------------------------------------------------------------------------
# the sampling before the seam (rollout/sampling.py at 33f015b), kept verbatim as the reference; `PerRowSampler`
# moved unchanged (its draws are tested against softmax in test_stage_ppo.py)


def old_response_mask(responses, eos_id, pad_id):
    is_eos = responses == eos_id
    before_or_at = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) == 0  # no EOS strictly before t
    mask = before_or_at.float()
    cleaned = torch.where(before_or_at, responses, torch.full_like(responses, pad_id))
    return cleaned, mask, is_eos.any(dim=1)


@torch.no_grad()
def old_sample_responses(lm: Any, prompts, pad_id, eos_id, max_new_tokens, temperature, top_p, precision, chunk=32,
                         seeds=None):
    dev = engine.device()
    batch = PromptCollator(pad_id)(prompts)
    prompt_ids, prompt_mask = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
    P = prompt_ids.shape[1]
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_id,
                                  pad_token_id=pad_id, use_cache=True)
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
    was_training, model_gen_config = lm.training, lm.generation_config
    lm.eval()
    lm.generation_config = GenerationConfig()
    outs = []
    try:
        with engine.autocast(precision):
            for i in range(0, len(prompts), chunk):
                processors = LogitsProcessorList([*warpers, PerRowSampler(seeds[i:i + chunk])])
                out = lm.generate(input_ids=prompt_ids[i:i + chunk], attention_mask=prompt_mask[i:i + chunk],
                                  generation_config=gen_config, logits_processor=processors)
                resp = out[:, P:]
                if resp.shape[1] < max_new_tokens:
                    resp = torch.nn.functional.pad(resp, (0, max_new_tokens - resp.shape[1]), value=pad_id)
                outs.append(resp)
    finally:
        lm.generation_config = model_gen_config
        lm.train(was_training)
    responses, rmask, has_eos = old_response_mask(torch.cat(outs), eos_id, pad_id)
    R = max(int(rmask.sum(1).max().item()), 1)
    input_ids = torch.cat([prompt_ids, responses[:, :R]], dim=1)
    attention_mask = torch.cat([prompt_mask, rmask[:, :R].long()], dim=1)
    return input_ids, attention_mask, P, has_eos


# ----------------------------------------------------------------------------------------------
# fixtures

PAD = 0
NO_EOS = 1  # an id the tiny model's samples below never hold: nothing ends early


@pytest.fixture(scope="module")
def lm(tiny_model_cfg, tokenizer):
    from rlhf_cli.models import load_causal_lm

    return load_causal_lm(tiny_model_cfg, "fp32", 1, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Six prompts of different lengths (left padding at work)."""
    texts = ["What is 2 + 3?", "Hi", "Name a colour of the sky at noon, please.", "Count to three.", "Why?",
             "The quick brown fox jumps over"]
    return [{"prompt_ids": tokenizer.encode(t, add_special_tokens=False)} for t in texts]


def sampling(eos_ids, max_new_tokens=10, temperature=0.7, top_p=1.0):
    return Sampling(eos_ids=tuple(eos_ids), pad_id=PAD, max_new_tokens=max_new_tokens, temperature=temperature,
                    top_p=top_p)


def hf(model, chunk=32):
    gen = HFGenerator("fp32", chunk)
    gen.update_weights(model)
    return gen


def responses_of(gen: Generation):
    """{row: the response's ids up to and including its first EOS}."""
    return [r[m.bool()].tolist() for r, m in zip(gen.responses, gen.mask)]


def common_tokens(lm, prompts, seeds, top_p=1.0):
    """The samples with no early stop (12 tokens each), and a token that some but not all of them hold (an id to
    make an EOS id of, so that some responses end early)."""
    raw = hf(lm).generate([p["prompt_ids"] for p in prompts], seeds, sampling([NO_EOS], 12, top_p=top_p))
    assert not raw.has_eos.any()
    rows = raw.responses.tolist()
    counts = torch.bincount(raw.responses.flatten())
    some = [t for t in torch.argsort(counts, descending=True).tolist()
            if t != PAD and 0 < sum(t in r for r in rows) < len(rows)]
    return raw, some[0]


# ----------------------------------------------------------------------------------------------
# the same numbers as before the seam


@pytest.mark.parametrize("chunk, top_p", [(32, 1.0), (4, 0.9), (1, 1.0)])
def test_hf_generator_and_rollout_batch_equal_the_sampling_before_the_seam(lm, prompts, chunk, top_p):
    """Bit-identical input_ids, attention_mask, P and has_eos: with an EOS id some samples hold (some responses
    end early, at different lengths), the same on only the prompts whose responses end before the last column
    (all-pad columns dropped), and an id they never hold (all cut at max_new_tokens)."""
    seeds = [derive_seed(7, 0, k) for k in range(len(prompts))]
    raw, common = common_tokens(lm, prompts, seeds, top_p)
    early = [k for k, r in enumerate(raw.responses.tolist()) if common in r[:-1]]
    cases = [(prompts, seeds, common), ([prompts[k] for k in early], [seeds[k] for k in early], common),
             (prompts, seeds, NO_EOS)]
    widths = []
    for rows, row_seeds, eos in cases:
        want = old_sample_responses(lm, rows, PAD, eos, 12, 0.7, top_p, "fp32", chunk=chunk, seeds=row_seeds)
        prompt_ids = [p["prompt_ids"] for p in rows]
        generation = hf(lm, chunk).generate(prompt_ids, row_seeds, sampling([eos], 12, 0.7, top_p))
        got = rollout_batch(prompt_ids, generation, PAD)
        one_call = sample_responses(lm, rows, PAD, eos, 12, 0.7, top_p, "fp32", chunk=chunk, seeds=row_seeds)
        for out in (got, one_call):
            assert out[2] == want[2]
            for a, b in ((out[0], want[0]), (out[1], want[1]), (out[3], want[3])):
                assert a.dtype == b.dtype and torch.equal(a, b)
        widths.append(want[0].shape[1] - want[2])
    assert 0 < len(early) < len(prompts) and widths[1] < 12 == widths[0] == widths[2]


def test_a_generation_is_in_the_documented_layout(lm, prompts):
    seeds = [derive_seed(7, 1, k) for k in range(len(prompts))]
    gen = hf(lm).generate([p["prompt_ids"] for p in prompts], seeds, sampling([NO_EOS], 5))
    B = len(prompts)
    assert gen.responses.shape == (B, 5) and gen.responses.dtype == torch.long
    assert gen.mask.shape == (B, 5) and gen.mask.dtype == torch.float32
    assert gen.has_eos.shape == (B,) and gen.has_eos.dtype == torch.bool
    assert gen.logprobs is None  # HF gives none
    assert isinstance(hf(lm), Generator)


# ----------------------------------------------------------------------------------------------
# the pairing contract


def test_a_prompts_response_does_not_depend_on_chunk_size_or_prompt_order(lm, prompts):
    seeds = [derive_seed(42, 0, k) for k in range(len(prompts))]
    ids = [p["prompt_ids"] for p in prompts]
    s = sampling([NO_EOS], 8)
    full = responses_of(hf(lm, chunk=6).generate(ids, seeds, s))
    order = [4, 1, 5, 0]
    part = responses_of(hf(lm, chunk=3).generate([ids[i] for i in order], [seeds[i] for i in order], s))
    assert part == [full[i] for i in order]
    assert responses_of(hf(lm, chunk=1).generate([ids[3]], [seeds[3]], s)) == [full[3]]
    assert len({tuple(r) for r in full}) > 1  # different seeds, different samples
    assert responses_of(hf(lm, chunk=6).generate(ids, [x + 1 for x in seeds], s)) != full  # the seed decides


def test_two_models_given_the_same_seeds_draw_the_same_noise(tiny_model_cfg, tokenizer, prompts):
    """Models whose logits are constant (LM head zeroed; the trunks differ) sample nothing but the noise: the same
    tokens per prompt, and token t is the argmax of the Gumbel noise of the t-th draw of the prompt's own stream."""
    from rlhf_cli.models import load_causal_lm

    models = [load_causal_lm(tiny_model_cfg, "fp32", seed, tokenizer=tokenizer) for seed in (1, 2)]
    for m in models:
        with torch.no_grad():
            m.get_output_embeddings().weight.zero_()
    seeds = [derive_seed(3, k) for k in range(4)]
    ids = [p["prompt_ids"] for p in prompts[:4]]
    gen = hf(models[0], chunk=4)  # one engine, pointed at each model in turn (as `rlhf eval` does)
    a = gen.generate(ids, seeds, sampling([NO_EOS], 6))
    gen.update_weights(models[1])
    b = gen.generate(ids[::-1], seeds[::-1], sampling([NO_EOS], 6))
    assert torch.equal(a.responses, b.responses.flip(0))
    V = models[0].get_output_embeddings().weight.shape[0]
    for row, seed in zip(a.responses.tolist(), seeds):
        g = torch.Generator().manual_seed(seed)
        gumbel = lambda u: -torch.log(-torch.log(u.clamp(2.0**-24, 1.0 - 2.0**-24)))  # noqa: E731
        assert row == [int(gumbel(torch.rand(V, generator=g)).argmax()) for _ in range(6)]


# ----------------------------------------------------------------------------------------------
# several EOS ids


def test_response_mask_cuts_at_the_first_of_several_eos_ids():
    eos, pad = (2, 7), 0
    responses = torch.tensor([[5, 7, 2, 3],   # the second id first
                              [5, 2, 7, 3],   # the first id first
                              [4, 5, 6, 8],   # neither
                              [7, 4, 4, 4],   # at once
                              [3, 4, 5, 2]])  # the last column
    cleaned, mask, has_eos = response_mask(responses, eos, pad)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert cleaned.tolist() == [[5, 7, 0, 0], [5, 2, 0, 0], [4, 5, 6, 8], [7, 0, 0, 0], [3, 4, 5, 2]]
    assert has_eos.tolist() == [True, True, False, True, True]

    g = torch.Generator().manual_seed(0)  # against a plain loop on random rows
    x = torch.randint(0, 9, (64, 7), generator=g)
    cleaned, mask, has_eos = response_mask(x, eos, pad)
    for row, c, m, h in zip(x.tolist(), cleaned.tolist(), mask.tolist(), has_eos.tolist()):
        n = next((t + 1 for t, v in enumerate(row) if v in eos), len(row))
        assert m == [1.0] * n + [0.0] * (len(row) - n)
        assert c == row[:n] + [pad] * (len(row) - n)
        assert h == any(v in eos for v in row)
    assert torch.equal(response_mask(x, (2,), pad)[1], response_mask(x, 2, pad)[1])  # one id: as an int


def test_generate_ends_a_response_at_whichever_eos_id_comes_first(lm, prompts, monkeypatch):
    """Two prompts; one id of `eos_ids` first appears in the first response, the other later in the second: each
    response ends at its own, and HF `generate` stops once both have (its output is no wider)."""
    seeds = [derive_seed(5, k) for k in range(len(prompts))]
    raw, _ = common_tokens(lm, prompts, seeds)
    rows = raw.responses.tolist()
    # row 0 ends at i on a (a token new to it); row 1 at j > i on b; neither id appears earlier in the other row
    i, j, a, b = next((i, j, rows[0][i], rows[1][j]) for i in range(1, 6) for j in range(i + 1, 11)
                      if rows[0][i] not in rows[0][:i] + rows[1][:j + 1]
                      and rows[1][j] not in rows[1][:j] + rows[0][:i + 1])
    widths = []
    generate = lm.generate

    def spy(*args, **kwargs):
        out = generate(*args, **kwargs)
        widths.append(out.shape[1] - kwargs["input_ids"].shape[1])
        return out

    monkeypatch.setattr(lm, "generate", spy)
    ids = [p["prompt_ids"] for p in prompts[:2]]
    gen = hf(lm).generate(ids, seeds[:2], sampling([a, b], 12))
    assert responses_of(gen) == [rows[0][:i + 1], rows[1][:j + 1]]
    assert gen.has_eos.tolist() == [True, True] and gen.responses.shape == (2, 12)
    assert widths == [j + 1]  # generate stopped when the second response ended, on the other id


# ----------------------------------------------------------------------------------------------
# the config key and the registry


def test_the_registry_and_the_config_name_the_same_engines():
    assert ("auto", *GENERATORS) == config.ROLLOUT_ENGINES  # auto resolves to one of them
    settings = EngineSettings(precision="fp32", chunk=4)
    assert isinstance(make_generator("hf", settings), HFGenerator)
    with pytest.raises(ValueError, match="rollout.engine='bogus' is not one of hf, vllm"):
        make_generator("bogus", settings)


@pytest.mark.parametrize("precision,score_precision,setting,want", [
    # auto: the dtype of the scoring passes the samples are trained against (None, as eval: the run's precision)
    ("fp32", "fp32", "auto", torch.float32), ("bf16-autocast", "fp32", "auto", torch.float32),
    ("bf16-autocast", "bf16-autocast", "auto", torch.bfloat16), ("bf16", "bf16", "auto", torch.bfloat16),
    ("bf16-autocast", None, "auto", torch.bfloat16), ("fp32", None, "auto", torch.float32),
    # as set
    ("bf16-autocast", "fp32", "bf16", torch.bfloat16), ("fp32", "fp32", "bf16", torch.bfloat16),
    ("bf16", "bf16", "fp32", torch.float32), ("bf16-autocast", None, "fp32", torch.float32)])
def test_the_engine_dtype_follows_the_scoring_passes_unless_set(precision, score_precision, setting, want):
    assert resolve_dtype(precision, setting, score_precision) == want
    assert generation.dtype_setting(want) == ("fp32" if want == torch.float32 else "bf16")  # as tables name it
    assert set(config.ENGINE_DTYPES) == {"auto", *generation.ENGINE_DTYPES}


def test_an_engine_dtype_the_hf_engine_does_not_read_is_said_once_and_a_bad_one_refused(caplog):
    with caplog.at_level("WARNING"):
        make_generator("hf", EngineSettings(precision="bf16-autocast", chunk=4, engine_dtype="fp32"))
        make_generator("hf", EngineSettings(precision="bf16-autocast", chunk=4))
    said = [r.getMessage() for r in caplog.records if "engine_dtype" in r.getMessage()]
    assert said == ["rollout.engine_dtype=fp32 does nothing with rollout.engine=hf: it samples with the trainer's "
                    "weights under precision=bf16-autocast"]
    for command in ("train_ppo", "eval"):
        with pytest.raises(ConfigError, match="rollout.engine_dtype='fp16' is not one of auto, fp32, bf16"):
            config.validate_rollout(compose(command, ["model=tiny", "rollout.engine_dtype=fp16"]))


@pytest.mark.parametrize("command", ["train_ppo", "eval"])
def test_vllm_without_a_kv_cache_or_not_installed_is_refused_in_one_line(command, monkeypatch):
    import importlib.util

    validate = {"train_ppo": config.validate_ppo, "eval": config.validate_eval}[command]
    with pytest.raises(ConfigError, match="rollout.kv_cache_gb must be >= 1"):
        validate(compose(command, ["model=tiny", "rollout.engine=vllm", "rollout.kv_cache_gb=0"]))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="vLLM is not installed in this environment: run `make install-vllm`"):
        validate(compose(command, ["model=tiny", "rollout.engine=vllm"]))
    validate(compose(command, ["model=tiny"]))  # hf needs nothing more


def test_auto_samples_with_hf_where_vllm_is_not_installed_or_cannot_serve_the_model(tiny_causal, monkeypatch):
    import importlib.util
    import sys
    import types

    cfg = tiny_causal.config
    assert resolve_engine("hf", cfg) == ("hf", "as set") and resolve_engine("vllm", cfg) == ("vllm", "as set")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    assert resolve_engine("auto", cfg) == ("hf", "auto: vLLM is not installed (`make install-vllm`)")
    assert describe_engine("auto", cfg) == "hf (auto: vLLM is not installed (`make install-vllm`))"
    # vLLM "installed": what it can serve decides (`vllm_engine.unservable`, tested on the real engine too)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    fake = types.ModuleType("rlhf_cli.rollout.vllm_engine")
    fake.unservable = lambda config: None if config is cfg else "head size 16"
    monkeypatch.setitem(sys.modules, "rlhf_cli.rollout.vllm_engine", fake)
    assert resolve_engine("auto", cfg) == ("vllm", "auto: vLLM is installed and serves this model")
    assert resolve_engine("auto", type(cfg)()) == ("hf", "auto: head size 16")

    def broken(config):
        raise ImportError("operator torchvision::nms does not exist\nmore")

    fake.unservable = broken  # installed, but its import fails (a wheel for another torch): hf, said why
    assert resolve_engine("auto", cfg) == ("hf", "auto: vLLM is installed but does not import (ImportError: "
                                                 "operator torchvision::nms does not exist)")


@pytest.mark.parametrize("command", ["train_ppo", "eval"])
def test_an_unknown_engine_is_refused_in_one_line(command):
    cfg = compose(command, ["model=tiny", "rollout.engine=bogus"])
    with pytest.raises(ConfigError) as e:
        by_config(command).validator(cfg)
    assert str(e.value) == "rollout.engine='bogus' is not one of auto, hf, vllm"


def test_only_the_commands_that_sample_read_the_engine():
    assert check_override_keys("train_ppo", ["rollout.engine=hf"]) == []
    assert check_override_keys("eval", ["rollout.engine=hf"]) == []
    with pytest.raises(ConfigError) as e:
        check_override_keys("train_rm", ["rollout.engine=hf"])
    assert str(e.value).startswith("`rlhf train-rm` does not read rollout.engine (an `rlhf train-ppo / eval` key)")


def test_engine_weights_are_the_checkpoint_names_with_lora_merged(tiny_causal, tokenizer):
    """What a vLLM push carries (`vllm_engine.engine_weights`, importable without vllm): the HF checkpoint's names,
    tied `lm_head.weight` included; under LoRA the merged W + B·A·α/r under the base name, and the merged model
    computes what the model with its adapters computes."""
    import copy

    from rlhf_cli.models.lora import add_lora
    from rlhf_cli.rollout.vllm_engine import engine_weights

    plain = dict(engine_weights(tiny_causal))
    assert set(plain) == set(tiny_causal.state_dict()) and "lm_head.weight" in plain
    lm = copy.deepcopy(tiny_causal)
    add_lora(lm, compose("train_ppo", ["model=tiny", "model.lora.r=4"]).model.lora, what="policy")
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    merged = dict(engine_weights(lm, torch.float32))
    assert set(merged) == set(plain)
    layer = lm.model.layers[0].self_attn.q_proj
    scale = layer.scaling["default"]
    want = layer.base_layer.weight + scale * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], want)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], plain[q])
    fresh = copy.deepcopy(tiny_causal)
    fresh.load_state_dict(merged)
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, lm(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_the_engine_drift_guard_stops_a_stale_bf16_engine_not_a_spike_and_never_an_exact_one():
    from rlhf_cli.rollout import EngineDriftGuard

    key = "rollout/engine_logprob_diff_mean"
    guard = EngineDriftGuard()
    guard.check({}, 0)  # an engine without log-probs (hf): nothing to check
    # a pushed run measured on SmolLM2 (experiment=grpo, seed 1): a 3.7x spike at iteration 4, then back
    for it, diff in enumerate([0.022, 0.0291, 0.0332, 0.0819, 0.025, 0.030, 0.0612, 0.024]):
        guard.check({key: diff}, it)
    stale = EngineDriftGuard()  # pushes skipped (docs/results.md): 1.0x, 2.4x, then 3.5x
    for it, diff in enumerate([0.029, 0.070, 0.102]):
        stale.check({key: diff}, it)
    with pytest.raises(FloatingPointError, match=r"aborting at iteration 4: .* 0.102 nats/token from the trainer's "
                                                 r"\(median of the last 3 iterations\), > 3x the 0.029"):
        stale.check({key: 0.136}, 3)
    exact = EngineDriftGuard(active=False)
    for it, diff in enumerate([1e-6, 1.0, 1.0, 1.0]):  # engine and scoring in fp32: the greedy probe is the check
        exact.check({key: diff}, it)


def test_a_policy_and_its_reference_of_one_architecture_share_an_engine(tiny_model_cfg, tokenizer):
    """`vllm_engine.architecture`: a run's bookkeeping (name, `rlhf_*` lineage keys, dtype) does not make a second
    engine; a different depth does (eval's reference then gets its own)."""
    import copy

    from rlhf_cli.models import load_causal_lm
    from rlhf_cli.rollout.vllm_engine import architecture

    policy = load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer)
    reference = load_causal_lm(tiny_model_cfg, seed=1, tokenizer=tokenizer)
    policy.config._name_or_path, policy.config.rlhf_stage = "/runs/ppo/final", "ppo"
    assert architecture(policy.config) == architecture(reference.config)
    shallow = copy.deepcopy(tiny_model_cfg)
    shallow.arch.num_hidden_layers = 1
    other = load_causal_lm(shallow, seed=0, tokenizer=tokenizer)
    assert architecture(other.config) != architecture(reference.config)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_under_zero3_the_push_gathers_one_layer_at_a_time_and_carries_the_full_weights(tmp_path, lora):
    """ZeRO-3 (one rank, in process): `engine_weights(..., gather=actor.gathered)` yields every checkpoint name with
    its full, merged weight, equal to the weights gathered all at once, while at most one layer's parameters (a
    LoRA layer's base and adapters: 3) are whole at any yield; `engine_weight_shapes` gives the same names and
    shapes without gathering; the yielded tensors are copies (they outlive the gather). The same run under ZeRO-0
    pushes the same values (every tensor's `fingerprint` equal)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from test_stage_ppo import build_trainer

    from rlhf_cli.models import lm_of
    from rlhf_cli.rollout.vllm_engine import engine_weight_shapes, engine_weights, fingerprint

    common = ["ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=2", *(["model.lora.r=4"] if lora else [])]
    zero0 = {n: fingerprint(t) for n, t in engine_weights(lm_of(build_trainer(tmp_path / "z0", common).actor.module))}
    tr = build_trainer(tmp_path, ["deepspeed=zero3", *common])
    lm = lm_of(tr.actor.module)
    params = list(lm.parameters())
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)  # partitioned
    with tr.actor.gathered_params():
        want = dict(engine_weights(lm))
        want = {k: v.clone() for k, v in want.items()}
    whole_at_yield = []
    got = {}
    for name, tensor in engine_weights(lm, gather=tr.actor.gathered):
        whole_at_yield.append(sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in params))
        got[name] = tensor
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)
    assert set(got) == set(want) and "lm_head.weight" in got
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert max(whole_at_yield) <= 3 < len(params)
    assert engine_weight_shapes(lm) == {k: tuple(v.shape) for k, v in want.items()}
    assert {k: fingerprint(v) for k, v in got.items()} == zero0
    if lora:
        assert not any("lora_" in k or "base_layer" in k for k in got)


def test_a_colocated_engine_on_a_gpu_asks_for_a_share_of_the_memory_the_trainer_left_free():
    """vLLM refuses to start when free memory < gpu_memory_utilization × total (its default 0.9 assumes an empty
    device): the engine asks for 90 % of what is free when it starts, as a fraction of the whole device."""
    from rlhf_cli.rollout.vllm_engine import gpu_memory_utilization

    gib = 1 << 30
    assert gpu_memory_utilization(140 * gib, 140 * gib) == 0.9  # an empty device: vLLM's default
    assert gpu_memory_utilization(100 * gib, 140 * gib) == 0.64  # 0.9 × 100/140 = 0.643, rounded down
    assert gpu_memory_utilization(100 * gib, 140 * gib) * 140 * gib <= 100 * gib
    assert gpu_memory_utilization(0, 140 * gib) == 0.01
    with pytest.raises(ValueError):
        gpu_memory_utilization(1, 0)


def test_a_fingerprint_tells_a_changed_or_permuted_tensor_from_an_equal_one():
    """`vllm_engine.fingerprint` (importable without vllm), which counts the tensors a push changed: equal values
    give equal prints in any dtype and chunking; one value moved by one ulp, or two values swapped, give others."""
    from rlhf_cli.rollout.vllm_engine import fingerprint

    w = torch.randn(300, 7, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = w.to(dtype)
        assert fingerprint(t) == fingerprint(t.clone()) == fingerprint(t, chunk=64)
        nudged = t.clone()
        nudged[5, 3] = torch.nextafter(nudged[5, 3].float(), torch.tensor(1e9)).to(dtype) if dtype == torch.float32 \
            else nudged[5, 3] + nudged[5, 3].abs() * 0.01 + 1e-3
        swapped = t.clone()
        swapped[[0, 1]] = t[[1, 0]]
        assert fingerprint(nudged) != fingerprint(t)
        plain, weighted = fingerprint(swapped)
        assert plain == fingerprint(t)[0] and weighted != fingerprint(t)[1]  # a permutation: the weighted sum


def test_a_push_that_changed_nothing_after_a_step_stops_the_run():
    """`stats.PushGuard`: the count is logged; 0 after an iteration that stepped aborts (one line); 0 after a start,
    an iteration with nothing to train or a skipped step does not; an engine without a count logs nothing."""
    from rlhf_cli.rollout import PushGuard

    g = PushGuard()
    assert g.check(None, 0) == {}  # hf: nothing pushed
    assert g.check(0, 0) == {"rollout/engine_tensors_changed": 0.0}  # the self-test's push after a start
    g.stepped(True)
    assert g.check(30, 1) == {"rollout/engine_tensors_changed": 30.0}
    g.stepped(False)  # nothing trained (filter_groups) or a skipped step
    assert g.check(0, 2) == {"rollout/engine_tensors_changed": 0.0}
    g.stepped(True)
    with pytest.raises(FloatingPointError, match=r"aborting at iteration 4: the weight push before its rollout "
                                                 r"changed no tensor of the engine after iteration 3's optimizer step"):
        g.check(0, 3)


def test_the_self_tests_verdict_passes_equal_decodes_and_a_bf16_near_tie_only():
    """`vllm_engine.selftest_verdict` (importable without vllm): equal decodes pass with gap 0; a log-prob moved past
    the tolerance fails; a flipped near tie passes at bf16's tolerance and fails at fp32's 0."""
    from rlhf_cli.rollout.vllm_engine import selftest_verdict

    loaded = [([5, 7], [{5: -0.10, 6: -2.0}, {7: -0.50, 8: -0.505}])]
    assert selftest_verdict(loaded, loaded, 0.0) == (None, 0.0)
    moved = [([5, 7], [{5: -0.13, 6: -2.0}, {7: -0.50, 8: -0.505}])]
    failure, worst = selftest_verdict(loaded, moved, 1e-2)
    assert failure.startswith("probe prompt 0, greedy token 0: 5, log-prob -0.100000 as loaded") and worst > 0.029
    flipped = [([5, 8], [{5: -0.10, 6: -2.0}, {8: -0.501, 7: -0.503}])]
    assert selftest_verdict(loaded, flipped, 1e-2)[0] is None
    assert "greedy token 1: 7 as loaded, 8 after the push" in selftest_verdict(loaded, flipped, 0.0)[0]
