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
