"""The advantage-estimator registry (`core/estimators.py`): one signature, the config's list in step with it."""

import pytest
import torch

from rlhf_cli import config
from rlhf_cli.core import ESTIMATORS, compute_gae
from rlhf_cli.core.estimators import register


def rollout(seed=0, B=4, T=7):
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lengths = torch.tensor([7, 3, 1, 5])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return rewards, values, mask


def test_the_config_offers_exactly_the_registered_estimators():
    assert set(config.ESTIMATORS) == set(ESTIMATORS)
    assert config.PPOConfig().estimator in ESTIMATORS


def test_gae_entry_is_compute_gae_and_needs_the_critic():
    rewards, values, mask = rollout()
    adv, ret = ESTIMATORS["gae"](rewards, mask, values=values, gamma=0.9, lam=0.8)
    want_adv, want_ret = compute_gae(rewards, values, mask, 0.9, 0.8)
    assert torch.equal(adv, want_adv) and torch.equal(ret, want_ret)
    assert ESTIMATORS["gae"].needs_critic
    with pytest.raises(ValueError, match="'gae' needs the critic's values"):
        ESTIMATORS["gae"](rewards, mask, values=None, gamma=1.0, lam=1.0)


def test_a_registered_estimator_is_called_through_the_one_signature(monkeypatch):
    monkeypatch.setattr("rlhf_cli.core.estimators.ESTIMATORS", dict(ESTIMATORS))
    from rlhf_cli.core import estimators

    seen = {}

    @register("sum_to_go", needs_critic=False)
    def sum_to_go(rewards, mask, *, values, gamma, lam):
        seen.update(values=values, gamma=gamma, lam=lam)
        adv = (rewards * mask).flip(1).cumsum(1).flip(1) * mask
        return adv, adv

    rewards, _, mask = rollout(1)
    adv, _ = estimators.ESTIMATORS["sum_to_go"](rewards, mask, values=None, gamma=1.0, lam=0.5)
    assert seen == {"values": None, "gamma": 1.0, "lam": 0.5}
    assert torch.allclose(adv[1, 0], rewards[1, :3].sum()) and adv[1, 3:].abs().sum() == 0
    assert "sum_to_go" not in ESTIMATORS  # the module's table was a copy for this test
    with pytest.raises(ValueError, match="already registered"):
        register("gae", needs_critic=True)(sum_to_go)
