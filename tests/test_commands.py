"""The command registry (`rlhf_cli/commands.py`): the one module of the package that names a command. A new
command is one registry entry, one stage module and one schema; no other module of the package changes."""

import ast
import json
import re
from pathlib import Path

import pytest

from rlhf_cli import commands
from rlhf_cli.runs import POINTER_PREFIX, pointer_target

PACKAGE = Path(__file__).resolve().parents[1] / "rlhf_cli"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that stand alone as statements (module, class, function and attribute
    docstrings): prose, not code."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else []:
            value = stmt.value if isinstance(stmt, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.add(id(value))
    return out


# a variable that holds a command, a config name or a run-dir kind, compared against a literal: a branch on a command
HOLDERS = {"command", "cmd", "config_name", "kind", "stage"}


def _holder(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in HOLDERS


def command_literals(text: str) -> list[tuple[int, str]]:
    """(line, literal) of each string in `text`'s code (docstrings and comments aside) that names a command of
    the registry: `rlhf <name>` anywhere, a name or config name spelt with `-` or `_` as a word, a literal equal
    to one (a name that is also a config section, `eval`, only in the first form), or any name, config name or
    run-dir kind compared with a variable that holds one (`command == "eval"`, `kind != "rm"`)."""
    sections = set(commands.config.RunConfig.__dataclass_fields__)
    words = [w for c in commands.COMMANDS.values() for w in (c.name, c.config_name) if "-" in w or "_" in w]
    pattern = re.compile("|".join([rf"rlhf {re.escape(c.name)}\b" for c in commands.COMMANDS.values()]
                                  + [rf"(?<![\w-]){re.escape(w)}(?![\w-])" for w in words]))
    exact = {w for c in commands.COMMANDS.values() for w in (c.name, c.config_name) if w not in sections}
    named = {w for c in commands.COMMANDS.values() for w in (c.name, c.config_name, c.kind)}
    tree = ast.parse(text)
    docs = _docstrings(tree)
    found = [(node.lineno, node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
             and (node.value in exact or pattern.search(node.value))]
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_holder(s) for s in sides):
                found += [(s.lineno, s.value) for s in sides if isinstance(s, ast.Constant) and s.value in named]
    return found


def test_no_module_but_the_registry_names_a_command():
    found = {f"{p.relative_to(PACKAGE)}:{line}: {value!r}"
             for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "commands.py"
             for line, value in command_literals(p.read_text())}
    assert found == set(), "read the command from rlhf_cli.commands instead"


def test_the_scan_finds_command_names_in_code_and_passes_prose():
    src = ('"""`rlhf train-rm` in a docstring is prose."""\n'
           'x = {"train_ppo": 1}\n'
           'def f(run_dir):\n'
           '    """train-ppo here too."""\n'
           '    return f"run `rlhf eval run_dir={run_dir}`", "split", "eval", "train-rm finished"\n'
           'if command == "eval" or cfg.kind != "rm" or split == "eval":\n'
           '    pass\n')
    found = command_literals(src)
    assert sorted(line for line, _ in found) == [2, 5, 5, 6, 6]
    assert {value for _, value in found} == {"train_ppo", "run `rlhf eval run_dir=", "train-rm finished", "eval", "rm"}


def test_the_registry_is_consistent():
    assert len(commands.COMMANDS) == len(commands._ALL)  # no name twice
    for field in ("name", "config_name", "stage", "kind"):
        values = [getattr(c, field) for c in commands._ALL]
        assert len(set(values)) == len(values), field
    pointers = [c.pointer for c in commands._ALL if c.pointer]
    assert len(set(pointers)) == len(pointers)
    assert all(p.startswith(POINTER_PREFIX) for p in pointers)  # runs.pointer_target reads only those
    conf = PACKAGE / "conf"
    for c in commands.COMMANDS.values():
        assert (conf / f"{c.config_name}.yaml").is_file()
        assert (PACKAGE.parent / (c.stage.replace(".", "/") + ".py")).is_file()
        text = (conf / f"{c.config_name}.yaml").read_text()
        assert f"${{paths.root}}/{c.kind}/" in text  # the YAML agrees
        assert "help:" not in text  # `rlhf <command> --help` is the registry's (cli.command_help), never Hydra's
        assert commands.by_config(c.config_name) is c and commands.by_kind(c.kind) is c
        assert commands.by_stage(c.stage) is c
        schema = set(commands.config.RunConfig.__dataclass_fields__) | {"experiment"}
        assert set(c.reads) <= schema, c.name
        assert c.section is None or c.section in c.reads
        for m in c.model_paths:
            assert m.key.split(".")[0] in c.reads
            commands.quote(m.hint, root=Path("runs"))  # every placeholder resolves
        for key, kind in c.defaults:
            assert key.split(".")[0] in c.reads and commands.by_kind(kind).pointer
    assert commands.reporter().kind == "eval"
    with pytest.raises(KeyError):
        commands.by_kind("nope")


TOY_STAGE = '''
"""A toy stage: writes a metric and a final/ model dir through the library, as every stage does."""
from rlhf_cli.commands import by_stage
from rlhf_cli.lifecycle import finish_run, prepare_run_dir
from rlhf_cli.runs import MetricsLogger

COMMAND = by_stage(__name__)


def run(cfg, run_dir):
    run_dir = prepare_run_dir(cfg, run_dir)
    logger = MetricsLogger(run_dir)
    logger.log(1, {"toy/loss": 0.25})
    logger.close()
    final = run_dir / "final"
    final.mkdir()
    finish_run(cfg, run_dir, final, COMMAND.kind, steps=1)
    return 0.25
'''


def test_a_new_command_is_one_entry_one_stage_module_and_one_schema(tmp_path, monkeypatch, capsys):
    """`rlhf train-toy` from a registry entry, a stage module and a primary config (registered in Hydra's
    ConfigStore here, a YAML in conf/ for a real command): help, key checks, validation, the run dir, its
    pointer, resume and the sweep report all follow, with no other module touched."""
    from hydra.core.config_store import ConfigStore

    from rlhf_cli import cli, config, overrides
    from rlhf_cli.errors import ConfigError
    from rlhf_cli.report.read import run_stage
    from rlhf_cli.report.sweep import headline_metrics
    from rlhf_cli.runs import read_pointer

    (tmp_path / "toy_stage.py").write_text(TOY_STAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    ConfigStore.instance().store(name="train_toy", node={
        "defaults": ["run_schema", {"model": "tiny"}, {"data": "builtin"}, {"deepspeed": "zero0"},
                     {"ppo": "default"}, "_self_", {"experiment": None}],
        "hydra": {"job": {"name": "train_toy", "chdir": False},
                  "run": {"dir": "${paths.root}/toy/${now:%Y%m%d-%H%M%S-%f}"}}})
    toy = commands.Command(
        name="train-toy", config_name="train_toy", stage="toy_stage", kind="toy", pointer="latest_toy",
        help="train a toy", reads=(*commands._COMMON, "rm", "logger", "tracker"), validator=config.validate_rm,
        trains=True, section="rm", headline=(("toy/loss", "loss", -1),), metric_prefixes=("toy/",))
    monkeypatch.setitem(commands.COMMANDS, toy.name, toy)

    assert "train-toy  train a toy" in cli.usage()
    assert "rm.lr=" in cli.command_help("train-toy") and "ppo.clip=" not in cli.command_help("train-toy")
    with pytest.raises(ConfigError, match=r"`rlhf train-toy` does not read ppo.clip"):
        overrides.check_override_keys("train_toy", ["ppo.clip=0.1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rm.lrr' for `rlhf train-toy`; did you mean 'rm.lr'"):
        overrides.check_override_keys("train_toy", ["rm.lrr=1"])

    root = tmp_path / "runs"
    monkeypatch.setattr("sys.argv", ["rlhf"])
    cli.main(["train-toy", f"paths.root={root}", "rm.lr=1e-4"])
    (run_dir,) = (root / "toy").iterdir()
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert read_pointer(root, "toy") == (run_dir / "final").resolve()
    assert (root / "latest_toy").is_file()
    assert run_stage(run_dir) == "toy" and headline_metrics("toy") == (("toy/loss", "loss", -1),)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # a finished run with no checkpoint: said in the command's words
        cli.main(["train-toy", f"paths.root={root}", f"resume={run_dir}"])
    assert exit_.value.code == 2
    assert "the run finished and its DeepSpeed checkpoint in ds/ is gone" in capsys.readouterr().err


def test_a_pointer_file_is_read_by_one_rule(tmp_path):
    """`runs.pointer_target`: a small `latest_*` text file names a path (which may be gone); anything else is no
    pointer, so a model file or a dir passed where a pointer may stand is never read as one."""
    final = tmp_path / "sft" / "A" / "final"
    final.mkdir(parents=True)
    (tmp_path / "latest_sft").write_text(f"{final}\n")
    assert pointer_target(tmp_path / "latest_sft") == final
    (tmp_path / "latest_gone").write_text(f"{tmp_path / 'nowhere'}\n")
    assert pointer_target(tmp_path / "latest_gone") == tmp_path / "nowhere"  # the caller says it is gone
    (tmp_path / "notes.txt").write_text(f"{final}\n")
    (tmp_path / "latest_big").write_text("x" * 5000)
    (tmp_path / "latest_bin").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "latest_empty").write_text("\n")
    for not_a_pointer in ("notes.txt", "latest_big", "latest_bin", "latest_empty", "sft", "missing"):
        assert pointer_target(tmp_path / not_a_pointer) is None, not_a_pointer
