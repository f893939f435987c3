"""KL controllers against a plain-Python transcription of Ziegler et al. 2019 and hand-computed steps."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_cli.core import AdaptiveKLController, FixedKLController


def ref_adaptive(beta, target, horizon, updates):
    """lm-human-preferences' AdaptiveKLController.update, one (current_kl, n_steps) at a time."""
    for current_kl, n_steps in updates:
        proportional_error = min(max(current_kl / target - 1, -0.2), 0.2)
        beta *= 1 + proportional_error * n_steps / horizon
    return beta


def test_fixed_controller_never_changes():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        ctl.update(kl, 512)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_hand_computed():
    ctl = AdaptiveKLController(init_beta=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=6.0, n_steps=512)  # on target: error 0
    assert ctl.value == pytest.approx(0.1)
    ctl.update(current_kl=7.2, n_steps=512)  # error 7.2/6 - 1 = 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 512 / 10000))
    before = ctl.value
    ctl.update(current_kl=60.0, n_steps=1000)  # error 9 clipped to 0.2
    assert ctl.value == pytest.approx(before * 1.02)
    before = ctl.value
    ctl.update(current_kl=torch.tensor(3.0), n_steps=1000)  # error -0.5 clipped to -0.2; tensors accepted
    assert ctl.value == pytest.approx(before * 0.98)


def test_adaptive_controller_matches_reference_on_random_updates():
    rng = random.Random(0)
    updates = [(rng.uniform(0.0, 20.0), rng.randint(1, 1024)) for _ in range(200)]
    ctl = AdaptiveKLController(0.2, 6.0, 10000)
    for kl, n in updates:
        ctl.update(kl, n)
    assert ctl.value == pytest.approx(ref_adaptive(0.2, 6.0, 10000, updates), rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    updates=st.lists(st.tuples(st.floats(0.0, 100.0), st.integers(0, 4096)), min_size=1, max_size=20),
    split=st.integers(0, 20),
)
def test_adaptive_controller_resumes_from_state_dict(updates, split):
    straight = AdaptiveKLController(0.1, 6.0, 10000)
    for kl, n in updates:
        straight.update(kl, n)
    first = AdaptiveKLController(0.1, 6.0, 10000)
    for kl, n in updates[:split]:
        first.update(kl, n)
    resumed = AdaptiveKLController(0.1, 6.0, 10000)
    resumed.load_state_dict(first.state_dict())
    for kl, n in updates[split:]:
        resumed.update(kl, n)
    assert resumed.value == straight.value
    assert straight.value > 0


def test_adaptive_controller_moves_towards_target():
    high, low = AdaptiveKLController(0.1, 6.0, 100), AdaptiveKLController(0.1, 6.0, 100)
    high.update(12.0, 10)
    low.update(1.0, 10)
    assert high.value > 0.1 > low.value


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"init_beta": -0.1, "target": 6.0, "horizon": 10000}, "init_beta"),
        ({"init_beta": 0.1, "target": 0.0, "horizon": 10000}, "target"),
        ({"init_beta": 0.1, "target": 6.0, "horizon": 0}, "horizon"),
        ({"init_beta": math.nan, "target": 6.0, "horizon": 10000}, "init_beta"),
    ],
)
def test_adaptive_controller_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveKLController(**kwargs)


def test_controllers_reject_non_finite_kl_and_negative_beta():
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    with pytest.raises(ValueError, match="current_kl"):
        ctl.update(math.nan, 10)
    with pytest.raises(ValueError, match="n_steps"):
        ctl.update(1.0, -1)
    assert ctl.value == 0.1
    with pytest.raises(ValueError, match="beta"):
        FixedKLController(-1.0)


def test_adaptive_beta_is_floored_at_zero():
    ctl = AdaptiveKLController(0.1, 6.0, horizon=1)
    ctl.update(0.0, n_steps=10)  # 1 - 0.2 * 10 < 0
    assert ctl.value == 0.0
