"""One vocabulary: every config key is documented once (in config.py), and the docs name only keys that exist."""

import importlib
import re
from pathlib import Path

from rlhf_cli.config import field_docs

REPO = Path(__file__).resolve().parents[1]
SECTIONS = "ppo|rm|data|model|eval|paths|deepspeed|reward|reward_model|reference|policy|tracker|rollout"
# a key as the docs quote it: `ppo.clip` or `ppo.clip=0.1` (a file name such as `eval.json` is not a key)
QUOTED_KEY = re.compile(rf"`((?:{SECTIONS})\.[a-z_][a-z_0-9.]*[a-z_0-9])(?:=[^`]*)?`")


def names_code(key):
    """Whether a quoted `rollout.update_order` names the package's code, not a key (the `rollout/` package shares
    the `rollout` section's name): the longest importable `rlhf_cli.<prefix>` module, then its attributes."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("rlhf_cli." + ".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_config_key_has_a_description():
    docs = field_docs()
    assert len(docs) > 100 and docs["ppo.clip"].startswith("ε, ratio clip")
    assert docs["model.arch.hidden_size"]  # nested groups too
    assert [key for key, doc in docs.items() if not doc] == []


def quoted_keys(text):
    return {m.group(1) for m in QUOTED_KEY.finditer(text) if not m.group(1).endswith((".json", ".yaml"))}


def test_docs_and_docstrings_quote_only_keys_that_exist():
    keys = set(field_docs())
    files = [*REPO.glob("rlhf_cli/**/*.py"), *REPO.glob("*.md"), *REPO.glob("docs/*.md"), *REPO.glob("benchmarks/*.py")]
    unknown = {}
    for f in files:
        for key in quoted_keys(f.read_text()):
            known = (key in keys or any(k.startswith(key + ".") for k in keys) or key.startswith("deepspeed.extra.")
                     or names_code(key))
            if not known:
                unknown.setdefault(key, []).append(str(f.relative_to(REPO)))
    assert unknown == {}, "keys that do not exist (TRL's names? a rename?)"


def test_the_vocabulary_check_catches_the_names_of_other_libraries():
    text = "set `ppo.clip_range=0.1` or `ppo.vf_coef`; `eval.json` is a file; `ppo.clip` and `ppo.lam=0.9` exist"
    assert quoted_keys(text) == {"ppo.clip_range", "ppo.vf_coef", "ppo.clip", "ppo.lam"}
    assert {"ppo.clip_range", "ppo.vf_coef"}.isdisjoint(field_docs())
    assert names_code("rollout.update_order") and names_code("rollout.plan.packs_rollout_passes")
    assert not names_code("rollout.engin") and not names_code("ppo.clip_range")
