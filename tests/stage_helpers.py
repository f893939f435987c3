"""Helpers shared by test modules (importable as `stage_helpers`; conftest names are ambiguous)."""


def compose(command: str, overrides=()):
    """The composed, typed config of `rlhf <command> overrides...` (no Hydra run dir made)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from rlhf_cli.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="rlhf_cli.conf", version_base="1.3"):
        return hydra_compose(config_name=command, overrides=list(overrides))
