"""The docs' own rules: docs/results.md stays short, and every link into a doc names a heading that exists."""

import re
from pathlib import Path

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
    spec.loader.exec_module(module)
    return module


def test_the_readmes_key_tables_equal_the_schemas_rendering():
    key_table = load_script("key_table")
    rendered = key_table.render()
    assert key_table.readme_block((REPO / "README.md").read_text()) == rendered, (
        "README.md's key tables are stale: run `python scripts/key_table.py --write`")
    from rlhf_cli.config import field_docs

    leaves = [k for k in field_docs() if f"| `{k}` |" in rendered]
    assert "| `ppo.clip` | `0.2` | ε, ratio clip of the surrogate, > 0 |" in rendered
    assert len(leaves) > 100 and "| `model.arch` |" not in rendered  # every leaf key, no section rows
