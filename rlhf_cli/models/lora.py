"""LoRA adapters through peft (`model.lora.*`): add them, switch them off, merge them into plain weights, save them.

    add_lora(model, lora_cfg, heads=(), what="policy")   inject adapters in place (peft), freeze the rest
    has_lora(model) -> bool                                whether a model carries adapters
    adapters_disabled(model)                               context: the base model's function for the block
    without_adapters(lm)                                   a view of a LoRA causal LM as its base model
    merged_state_dict(model, state_dict)                   plain HF weights, W + (alpha/r)·B·A merged in fp32
    save_adapter(model, state_dict, out_dir, base)        the adapter in peft's own format

The model stays the transformers model it was (peft's `inject_adapter_in_model`, no `PeftModel` wrapper), so every
forward of the package (`trunk_hidden`, the LM head, the scalar head) reads it as before, and DeepSpeed trains
only the parameters left with `requires_grad`: the adapters and the heads named in `heads` (the reward model's
and critic's `score`, trained in full through peft's `modules_to_save`; its `Float32Head` class survives the
copy peft makes, so the head still computes in float32).

LoRA (Hu et al. 2021, eq. 3): h = W₀x + (alpha/r)·B·A·x with A (r, in) and B (out, r), B = 0 at the start, so a
new adapter leaves the model's function unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf_cli.errors import ConfigError

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
"""Where a stage writes a LoRA run's adapter beside its merged weights: `final/adapter/` (peft's format)."""


def lora_enabled(lora_cfg: Any) -> bool:
    """Whether a `model.lora` section asks for adapters (`r` > 0)."""
    return lora_cfg is not None and int(lora_cfg.r) > 0


def linear_layer_types() -> tuple[type, ...]:
    """The layer types LoRA adapts here: `nn.Linear`, and transformers' `Conv1D` (GPT-2's attention and MLP: a
    linear layer whose weight is stored transposed, (in, out); peft sets `fan_in_fan_out` for it, and
    `merged_state_dict` transposes its update)."""
    from transformers.pytorch_utils import Conv1D

    return torch.nn.Linear, Conv1D


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last name parts of `model`'s linear layers (`linear_layer_types`: `q_proj`, `down_proj`, `c_attn`,
    `score`, ...), LoRA's own layers left out: what `model.lora.target_modules` can name."""
    names = set()
    for name, m in model.named_modules():
        parts = [p for p in name.split(".") if p != "base_layer"]
        if isinstance(m, linear_layer_types()) and parts and not any(p.startswith("lora_") for p in parts):
            names.add(parts[-1])
    return sorted(names)


def add_lora(model: torch.nn.Module, lora_cfg: Any, heads: Sequence[str] = (), what: str = "policy") -> torch.nn.Module:
    """Inject LoRA adapters into `model` in place (peft `inject_adapter_in_model`) and freeze everything else.

    lora_cfg: the `model.lora` section: `r` (rank, > 0), `alpha` (the update is scaled by alpha/r), `dropout`
    (on the adapter's input), `target_modules` (`all-linear`: every linear layer of the trunk, not the LM head
    or the heads; or a list of module names, as peft matches them). heads: modules trained in full beside the
    adapters (peft's `modules_to_save`), e.g. `("score",)` for a reward model or critic. Returns `model`, whose
    trainable parameters are then the adapters' A and B and the heads' copies.

    Raises:
        ConfigError: `target_modules` names no module of `model` (the message lists its linear modules), names
            a layer that is not linear (`linear_layer_types`: the merge into plain weights handles those only), or one
            outside the trunk (the LM head: a LoRA policy's reference reads it with the adapters off).
    """
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    targets = lora_cfg.target_modules
    targets = targets if isinstance(targets, str) else list(targets)
    config = LoraConfig(r=int(lora_cfg.r), lora_alpha=float(lora_cfg.alpha), lora_dropout=float(lora_cfg.dropout),
                        target_modules=targets, modules_to_save=list(heads) or None, bias="none")
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:  # peft's NoMatchingPeftModuleError, or "Target modules ... not found" in older ones
        if type(e).__name__ != "NoMatchingPeftModuleError" and "not found" not in str(e):
            raise
        raise ConfigError(f"model.lora.target_modules={targets} matches no module of the {what} "
                          f"({type(model).__name__}); set model.lora.target_modules to some of its linear modules: "
                          f"{', '.join(linear_module_names(model))}") from None
    adapted = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    trunk = f"{model.base_model_prefix}."
    for name, m in adapted:
        if not isinstance(m.base_layer, linear_layer_types()):
            raise ConfigError(f"model.lora.target_modules={targets} takes {name} ({type(m.base_layer).__name__}), "
                              f"not a linear layer: LoRA here adapts linear layers only; set "
                              f"model.lora.target_modules to some of {', '.join(linear_module_names(model))}")
        if not name.startswith(trunk):
            raise ConfigError(f"model.lora.target_modules={targets} takes {name}, outside the trunk ({trunk}*): "
                              f"adapters go on the trunk's linear layers (the LM head is the reference's too, and "
                              f"often tied to the embeddings; scalar heads train in full)")
    trained, total = parameter_counts(model)
    log.info("LoRA on the %s: r=%d alpha=%g dropout=%g targets=%s heads=%s: %.2fM of %.1fM parameters trained",
             what, config.r, config.lora_alpha, config.lora_dropout, targets, list(heads), trained / 1e6,
             total / 1e6)
    return model


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trained, total) parameter counts of a model; `total` counts the model's own weights, not LoRA's adapters
    and not peft's trained copies of the heads (`modules_to_save`), so that it reads as the model's size."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n and ".modules_to_save." not in n)
    return trained, total


def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules peft's LoRA injected into `model` (each holds its base layer and its adapters)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module peft switches with `enable_adapters`: the LoRA layers, and the heads trained in full through
    `modules_to_save` (off, such a wrapper runs the original head it keeps)."""
    from peft.utils.other import AuxiliaryTrainingWrapper

    return lora_layers(model) + [m for m in model.modules() if isinstance(m, AuxiliaryTrainingWrapper)]


def lora_delta_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each LoRA layer's weight update, keyed by the name its base weight has in the model's HF checkpoint.

    model: a module with adapters injected by `add_lora` (or none: returns {}). For each active LoRA layer,
    ΔW = peft's `get_delta_weight` of its adapter (B·A·α/r, in the base weight's layout: (out, in) for a Linear),
    under `<module name>.weight` (the checkpoint name of the base weight, without peft's `.base_layer.`). A layer
    whose adapters are off or already merged into its base weight contributes nothing. So W + ΔW is the weight the
    model computes with (the merged model an inference engine or `merge_and_unload` would hold). Detached.
    """
    deltas: dict[str, torch.Tensor] = {}
    layers = set(lora_layers(model))
    for name, module in model.named_modules():
        delta = lora_delta(module) if module in layers else None
        if delta is not None:
            deltas[f"{name}.weight"] = delta
    return deltas


def lora_delta(layer: torch.nn.Module) -> torch.Tensor | None:
    """One LoRA layer's weight update ΔW, the sum of peft's `get_delta_weight` over its active adapters (see
    `lora_delta_weights`), detached; None for a layer whose adapters are off or already merged, or any other
    module."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(layer, LoraLayer) or layer.disable_adapters or layer.merged:
        return None
    delta = None
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            d = layer.get_delta_weight(adapter).detach()
            delta = d if delta is None else delta + d
    return delta


def has_lora(model: Any) -> bool:
    """Whether `model` (or the module a DeepSpeed engine wraps) carries LoRA adapters."""
    return bool(lora_layers(getattr(model, "module", model)))


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module, layers: Sequence[torch.nn.Module] | None = None) -> Iterator[None]:
    """For the block, every LoRA layer of `model` computes its base layer alone and every head trained through
    `modules_to_save` is its original (peft's `enable_adapters(False)`): the function of the model the adapters
    were added to. The adapters' `requires_grad` flags are put back as they were on exit (peft's toggle resets
    them). `layers`: those modules when the caller keeps them (found by a walk over every module otherwise)."""
    layers = _adapter_layers(model) if layers is None else layers
    flags = [(p, p.requires_grad) for m in layers for p in m.parameters()]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


class _WithoutAdapters:
    """Calls one module of a LoRA model (its trunk, a head) with the model's adapters switched off (see
    `without_adapters`)."""

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
        self.model, self.inner, self.layers = model, module, layers

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training = self.inner.training  # the trained model may be in train mode: the frozen view never is
        self.inner.eval()
        try:
            with adapters_disabled(self.model, self.layers):
                return self.inner(*args, **kwargs)
        finally:
            self.inner.train(training)


class without_adapters:  # noqa: N801 - reads as a function: `reference = without_adapters(policy)`
    """A LoRA model seen as its base model, sharing its weights: the reference policy of a LoRA run (TRL and
    OpenRLHF do the same), or the reward model under a LoRA critic grown from it, with no second copy of the
    weights.

    It answers what the package's forwards read from a causal LM or a scalar model (`config`,
    `base_model_prefix`, the trunk under that name, `lm_head`, `score`, `parameters()`); the trunk and the
    scalar head run with every adapter off for that one call (the head as the original that peft's
    `modules_to_save` keeps), so the trained model itself may run with its adapters between two of the view's
    calls. The LM head carries no adapter (`target_modules=all-linear` leaves it out). Not an `nn.Module`:
    nothing can train or move it by mistake.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._lm = model
        self._layers = _adapter_layers(model)  # once: adapters are added before the view is made, never after

    @property
    def config(self) -> Any:
        return self._lm.config

    @property
    def base_model_prefix(self) -> str:
        return self._lm.base_model_prefix

    @property
    def lm_head(self) -> torch.nn.Module:
        return self._lm.lm_head

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self._lm.parameters()

    def __getattr__(self, name: str) -> Any:
        if name in (self._lm.base_model_prefix, "score"):
            return _WithoutAdapters(self._lm, getattr(self._lm, name), self._layers)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def merged_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain transformers state dict of a LoRA model: what `from_pretrained` of the model class reads.

    model: the LoRA model (its layers give the names and each adapter's scaling alpha/r); state_dict: its full
    state dict (keys as `model.state_dict()` names them, e.g. a ZeRO-3 consolidated one). For each LoRA layer
    `X`: `X.weight` = W₀ + (alpha/r)·B·A, computed in float32 and then cast to W₀'s dtype once (a bf16 merge
    would drop every delta under half an ulp of W₀); `X.bias` = the base bias. A head trained through
    `modules_to_save` gives its trained copy under its own name; the frozen original is dropped. Other keys
    are unchanged. Raises KeyError when `state_dict` lacks a tensor of a LoRA layer.
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    out = dict(state_dict)
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            prefix = f"{name}." if name else ""
            base = out.pop(f"{prefix}base_layer.weight")
            delta = torch.zeros(base.shape, dtype=torch.float32, device=base.device)
            for adapter in m.active_adapters:
                a = out.pop(f"{prefix}lora_A.{adapter}.weight").float()
                b = out.pop(f"{prefix}lora_B.{adapter}.weight").float()
                ba = b @ a
                delta += (ba.T if m.fan_in_fan_out else ba) * m.scaling[adapter]
            out[f"{prefix}weight"] = (base.float() + delta).to(base.dtype)
            if f"{prefix}base_layer.bias" in out:
                out[f"{prefix}bias"] = out.pop(f"{prefix}base_layer.bias")
            for key in [k for k in out if k.startswith(f"{prefix}lora_")]:  # adapters not active
                del out[key]
        elif isinstance(m, ModulesToSaveWrapper):
            prefix = f"{name}." if name else ""
            active = m.active_adapters[0]
            for key in [k for k in out if k.startswith(prefix)]:
                value = out.pop(key)
                rest = key[len(prefix):]
                if rest.startswith(f"modules_to_save.{active}."):
                    out[prefix + rest[len(f"modules_to_save.{active}."):]] = value
    return out


def save_adapter(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], out_dir: str | os.PathLike,
                 base: str | None = None) -> Path:
    """Write `model`'s adapter (and its `modules_to_save` heads) in peft's format: `adapter_config.json` and
    `adapter_model.safetensors`, loadable with `peft.PeftModel.from_pretrained(<base model>, out_dir)`.

    state_dict: the model's full state dict (e.g. a ZeRO-3 consolidated one); base: recorded as the config's
    `base_model_name_or_path` (where the base weights come from), or None. Returns `out_dir`.
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter = get_peft_model_state_dict(model, state_dict=state_dict)
    save_file({f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in adapter.items()},
              str(out / "adapter_model.safetensors"))
    config = model.peft_config["default"]
    config.base_model_name_or_path = base
    config.save_pretrained(str(out))
    return out

