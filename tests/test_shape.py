"""The stages' shape (issue 39, Part B): every function in `rlhf_cli/stages/` and `rlhf_cli/rollout/` is at most
`MAX_LINES` lines, from its `def` to its last line (docstring included; a nested function counts in its parent and
on its own), so that a stage reads as named steps and no step hides a second one inside it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlhf_cli"
MAX_LINES = 60


def long_functions(path: Path, limit: int = MAX_LINES, text: str | None = None) -> list[str]:
    """`file:line name (N lines)` of each function or method of `path` (its text: `text`) over `limit` lines."""
    tree = ast.parse(path.read_text() if text is None else text, filename=str(path))
    return [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_the_check_finds_a_long_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))  # the def line and 60 more: 61 lines
    short = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1))
    src = f"def long():\n{body}\nclass C:\n    def fits(self):\n{short.replace('    ', '        ')}"
    assert long_functions(PACKAGE / "stages" / "rm.py", text=src) == ["stages/rm.py:1 long (61 lines)"]


def test_no_function_in_stages_or_rollout_is_over_60_lines():
    found = [hit for folder in ("stages", "rollout") for path in sorted((PACKAGE / folder).rglob("*.py"))
             for hit in long_functions(path)]
    assert not found, "functions over 60 lines (split them into named steps):\n" + "\n".join(found)
