"""The package's layers, checked over the AST of every module (function-local imports included).

A module may import the package's modules of a LOWER layer, and of its own unit (a package such as
`models/`, or the module itself); never of its own layer's other units or of a higher layer:

    0  core/  errors.py  seeds.py  eos.py  registry.py
                                       (core/: torch, the standard library and registry.py only;
                                        errors.py, eos.py, registry.py: stdlib only)
    1  config.py                       (third-party: hydra and omegaconf only)
    2  commands.py                     (the command registry: data naming each command's pieces)
    3  runs.py  overrides.py            (overrides.py: the command line's keys and Hydra's errors)
    4  engine.py  data/  models/  rewards.py  reward_http.py  verifiers.py  lineage.py
                                       (engine.py: the only module that imports deepspeed)
    5  forwards/  reward_judge.py       (the model forwards every stage uses: log-probs, values, scores, pairs;
                                        reward_judge.py: the LLM judge, beside reward_http.py's pieces)
    6  preflight.py  lifecycle.py  rollout/  report/
                                       (rollout/maker.py imports nothing of rollout/learner.py;
                                        rollout/vllm_engine.py: the only module that imports vllm)
    7  stages/                         (a stage imports `stages/common.py`, never another stage)
    8  cli.py                          (it loads a stage by name at run time: no module but a stage
                                        imports a stage, so `rlhf --help` stays light)
    9  __main__.py

docs/architecture.md draws the same table. A new rule that today's code breaks needs the code fixed in the
same change: there is no allow-list.
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


LAYERS = {
    "core": 0, "errors": 0, "seeds": 0, "eos": 0, "registry": 0,
    "config": 1,
    "commands": 2,
    "runs": 3, "overrides": 3,
    "engine": 4, "data": 4, "models": 4, "rewards": 4, "reward_http": 4, "verifiers": 4, "lineage": 4,
    "forwards": 5, "reward_judge": 5,
    "preflight": 6, "lifecycle": 6, "rollout": 6, "report": 6,
    "stages": 7,
    "cli": 8, "__init__": 8,
    "__main__": 9,
}


def unit(module: str) -> str:
    """The unit of a dotted name inside the package: `rlhf_cli.models.scalar` -> `models`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def violation(rel: str, name: str) -> bool:
    top = name.split(".")[0]
    stdlib = top in sys.stdlib_module_names or top == "__future__"
    here = unit("rlhf_cli." + rel.removesuffix(".py").replace("/", "."))
    if here == "core":  # and the loss families' declared choices, a torch-free unit of its own layer
        return not (stdlib or top == "torch" or name.startswith("rlhf_cli.core") or name == "rlhf_cli.registry")
    if here in ("errors", "eos", "registry") and not stdlib:
        return True
    if here == "config" and not (stdlib or top in ("hydra", "omegaconf", "rlhf_cli")):
        return True
    if top == "deepspeed":
        return here != "engine"
    if top == "vllm":  # an optional install behind one seam (STYLE.md 15)
        return rel != "rollout/vllm_engine.py"
    if rel == "rollout/maker.py" and name.startswith("rlhf_cli.rollout.learner"):
        return True  # the rollout meets the update in the plan its experience carries (rollout/plan.py)
    if top != "rlhf_cli" or name == "rlhf_cli":
        return False
    there = unit(name)
    if there == "stages":  # only a stage imports stages/: common, never another stage
        other = name.split(".")[2] if name.count(".") >= 2 else "common"
        return here != "stages" or other not in ("common", Path(rel).stem)
    return there != here and LAYERS[there] >= LAYERS[here]


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
    assert not violation("core/losses.py", "rlhf_cli.registry") and violation("core/losses.py", "rlhf_cli.errors")
    assert violation("registry.py", "torch") and not violation("config.py", "rlhf_cli.registry")
    assert violation("models/loading.py", "deepspeed") and not violation("engine.py", "deepspeed.zero")
    assert violation("stages/ppo.py", "rlhf_cli.stages.rm") and not violation("stages/ppo.py", "rlhf_cli.stages.common")
    assert violation("config.py", "rlhf_cli.runs") and not violation("config.py", "rlhf_cli.errors")
    assert violation("config.py", "torch") and not violation("config.py", "omegaconf")
    assert violation("data/collate.py", "rlhf_cli.rollout") and violation("data/datasets.py", "rlhf_cli.models")
    assert not violation("data/collate.py", "rlhf_cli.seeds")
    assert not violation("models/scalar.py", "rlhf_cli.models.loading")
    assert violation("engine.py", "rlhf_cli.lifecycle") and not violation("lifecycle.py", "rlhf_cli.engine")
    assert violation("errors.py", "rlhf_cli.config") and not violation("errors.py", "typing")
    assert violation("eos.py", "torch") and not violation("data/tokenize.py", "rlhf_cli.eos")
    assert violation("rollout/maker.py", "rlhf_cli.rollout.learner")
    assert not violation("rollout/maker.py", "rlhf_cli.rollout.plan")
    assert not violation("stages/ppo.py", "rlhf_cli.rollout.learner")
    assert violation("lifecycle.py", "rlhf_cli.stages.common") and violation("cli.py", "rlhf_cli.stages.ppo")
    assert (violation("rollout/maker.py", "rlhf_cli.stages.common")
            and not violation("rollout/maker.py", "rlhf_cli.core"))
    assert violation("forwards/policy.py", "rlhf_cli.rollout") and violation("models/policy.py", "rlhf_cli.forwards")
    assert not violation("rollout/maker.py", "rlhf_cli.forwards.policy")
    assert not violation("stages/rm.py", "rlhf_cli.forwards")
    assert violation("rollout/generation.py", "vllm") and not violation("rollout/vllm_engine.py", "vllm.config")


def test_every_module_imports():
    """A move that leaves a stale import breaks only the command that loads the module (stages load by
    name at run time): import them all here, cheaply, so the fast tests catch it."""
    import importlib
    import pkgutil

    import rlhf_cli

    names = [m.name for m in pkgutil.walk_packages(rlhf_cli.__path__, "rlhf_cli.")]
    assert {"rlhf_cli.stages.evaluate", "rlhf_cli.forwards.policy", "rlhf_cli.lifecycle"} <= set(names)
    for name in names:
        importlib.import_module(name)


def test_no_rollout_module_imports_one_that_imports_it():
    """The rollout modules import one another without a circle (function-local imports included): the engine
    seam (`generation.py`) imports no engine, the registry (`engines.py`) imports the engines."""
    rollout = PACKAGE / "rollout"
    graph = {f"rlhf_cli.rollout.{p.stem}": {n for n in imports(p) if n.startswith("rlhf_cli.rollout.")}
             for p in rollout.glob("*.py") if p.stem != "__init__"}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ()))

    circles = sorted(m for m in graph if reaches(m, m))
    assert circles == [], "rollout modules on an import circle"
    assert "rlhf_cli.rollout.vllm_engine" not in graph["rlhf_cli.rollout.generation"]
