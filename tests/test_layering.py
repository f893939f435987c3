"""The package's layers, checked over the AST of every module (function-local imports included).

    core/       torch and the standard library only (and core itself)
    errors.py   the standard library only: every layer raises its errors
    config.py   the package's errors only
    engine.py   the only module that imports deepspeed
    stages/     no stage imports another stage, and only cli.py (by name, at run time) imports a stage:
                rollout/, lifecycle.py and every other module are below the stages

A new rule that today's code breaks needs the code fixed in the same change: there is no allow-list.
"""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlhf_cli"

def imports(path: Path, text: str = None):
    """Absolute names of every module `path` imports, at any depth (relative imports resolved); `text`
    stands in for the file's contents."""
    tree = ast.parse(path.read_text() if text is None else text, filename=str(path))
    parts = ("rlhf_cli", *path.relative_to(PACKAGE).with_suffix("").parts)
    package = parts[:-1]  # the package a relative import starts from (for __init__.py: itself)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            yield module
            for alias in node.names:  # `from rlhf_cli import engine`: a submodule, not a name
                sub = PACKAGE.parent.joinpath(*f"{module}.{alias.name}".split("."))
                if sub.with_suffix(".py").is_file() or sub.is_dir():
                    yield f"{module}.{alias.name}"


def violation(rel: str, name: str) -> bool:
    top = name.split(".")[0]
    ours = top == "rlhf_cli"
    stdlib = top in sys.stdlib_module_names or top == "__future__"
    if rel.startswith("core/"):
        return not (stdlib or top == "torch" or name.startswith("rlhf_cli.core"))
    if rel == "errors.py":
        return not stdlib
    if rel == "config.py" and ours:
        return name not in ("rlhf_cli.errors", "rlhf_cli")
    if top == "deepspeed":
        return rel != "engine.py"
    if name.startswith("rlhf_cli.stages") and not rel.startswith("stages/"):
        return True
    if rel.startswith("stages/") and name.startswith("rlhf_cli.stages."):
        other = name.split(".")[2]
        return other != "common" and other != Path(rel).stem
    return False


def test_layers_import_only_what_they_may():
    found = {(str(p.relative_to(PACKAGE)), name) for p in sorted(PACKAGE.rglob("*.py")) for name in imports(p)
             if violation(str(p.relative_to(PACKAGE)), name)}
    assert found == set(), "imports across layers (see this file's docstring)"


def test_imports_are_found_at_any_depth_and_resolved():
    src = ("from . import engine\nfrom ..stages import rm\nimport deepspeed.zero\n"
           "def f():\n    from rlhf_cli import runs\n    from .models import checkpoint\n")
    found = set(imports(PACKAGE / "stages" / "ppo.py", src))
    assert {"rlhf_cli.stages", "rlhf_cli.stages.rm", "deepspeed.zero", "rlhf_cli.runs"} <= found
    assert "rlhf_cli.stages.engine" not in found  # `from . import engine` in stages/: no such module there
    found = set(imports(PACKAGE / "config.py", src))
    assert {"rlhf_cli.engine", "rlhf_cli.runs", "rlhf_cli.models.checkpoint"} <= found
    assert any(violation("config.py", n) for n in found) and violation("stages/ppo.py", "rlhf_cli.stages.rm")


def test_the_rules_catch_what_they_should():
    assert violation("core/ops.py", "numpy") and violation("core/ops.py", "rlhf_cli.engine")
    assert not violation("core/ops.py", "torch.nn.functional") and not violation("core/ops.py", "math")
    assert violation("models/loading.py", "deepspeed") and not violation("engine.py", "deepspeed.zero")
    assert violation("stages/ppo.py", "rlhf_cli.stages.rm") and not violation("stages/ppo.py", "rlhf_cli.stages.common")
    assert violation("config.py", "rlhf_cli.runs") and not violation("config.py", "rlhf_cli.errors")
    assert violation("errors.py", "rlhf_cli.config") and not violation("errors.py", "typing")
    assert violation("lifecycle.py", "rlhf_cli.stages.common") and violation("cli.py", "rlhf_cli.stages.ppo")
    assert (violation("rollout/policy.py", "rlhf_cli.stages.common")
            and not violation("rollout/policy.py", "rlhf_cli.core"))


def test_every_module_imports():
    """A move that leaves a stale import breaks only the command that loads the module (stages load by
    name at run time): import them all here, cheaply, so the fast tests catch it."""
    import importlib
    import pkgutil

    import rlhf_cli

    names = [m.name for m in pkgutil.walk_packages(rlhf_cli.__path__, "rlhf_cli.")]
    assert {"rlhf_cli.stages.evaluate", "rlhf_cli.rollout.policy", "rlhf_cli.lifecycle"} <= set(names)
    for name in names:
        importlib.import_module(name)
