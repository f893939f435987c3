"""The loss families' registry (`rlhf_cli/registry.py`): every declared choice has exactly one implementation in
`core/` and every implementation a declaration, in the declared order, which is the order the config checks and
lists them in; the declarations load without torch."""

import subprocess
import sys

import pytest

from rlhf_cli import config, core, registry
from rlhf_cli.errors import ConfigError

# each family -> the table `core/` binds it in (a new family is added here, and its test below follows)
BOUND = {"ppo.advantage_estimator": core.ESTIMATORS, "ppo.policy_loss": core.POLICY_LOSSES,
         "dpo.loss": core.DPO_LOSSES, "ppo.kl_estimator": core.ops.KL_ESTIMATORS}


def test_every_family_is_bound_in_core_once_per_choice_in_the_declared_order():
    assert [f.key for f in registry.FAMILIES] == list(BOUND)
    for family in registry.FAMILIES:
        table = BOUND[family.key]
        assert list(table) == list(family.names), family.key
        functions = [getattr(v, "fn", v) for v in table.values()]
        assert len({id(f) for f in functions}) == len(functions), f"{family.key}: one function bound twice"


def test_the_declared_metadata():
    est = registry.ADVANTAGE_ESTIMATORS
    assert [n for n in est if est[n].needs_critic] == ["gae"]
    assert [n for n in est if est[n].min_group_size == 2] == ["grpo", "dr_grpo", "rloo"]
    assert [n for n in est if est[n].whiten] == ["gae", "reinforce_pp"]
    assert [n for n in registry.DPO_LOSSES if registry.DPO_LOSSES[n].per_token] == ["ipo"]


def test_bind_refuses_a_missing_or_an_undeclared_implementation():
    family = registry.Registry("x.loss", registry.Choice("a"), registry.Choice("b"))
    f = lambda: None  # noqa: E731
    assert family.bind({"b": f, "a": f}) == {"a": f, "b": f} and list(family.bind({"b": f, "a": f})) == ["a", "b"]
    with pytest.raises(ValueError, match=r"x.loss: declared .* without an implementation: \['b'\]; .*: \[\]"):
        family.bind({"a": f})
    with pytest.raises(ValueError, match=r"implemented but not declared there: \['c'\]"):
        family.bind({"a": f, "b": f, "c": f})
    with pytest.raises(ValueError, match="declared twice"):
        registry.Registry("x.loss", registry.Choice("a"), registry.Choice("a"))


@pytest.mark.parametrize("key,value,choices", [
    ("ppo.advantage_estimator", "ppo", "gae, grpo, dr_grpo, rloo, reinforce_pp, distill"),
    ("ppo.policy_loss", "grpo", "ppo, gspo, cispo"),
    ("dpo.loss", "kto", "sigmoid, ipo, hinge"),
    ("ppo.kl_estimator", "k4", "k1, k2, k3"),
])
def test_the_config_lists_the_declared_choices_in_order(key, value, choices):
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(config.RunConfig)
    OmegaConf.update(cfg, key, value)
    validate = config.validate_dpo if key.startswith("dpo.") else config.validate_ppo
    with pytest.raises(ConfigError, match=f"^{key}='{value}' is not one of {choices}$"):
        validate(cfg)


def test_the_declarations_and_the_config_load_without_torch():
    code = "import sys, rlhf_cli.config, rlhf_cli.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
