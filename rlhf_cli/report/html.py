"""Self-contained HTML pages: sections of text, tables and inline PNGs; no network, no JavaScript."""

from __future__ import annotations

import base64
import html
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_cli.report.read import is_num
from rlhf_cli.runs import atomic_write_text


def fmt(value: Any) -> str:
    """A table cell as text: floats to 4 significant digits, None as `–`, `Messages` a line per part."""
    if value is None:
        return "–"
    if isinstance(value, Messages):
        return "\n".join(f"{label}{text}" for kind, label, text in value.parts())
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)



@dataclass(frozen=True)
class Messages:
    """A table cell holding an episode's messages after its prompt (`rlhf eval` with `rollout.env`: TRL's
    conversational form, `rollout.episodes.Conversation.completion`), drawn as blocks: the policy's words plain, its
    tool calls, the tools' results and the environment's replies each set apart by a label and a style."""

    messages: list[dict[str, Any]]

    def parts(self) -> list[tuple[str, str, str]]:
        """(kind, label, text) per block: kind `say` (the assistant's text), `call` (one tool call, as
        `name({arguments})`), `tool` (a result) or `env` (a user turn: the environment's reply)."""
        out = []
        for m in self.messages:
            role, content = m.get("role"), str(m.get("content") or "")
            if role == "assistant":
                if content:
                    out.append(("say", "", content))
                for call in m.get("tool_calls") or []:
                    fn = call.get("function", {})
                    out.append(("call", "tool call: ", f"{fn.get('name')}({json.dumps(fn.get('arguments'))})"))
            elif role == "tool":
                out.append(("tool", f"{m.get('name') or 'tool'} returned: ", content))
            else:
                out.append(("env", "environment: ", content))
        return out


@dataclass
class Table:
    """A table of a report section; cells are raw values, formatted with `fmt`."""

    columns: list[str]
    rows: list[list[Any]]
    caption: str = ""
    widths: list[str] | None = None
    """CSS widths of the columns (e.g. `["25%", "6em", ...]`): the table then takes the page's width and its
    text cells wrap, so long texts (samples) never widen the page. None: columns as wide as their content,
    the table scrolling sideways inside its own box when wider than the page (a sweep's summary)."""
    marked: int | None = None
    """Index of a row drawn highlighted (the best job of a sweep)."""


@dataclass
class Section:
    """One `<h2>` part of a report page, drawn in this order: alert, text, tables, images."""

    title: str
    text: str = ""
    """Plain text (escaped); a blank line starts a new paragraph."""
    tables: list[Table] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)
    """PNG files; embedded as data URIs, and copied beside the HTML when they live elsewhere."""
    captions: list[str] = field(default_factory=list)
    """One line under each image, in `images` order (none when shorter)."""
    collapsed: bool = False
    """Fold the section behind a `<details>` toggle (long config dumps)."""
    alert: str = ""
    """A paragraph drawn in a red box above the text (the reward-hacking warning)."""


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; overflow-wrap: anywhere; } h2 { font-size: 1.2em; margin-top: 2em;
  border-bottom: 1px solid #ddd; overflow-wrap: anywhere; }
p { max-width: 60em; line-height: 1.45; overflow-wrap: anywhere; }
p.alert { border: 2px solid #c62828; background: #fdecea; padding: 0.6em 0.9em; font-weight: 600; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.85em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
td { overflow-wrap: anywhere; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.wrap { table-layout: fixed; width: 100%; } table.wrap td { white-space: pre-wrap; }
td div.call, td div.tool, td div.env { margin: 3px 0; padding: 2px 6px; font-family: ui-monospace, monospace;
  font-size: 0.95em; } td div.call { border-left: 3px solid #1565c0; background: #e8f0fb; }
td div.tool { border-left: 3px solid #6d4c41; background: #f3efed; } td div.env { border-left: 3px solid #777;
  background: #f1f1f1; } td div.say { margin: 3px 0; } td div span.label { font-weight: 600; }
th { background: #f4f4f4; } tr:nth-child(even) td { background: #fafafa; }
tr.best td { background: #e8f5e9; font-weight: 600; }
caption { text-align: left; font-weight: bold; padding: 4px 0; }
.images { display: flex; flex-wrap: wrap; gap: 8px; }
figure { margin: 0; flex: 0 1 620px; min-width: 0; }
figure img { width: 100%; box-sizing: border-box; border: 1px solid #eee; }
figcaption { font-size: 0.8em; color: #555; }
summary { cursor: pointer; font-weight: bold; font-size: 1.1em; margin-top: 1.5em; overflow-wrap: anywhere; }
"""


def _table_html(t: Table) -> str:
    caption = f"<caption>{html.escape(t.caption)}</caption>" if t.caption else ""
    cols = "".join(f'<col style="width:{html.escape(w)}">' for w in t.widths) if t.widths else ""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in t.columns)
    body = "".join(
        ("<tr class=best>" if i == t.marked else "<tr>")
        + "".join(f"<td>{_messages_html(v)}</td>" if isinstance(v, Messages) else
                  f'<td{" class=num" if is_num(v) else ""}>{html.escape(fmt(v))}</td>' for v in row) + "</tr>"
        for i, row in enumerate(t.rows)
    )
    table = (f'<table{" class=wrap" if t.widths else ""}>{caption}{f"<colgroup>{cols}</colgroup>" if cols else ""}'
             f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    return table if t.widths else f'<div class="scroll">{table}</div>'


def _messages_html(cell: Messages) -> str:
    """A `Messages` cell: a `<div>` per block, its class the block's kind, its label in bold."""
    return "".join(f'<div class={kind}>{f"<span class=label>{html.escape(label)}</span>" if label else ""}'
                   f"{html.escape(text)}</div>" for kind, label, text in cell.parts()) or "–"


def _paragraphs(text: str, cls: str = "") -> list[str]:
    attr = f" class={cls}" if cls else ""
    return [f"<p{attr}>{html.escape(p.strip())}</p>" for p in text.split("\n\n") if p.strip()]


def write_html(out_path: Path | str, title: str, sections: Sequence[Section]) -> Path:
    """Write a self-contained HTML page (no external assets, no JS) and return its path.

    Every image is embedded as a `data:image/png;base64,...` URI; an image outside the page's folder
    is also copied beside it, so the folder holds the PNG files too. Written atomically.
    """
    out_path = Path(out_path)
    out_dir = out_path.parent.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>",
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    for s in sections:
        inner = _paragraphs(s.alert, "alert") + _paragraphs(s.text)
        inner += [_table_html(t) for t in s.tables]
        if s.images:
            imgs = []
            for i, img in enumerate(map(Path, s.images)):
                if not img.resolve().is_relative_to(out_dir):
                    shutil.copy2(img, out_dir / img.name)
                data = base64.b64encode(img.read_bytes()).decode("ascii")
                cap = f"<figcaption>{html.escape(s.captions[i])}</figcaption>" if i < len(s.captions) else ""
                imgs.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(img.stem)}" '
                            f'title="{html.escape(img.name)}">{cap}</figure>')
            inner.append(f'<div class="images">{"".join(imgs)}</div>')
        if s.collapsed:
            parts.append(f"<details><summary>{html.escape(s.title)}</summary>{''.join(inner)}</details>")
        else:
            parts.append(f"<section><h2>{html.escape(s.title)}</h2>{''.join(inner)}</section>")
    parts.append("</body></html>\n")
    atomic_write_text(out_path, "\n".join(parts))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out_path, 0o666 & ~umask)  # atomic_write_text's temp file is 0600; a report is meant to be shared
    return out_path
