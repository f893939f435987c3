"""Save models as plain HF directories and inspect saved ones.

    save_hf(model, tokenizer, out_dir, extra_config=None)   safetensors + config + tokenizer, atomically
    with_scoring_template(tokenizer, eos_set)                  a reward model's tokenizer: ends at EOS, pads right
    read_score_stats(path) -> (mean, std) | None               reward normalisation stored by train-rm
    is_scalar_model_dir(path) -> bool                          reward model / critic, or not
    require_scalar_model_dir(path, what)                       the same, as a one-line error
    model_architectures(path) -> list[str]                     what a local model path holds, without loading it

A saved policy loads with `AutoModelForCausalLM.from_pretrained(dir)`, a saved reward model with
`AutoModelForSequenceClassification.from_pretrained(dir)` (num_labels=1, pad_token_id set); the
tokenizer (pad token distinct from EOS, chat template) lies beside the weights.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_cli.commands import by_kind
from rlhf_cli.eos import eos_ids, eos_texts
from rlhf_cli.errors import ModelSourceError
from rlhf_cli.models.loading import atomic_dir, fix_pad_token, looks_like_hub_id, resolve_hf_dir
from rlhf_cli.runs import save_error

log = logging.getLogger(__name__)

REWARD_MEAN_KEY = "rlhf_reward_mean"
REWARD_STD_KEY = "rlhf_reward_std"


def save_hf(
    model: Any,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    extra_config: dict | None = None,
    state_dict: dict | None = None,
) -> Path:
    """Write `model` (safetensors + config.json [+ generation_config.json]) and `tokenizer` to `out_dir`.

    The dir is written as a temp sibling and renamed into place, so a crash leaves any previous
    `out_dir` intact, and a failed write (disk full, quota...) raises runs.SaveError, one line, with
    nothing replaced. The saved config has no `quantization_config`, `pad_token_id` = the
    tokenizer's pad, and for scalar models `num_labels=1`; `extra_config` entries (JSON values, e.g.
    `{"rlhf_reward_mean": 0.1, "rlhf_reward_std": 1.3}`) become config.json keys. The live model's
    config is not changed. `state_dict` overrides the weights written (e.g. gathered ZeRO-3 ones).
    A DeepSpeed/DDP wrapper is unwrapped. Returns the final path.
    """
    model = getattr(model, "module", model)
    tokenizer = fix_pad_token(tokenizer)
    if getattr(tokenizer, "chat_template", None) is None:
        log.warning("saving a tokenizer without a chat template to %s", out_dir)

    live_config = model.config
    live_gen = getattr(model, "generation_config", None)
    live_quantizer = getattr(model, "hf_quantizer", None)
    config_dict = live_config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(live_config).from_dict(config_dict)
    config.pad_token_id = tokenizer.pad_token_id
    if _is_scalar_class(type(model).__name__):
        config.num_labels = 1
    for key, value in (extra_config or {}).items():
        json.dumps(value)  # fail here, not halfway through the save, on a non-JSON value
        setattr(config, key, value)
    gen = copy.deepcopy(live_gen) if live_gen is not None else None
    if gen is not None:
        gen.pad_token_id = tokenizer.pad_token_id
        gen.eos_token_id = list(eos_ids(tokenizer, gen))  # the whole EOS set: generate stops where the run did

    out = Path(out_dir)
    try:
        model.config, model.hf_quantizer = config, None
        if gen is not None:
            model.generation_config = gen
        with atomic_dir(out) as tmp:
            model.save_pretrained(str(tmp), state_dict=state_dict)
            tokenizer.save_pretrained(str(tmp))
    except OSError as e:  # disk full, quota, read-only: one line; the previous `out` is untouched
        raise save_error(f"the {type(model).__name__} checkpoint", out, e) from e
    finally:
        model.config = live_config
        if live_gen is not None:
            model.generation_config = live_gen
        if live_quantizer is not None:
            model.hf_quantizer = live_quantizer
        elif "hf_quantizer" in vars(model):
            del model.hf_quantizer
    log.info("saved %s to %s", type(model).__name__, out)
    return out


def with_scoring_template(tokenizer: Any, eos_set: Sequence[int] = ()) -> Any:
    """A copy of `tokenizer` whose chat template ends a conversation that ends with an assistant message AT its
    EOS (SmolLM2's template writes `<|im_end|>\\n`: the newline goes), for a reward model's `final/`.

    The end is the run's (`eos.eos_ids`, `data.Encoder`): the assistant's content, then the tokenizer's EOS once.
    A template that closes the turn with other ids of the EOS set `eos_set` (Phi-3: `<|end|>\\n<|endoftext|>`) has
    that whole tail, the EOS-set texts and the whitespace between them, replaced by the tokenizer's EOS.

    A reward model is trained and scored at the EOS closing the response; `AutoModelForSequenceClassification`
    reads the last non-pad token. With this template the standard call,
    `tokenizer.apply_chat_template([user, assistant], return_dict=True, return_tensors="pt")`, ends at that EOS,
    so it scores as the run did. Prompt rendering (`add_generation_prompt=True`) is unchanged. A template that
    already ends there, or none, is kept as it is.

    The copy pads on the right (`padding_side="right"`, saved in `tokenizer_config.json`), the side the run's scores
    assume for every family: the run counts positions from each sequence's first token, and so does a plain
    transformers forward of right-padded rows; left padding shifts every position of an absolute-position family
    (GPT-2, OPT), and their scores with it.
    """
    template = getattr(tokenizer, "chat_template", None)
    eos = tokenizer.eos_token
    out = copy.deepcopy(tokenizer)
    out.padding_side = out.init_kwargs["padding_side"] = "right"  # what save_pretrained writes is `init_kwargs`
    if not isinstance(template, str) or not eos:
        return out
    answer = "\ue002"  # a private-use character: what the template writes after it is the turn's tail
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
    try:
        rendered = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that rejects this conversation: save it as it is
        return out
    texts = eos_texts(tokenizer, eos_set)
    tail = rendered[rendered.rfind(answer) + len(answer):] if answer in rendered else ""
    rest, ends = tail, 0
    while rest := rest.strip():
        end = next((t for t in texts if rest.endswith(t)), None)
        if end is None:
            return out  # the turn's tail holds other text: leave the template as it is
        rest, ends = rest[: -len(end)], ends + 1
    if not ends or tail == eos:  # no EOS at the end, or it already ends at the EOS
        return out
    out.chat_template = (
        "{%- set rendered -%}" + template + "{%- endset -%}"
        "{%- if not add_generation_prompt and messages and messages[-1]['role'] == 'assistant' "
        f"and rendered.endswith({json.dumps(tail)}) -%}}{{{{ rendered[:{-len(tail)}] + eos_token }}}}"
        "{%- else -%}{{ rendered }}{%- endif -%}")
    return out


def _read_config(path: str | os.PathLike) -> dict | None:
    """config.json of a local model dir (run dir / final dir / pointer file resolved), or of a hub
    id through the offline cache; None when there is none."""
    try:
        resolved = resolve_hf_dir(str(path))
    except ModelSourceError:
        return None
    cfg_file = Path(resolved) / "config.json"
    if cfg_file.is_file():
        return json.loads(cfg_file.read_text())
    if Path(resolved).exists():
        return None
    try:  # a hub id
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(resolved).to_dict()
    except Exception:  # noqa: BLE001 - any failure means "not a readable model"
        return None


def _is_scalar_class(name: str) -> bool:
    return name.endswith("ForSequenceClassification")


def is_scalar_model_dir(path: str | os.PathLike) -> bool:
    """True when `path` holds a scalar-head model (config architecture `*ForSequenceClassification`)."""
    config = _read_config(path)
    return bool(config) and any(_is_scalar_class(a) for a in config.get("architectures") or [])


def model_architectures(path: str | os.PathLike) -> list[str]:
    """The `architectures` of the model at a local path (run dir, `final/` dir, model dir or pointer
    file), read from its config.json: e.g. ["LlamaForCausalLM"]; [] when the config names none.

    Raises ModelSourceError (one line) when the path does not exist, holds no model, or its config.json
    is not readable JSON. Hub ids are not looked up here.
    """
    resolved = Path(resolve_hf_dir(str(path)))
    cfg_file = resolved / "config.json"
    if not cfg_file.is_file():
        raise ModelSourceError(f"'{path}' holds a tokenizer but no model (no config.json)")
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"{cfg_file} is not readable JSON ({e})") from None
    return list(config.get("architectures") or []) if isinstance(config, dict) else []


def require_scalar_model_dir(path: str | os.PathLike, what: str = "reward model") -> str:
    """The resolved dir of a scalar model, or a one-line ModelSourceError saying what `path` holds."""
    config = _read_config(path)
    if config is None:
        local = Path(str(path)).expanduser()
        why = ("no config.json" if local.exists() else "the path does not exist" if not looks_like_hub_id(str(path))
               else "not a local path, and not a model in the hub cache")
        raise ModelSourceError(f"{what} '{path}' holds no model ({why}); point it at the output of "
                               f"`{by_kind('rm').invocation}` (a run dir or its final/) or an HF reward-model dir")
    archs = config.get("architectures") or []
    if not any(_is_scalar_class(a) for a in archs):
        kind = ", ".join(archs) or "no architecture"
        raise ModelSourceError(
            f"{what} '{path}' is not a reward model ({kind}); point it at the output of `{by_kind('rm').invocation}`")
    return resolve_hf_dir(str(path))


def read_score_stats(path: str | os.PathLike) -> tuple[float, float] | None:
    """(mean, std) of the reward model's scores stored by `save_hf(extra_config=...)`, else None."""
    config = _read_config(path) or {}
    if REWARD_MEAN_KEY in config and REWARD_STD_KEY in config:
        return float(config[REWARD_MEAN_KEY]), float(config[REWARD_STD_KEY])
    return None
