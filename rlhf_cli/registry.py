"""The loss families' registry: every choice of a family of losses or estimators, declared once, in order.

A family is the set of values one config key takes (`ppo.advantage_estimator`, `ppo.policy_loss`, `dpo.loss`,
`ppo.kl_estimator`).
Its choices are declared here, each with its name and the metadata its callers read, without torch, so that
`config.py` checks a value and `rlhf --help` lists the choices without loading a model library. `core/` writes
one function per choice and binds them by name (`Registry.bind`), which fails at import time unless every
declared choice has exactly one implementation and every implementation a declaration:

    # here: the choice and what its callers read of it
    POLICY_LOSSES = Registry("ppo.policy_loss", Choice("ppo"), Choice("gspo"), Choice("cispo"))
    # core/losses.py: the functions, by name
    POLICY_LOSSES = registry.POLICY_LOSSES.bind({"ppo": policy_loss, "gspo": gspo_loss, "cispo": cispo_loss})

The order of the declarations is the order `config.py`'s errors and the docs list the choices in.
(`commands.py` is the command registry; this one holds no command.) The standard library only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

C = TypeVar("C", bound="Choice")
F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Choice:
    """One choice of a family: `name` is the config value that selects it. A family with metadata declares its
    own subclass (`EstimatorChoice`), whose fields its callers read."""

    name: str


@dataclass(frozen=True)
class EstimatorChoice(Choice):
    """An advantage estimator (`ppo.advantage_estimator`, `core/estimators.py`).

    needs_critic: reads a learned critic's values (train-ppo builds and trains a critic only then).
    min_group_size: the fewest samples per prompt it is defined for (`ppo.n_samples_per_prompt`; `preflight`).
    whiten: whether its advantages are whitened over the rollout by default (`ppo.whiten_advantages=null`).
    """

    needs_critic: bool = False
    min_group_size: int = 1
    whiten: bool = True


@dataclass(frozen=True)
class DPOChoice(Choice):
    """A direct preference loss (`dpo.loss`, `core/dpo.py`).

    per_token: its log-ratio gap is taken between per-token log-ratios (each response's log-ratio divided by its
    token count, IPO's form in TRL), not between sums.
    """

    per_token: bool = False


class Registry(Generic[C]):
    """One family: the values of the config key `key`, declared in order. Iterating it gives the names;
    `registry[name]` the declared `Choice`."""

    def __init__(self, key: str, *choices: C) -> None:
        self.key = key
        self._choices = {c.name: c for c in choices}
        if len(self._choices) != len(choices):
            raise ValueError(f"{key}: a name is declared twice ({', '.join(c.name for c in choices)})")

    @property
    def names(self) -> tuple[str, ...]:
        """The names in declared order: the choices `config.py` accepts and lists in its errors."""
        return tuple(self._choices)

    def __getitem__(self, name: str) -> C:
        return self._choices[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._choices)

    def __len__(self) -> int:
        return len(self._choices)

    def __contains__(self, name: object) -> bool:
        return name in self._choices

    def bind(self, implementations: dict[str, F]) -> dict[str, F]:
        """{name: implementation} in declared order, from `core/`'s functions by name. Raises ValueError naming
        the choices declared without an implementation and the implementations no choice declares."""
        missing = [n for n in self._choices if n not in implementations]
        unknown = [n for n in implementations if n not in self._choices]
        if missing or unknown:
            raise ValueError(f"{self.key}: declared in rlhf_cli/registry.py without an implementation: {missing}; "
                             f"implemented but not declared there: {unknown}")
        return {n: implementations[n] for n in self._choices}


ADVANTAGE_ESTIMATORS: Registry[EstimatorChoice] = Registry(
    "ppo.advantage_estimator",
    EstimatorChoice("gae", needs_critic=True),
    EstimatorChoice("grpo", min_group_size=2, whiten=False),
    EstimatorChoice("dr_grpo", min_group_size=2, whiten=False),
    EstimatorChoice("rloo", min_group_size=2, whiten=False),
    EstimatorChoice("reinforce_pp"),
    EstimatorChoice("distill", whiten=False),
)
"""`core.ESTIMATORS`' declarations: GAE against a learned critic, then the critic-free group baselines, then
on-policy distillation's per-token reverse KL (`reward.type=teacher`)."""

POLICY_LOSSES: Registry[Choice] = Registry("ppo.policy_loss", Choice("ppo"), Choice("gspo"), Choice("cispo"))
"""`core.POLICY_LOSSES`' declarations: PPO's clipped surrogate, GSPO's sequence ratio, CISPO's capped weight."""

DPO_LOSSES: Registry[DPOChoice] = Registry(
    "dpo.loss", DPOChoice("sigmoid"), DPOChoice("ipo", per_token=True), DPOChoice("hinge"))
"""`core.DPO_LOSSES`' declarations: DPO's sigmoid, IPO's square (per token), SLiC's hinge."""

KL_ESTIMATORS: Registry[Choice] = Registry("ppo.kl_estimator", Choice("k1"), Choice("k2"), Choice("k3"))
"""`core.ops.KL_ESTIMATORS`' declarations: Schulman's per-token estimators of KL(π ‖ π_ref)."""

FAMILIES: tuple[Registry, ...] = (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, DPO_LOSSES, KL_ESTIMATORS)
"""Every family, for the test that each is bound in `core/` exactly once."""


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A package's module `__getattr__` (PEP 562) that imports each exported name from its submodule on first use
    (`where`: {name: submodule of `package`}), so that importing one torch-free submodule of a package (the
    preflight checks before a command runs) does not import the package's torch-heavy ones."""

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return __getattr__
