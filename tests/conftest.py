import os

import pytest
import torch

# DeepSpeed's CPU accelerator where no GPU is visible; a GPU machine keeps its CUDA one, so that the tests of
# precision run there on the GPU (benchmarks/gpu_check.sh)
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
from stage_helpers import (  # noqa: E402,F401  (tests/ is on sys.path)
    HH_PATH,
    REPO,
    SMOLLM2,
    TINY_TOKENIZER,
    compose,
    require,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

@pytest.fixture(scope="session")
def hh_path() -> str:
    require(os.path.isfile(HH_PATH), f"HH data not found at {HH_PATH}")
    return HH_PATH


@pytest.fixture(scope="session")
def tiny_model_cfg():
    from omegaconf import OmegaConf

    from rlhf_cli.config import ModelConfig

    cfg = OmegaConf.structured(ModelConfig)
    cfg.merge_with(OmegaConf.load(os.path.join(REPO, "conf", "model", "tiny.yaml")))
    if TINY_TOKENIZER:
        cfg.tokenizer = TINY_TOKENIZER
    return cfg


@pytest.fixture(scope="session")
def smollm2_model_cfg():
    from omegaconf import OmegaConf

    from rlhf_cli.config import ModelConfig

    cfg = OmegaConf.structured(ModelConfig)
    cfg.merge_with(OmegaConf.load(os.path.join(REPO, "conf", "model", "smollm2.yaml")))
    return cfg


@pytest.fixture(scope="session")
def tokenizer(tiny_model_cfg):
    """The SmolLM2 tokenizer (pad = <|endoftext|>, id 0; eos = <|im_end|>, id 2)."""
    from rlhf_cli.models.loading import ModelSourceError, load_tokenizer

    try:
        return load_tokenizer(tiny_model_cfg)
    except ModelSourceError as e:
        require(False, str(e))


@pytest.fixture(scope="module")
def tiny_causal(tiny_model_cfg, tokenizer):
    """A fresh seeded tiny causal LM (float32, eval mode)."""
    from rlhf_cli.models import load_causal_lm

    return load_causal_lm(tiny_model_cfg, seed=0, tokenizer=tokenizer).eval()


SMOKE = ["model=tiny", "precision=fp32"]


@pytest.fixture
def run_stage(tmp_path):
    """Run a stage in-process: run_stage("train_rm", [overrides]) -> (result, run_dir, cfg)."""
    import importlib

    from rlhf_cli.commands import by_config
    from rlhf_cli.preflight import VALIDATORS

    counter = {"n": 0}

    def _run(command, overrides=(), run_dir=None, root=None):
        counter["n"] += 1
        root = root or tmp_path / "runs"
        cfg = compose(command, [*SMOKE, f"paths.root={root}", *overrides])
        VALIDATORS[command](cfg)
        entry = by_config(command)
        run_dir = run_dir or root / entry.kind / f"run{counter['n']}"
        result = importlib.import_module(entry.stage).run(cfg, run_dir)
        return result, run_dir, cfg

    return _run
