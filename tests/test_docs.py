"""The docs' own rules: docs/results.md stays short, and every link into a doc names a heading that exists."""

import dataclasses
import re
import sys
from pathlib import Path

from rlhf_cli.commands import COMMANDS
from rlhf_cli.config import SupervisedConfig, field_docs

REPO = Path(__file__).resolve().parents[1]
RESULTS_MAX_LINES = 300
# a Markdown link to a repository doc with an anchor: [text](docs/results.md#the-anchor) or [text](#the-anchor)
DOC_LINK = re.compile(r"\]\(((?:docs/)?[\w.-]*\.md)?#([\w-]+)\)")


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    """The anchors of a Markdown file's headings (outside code fences), duplicates numbered as GitHub does."""
    seen, out, fenced = {}, set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path):
    """`(target, anchor)` of each anchored link in `path` whose target file has no such heading."""
    bad = []
    for target, anchor in DOC_LINK.findall(path.read_text()):
        file = path if not target else (path.parent / target)
        if not file.exists() or anchor not in anchors(file):
            bad.append((target or path.name, anchor))
    return bad


def test_results_md_holds_current_figures_only():
    lines = (REPO / "docs" / "results.md").read_text().splitlines()
    assert len(lines) <= RESULTS_MAX_LINES, (
        f"docs/results.md has {len(lines)} lines (at most {RESULTS_MAX_LINES}): keep each claim's current figure, "
        "the history lives in git")


def test_every_anchored_link_of_the_docs_names_a_heading():
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        assert broken_links(path) == [], path.name


def test_the_anchor_check_catches_a_missing_heading(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# Top\n\n## LoRA: PPO memory (`x=1`)\n\n```\n# not a heading\n```\n"
                   "[ok](#lora-ppo-memory-x1) [bad](#not-a-heading) [top](a.md#top)\n")
    assert anchors(doc) == {"top", "lora-ppo-memory-x1"}
    assert broken_links(doc) == [("a.md", "not-a-heading")]


MAX_WORDS = 80


def blocks(text):
    """The README's paragraphs and list items (outside code fences, tables, headings and HTML comments), each as
    one string: a list item runs until the next item, a blank line or a heading."""
    out, current, fenced = [], [], False

    def flush():
        if current:
            out.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            flush()
            fenced = not fenced
            continue
        stripped = line.strip()
        if fenced or not stripped or stripped.startswith(("|", "#", "<!--")):
            flush()
            continue
        if re.match(r"([-*]|\d+\.) ", stripped):
            flush()
        current.append(stripped)
    flush()
    return out


def test_no_readme_paragraph_or_list_item_is_over_80_words():
    long = [(len(b.split()), b[:70]) for b in blocks((REPO / "README.md").read_text()) if len(b.split()) > MAX_WORDS]
    assert long == [], f"split these (at most {MAX_WORDS} words each)"


def test_the_word_count_sees_paragraphs_and_list_items_not_code_or_tables():
    text = ("one two\nthree\n\n- a b\n  c\n- d\n```bash\n" + "x " * 100 + "\n```\n| " + "y " * 100 + "|\n"
            "# " + "z " * 100 + "\n")
    assert blocks(text) == ["one two three", "- a b c", "- d"]


def load_script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass's annotations resolve through its module
    spec.loader.exec_module(module)
    return module


def test_the_readmes_key_tables_equal_the_schemas_rendering():
    key_table = load_script("key_table")
    rendered = key_table.render()
    assert key_table.readme_block((REPO / "README.md").read_text()) == rendered, (
        "README.md's key tables are stale: run `python scripts/key_table.py --write`")
    shared = {f.name for f in dataclasses.fields(SupervisedConfig)}
    sections = [k.split(".")[0] for k in field_docs() if k.endswith(".lr") and k.split(".")[1] in shared]
    assert sections == ["sft", "rm", "dpo", "kto"]
    # the keys the supervised sections share, once, with each section's default; each section's own keys in its table
    head = "#### Supervised optimizer keys (`sft.*`, `rm.*`, `dpo.*`, `kto.*`): "
    assert head in rendered and rendered.index(head) < rendered.index("#### `sft`: ")
    assert "| `lr` | `2e-05` | `2e-05` | `5e-07` | `5e-07` | Peak learning rate (AdamW) |" in rendered
    assert "| `rm.lr` |" not in rendered and "| `rm.margin` | `false` |" in rendered
    keys = field_docs()
    leaves = [k for k in keys if not any(other.startswith(k + ".") for other in keys)]
    documented = [k for k in leaves if f"| `{k}` |" in rendered
                  or (k.split(".")[0] in sections and f"| `{k.split('.', 1)[1]}` |" in rendered)]
    assert documented == leaves and len(leaves) > 100  # every leaf key
    assert "| `ppo.clip` | `0.2` | ε, ratio clip of the surrogate, > 0 |" in rendered
    assert "| `model.arch` |" not in rendered  # no section rows


SAMPLE = '''# T

## How-to recipes

### First

```bash
rlhf train-rm a=1 \\
    b=2             # a comment
# a whole-line comment
X=1 rlhf eval 'w={a:1,b:2}'   # quoted braces
cat > hostfile <<'HOSTS'
node1 slots=8
HOSTS
echo "# not a comment"
```

```python
# my_rewards.py   rlhf train-ppo ...
def f(prompts, completions, **kw):
    return [0.0] * len(completions)
```

### Second

Text only.

## Reference

### Not a recipe

```bash
rlhf train-ppo
```
'''


def test_the_recipe_runner_extracts_each_recipes_commands_and_files():
    run_recipes = load_script("run_recipes")
    first, second = run_recipes.extract(SAMPLE)
    assert (first.title, second.title) == ("First", "Second")
    assert first.commands == ["rlhf train-rm a=1 b=2", "X=1 rlhf eval 'w={a:1,b:2}'",
                              "cat > hostfile <<'HOSTS'\nnode1 slots=8\nHOSTS", 'echo "# not a comment"']
    assert list(first.files) == ["my_rewards.py"] and "def f(" in first.files["my_rewards.py"]
    assert second.commands == [] and second.files == {}


def test_every_readme_recipe_is_run_or_skipped_with_a_reason():
    run_recipes = load_script("run_recipes")
    recipes = run_recipes.extract((REPO / "README.md").read_text())
    assert len(recipes) >= 8
    ran = 0
    for recipe in recipes:
        why, lines = run_recipes.plan(recipe)  # an unclassified recipe raises SystemExit
        assert why or lines, recipe.title
        for command, line_why in lines:
            assert why or line_why or command.split("rlhf ", 1)[1].split()[0] in COMMANDS, command
            ran += not why and not line_why
    assert ran >= 20  # most recipe lines run on a CPU
    titles = {r.title for r in recipes}
    assert set(run_recipes.SKIP_RECIPE) | run_recipes.RUN_RECIPE == titles, "a classified recipe left the README"


def test_the_runner_fills_placeholders_and_adds_smoke_settings(tmp_path):
    run_recipes = load_script("run_recipes")
    run = tmp_path / "runs" / "ppo" / "20260101-000000-1" / "final"
    run.mkdir(parents=True)
    (tmp_path / "runs" / "ppo" / "sweep-20260101").mkdir()
    assert run_recipes.fill("rlhf eval policy.path=runs/ppo/<run-id>", tmp_path) == (
        "rlhf eval policy.path=runs/ppo/20260101-000000-1")
    assert run_recipes.fill("rlhf eval policy.path=runs/ppo/sweep-<time>/<job>", tmp_path) == (
        "rlhf eval policy.path=runs/ppo/sweep-20260101/0")
    cmd = run_recipes.smoke("X=1 rlhf train-ppo ppo.clip=0.1", "py", tmp_path / "runs", "/rm/final")
    assert cmd == f"X=1 py -m rlhf_cli train-ppo ppo.clip=0.1 experiment=smoke paths.root={tmp_path}/runs " \
                  "reward_model.path=/rm/final"
    assert "experiment=smoke" not in run_recipes.smoke("rlhf train-rm --cfg job", "py", tmp_path, None)


def test_each_readme_recipe_is_at_most_20_lines():
    body = (REPO / "README.md").read_text().split("## How-to recipes", 1)[1].split("\n## ", 1)[0]
    long = {}
    for chunk in body.split("\n### ")[1:]:
        title, rest = chunk.split("\n", 1)
        lines = [ln for ln in rest.splitlines() if ln.strip()]  # blank lines aside
        if len(lines) > 20:
            long[title] = len(lines)
    assert long == {}, "a recipe is a block and a few lines; details go to the Reference"


def ignored_keys_table():
    """README's table of the keys a setting ignores, rendered from `rlhf_cli.overrides.IGNORED`."""
    from rlhf_cli.overrides import IGNORED

    rows = ["| key | does nothing with | instead |", "| --- | --- | --- |"]
    section = lambda key: key + (".*" if key in ("model.arch", "model.lora", "reward.judge") else "")  # noqa: E731
    rows += [f"| `{section(r.key)}` | {r.when} | {r.fix} |" for r in IGNORED]
    return "\n".join(rows)


def test_the_readmes_ignored_keys_table_equals_the_checks():
    text = (REPO / "README.md").read_text()
    begin = "<!-- ignored-keys: rendered from rlhf_cli.overrides.IGNORED; tests/test_docs.py checks it -->\n"
    block = text.split(begin, 1)[1].split("<!-- /ignored-keys -->", 1)[0].strip()
    assert block == ignored_keys_table(), f"README.md's ignored-keys table is stale; it should read:\n" \
                                          f"{ignored_keys_table()}"
