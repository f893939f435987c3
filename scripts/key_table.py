"""README.md's configuration-key tables, rendered from the schema: every key of `rlhf_cli.config.RunConfig`, its
schema default and the first sentence of the docstring written under its field (`config.field_docs`). The keys the
supervised sections share (`config.SupervisedConfig`: `sft.*`, `rm.*`, `dpo.*`) are one table, with a default
column per section; each section's table then holds its own keys only.

    python scripts/key_table.py            # print the tables
    python scripts/key_table.py --write    # replace README.md's block between the markers with them
    python scripts/key_table.py --check    # exit 1 when README.md's block differs (tests/test_docs.py checks it)

The descriptions live once, in rlhf_cli/config.py: edit them there and run `--write`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN = "<!-- keys: rendered by scripts/key_table.py from rlhf_cli/config.py; do not edit by hand -->"
END = "<!-- /keys -->"
def first_sentence(doc: str | None) -> str:
    """A docstring's first sentence (`config.first_sentence`, as `rlhf <command> --help` shows it), `|` escaped for a
    Markdown table cell."""
    from rlhf_cli.config import first_sentence as sentence

    return sentence(doc).replace("|", "\\|")


def shown(value) -> str:
    """A default as a user types it on the command line (`null`, `true`, `[q_proj,v_proj]`)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{shown(v)}" for k, v in value.items()) + "}"
    return str(value)


def leaves(obj, prefix: str = ""):
    """`(dotted key, default)` of every non-dataclass field under the dataclass instance `obj`, in schema order."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def supervised_table(root, docs, sections: list[str]) -> list[str]:
    """The `####` table of the keys `sections` share (`config.SupervisedConfig`'s fields): each key once, a default
    column per section, the base class's description."""
    from rlhf_cli.config import SupervisedConfig

    what = first_sentence(" ".join(SupervisedConfig.__doc__.split())).split(": ", 1)[-1]  # "optimizer, ..."
    out = [f"#### Supervised optimizer keys ({', '.join(f'`{s}.*`' for s in sections)}): {what}", "",
           f"| key | {' | '.join(f'`{s}` default' for s in sections)} | meaning |",
           f"| --- | {' | '.join('---' for _ in sections)} | --- |"]
    for f in dataclasses.fields(SupervisedConfig):
        defaults = " | ".join(f"`{shown(getattr(getattr(root, s), f.name))}`" for s in sections)
        out.append(f"| `{f.name}` | {defaults} | {first_sentence(docs[f'{sections[0]}.{f.name}'])} |")
    return [*out, ""]


def render() -> str:
    """One `####` table per section of the config (a top-level dataclass field), then one for the top-level keys; the
    keys the supervised sections share in one table before the first of them, left out of theirs."""
    from rlhf_cli.config import RunConfig, SupervisedConfig, field_docs

    docs = field_docs()
    root = RunConfig()
    hints = typing.get_type_hints(RunConfig)
    supervised = [f.name for f in dataclasses.fields(root) if dataclasses.is_dataclass(hints[f.name])
                  and issubclass(hints[f.name], SupervisedConfig)]
    shared = {f.name for f in dataclasses.fields(SupervisedConfig)}
    out, top = [], []
    for f in dataclasses.fields(root):
        if not dataclasses.is_dataclass(hints[f.name]):
            top.append((f.name, getattr(root, f.name)))
            continue
        rows = list(leaves(getattr(root, f.name), f.name + "."))
        if f.name in supervised:
            if f.name == supervised[0]:
                out += supervised_table(root, docs, supervised)
            rows = [(key, value) for key, value in rows if key.split(".", 1)[1] not in shared]
        out += table(f"`{f.name}`: {first_sentence(docs[f.name])}", rows, docs,
                     "Only the supervised optimizer keys above." if f.name in supervised else "")
    out += table("Top-level keys", top, docs)
    return "\n".join(out).rstrip("\n") + "\n"


def table(title: str, rows: list[tuple[str, object]], docs: dict[str, str | None], empty: str = "") -> list[str]:
    """A `####` table of `rows` (dotted key, default) with the first sentence of each key's description; `empty`
    stands in for a table without rows."""
    out = [f"#### {title}", ""]
    if not rows:
        return [*out, empty, ""]
    out += ["| key | schema default | meaning |", "| --- | --- | --- |"]
    out += [f"| `{key}` | `{shown(value)}` | {first_sentence(docs[key])} |" for key, value in rows]
    return [*out, ""]


def readme_block(text: str) -> str:
    """The text between the markers of README.md (exclusive), or an error naming the missing marker."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md lacks the key table's markers ({BEGIN!r} ... {END!r})")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace README.md's block with the rendering")
    mode.add_argument("--check", action="store_true", help="exit 1 when README.md's block differs")
    args = parser.parse_args(argv)
    table = render()
    if not (args.write or args.check):
        print(table, end="")
        return 0
    text = README.read_text()
    if args.check:
        same = readme_block(text) == table
        print("README.md's key table is current" if same else "README.md's key table is stale: run "
              "`python scripts/key_table.py --write`", file=sys.stderr)
        return 0 if same else 1
    head, rest = text.split(BEGIN, 1) if BEGIN in text else (None, None)
    if head is None or END not in rest:
        raise SystemExit(f"README.md lacks the key table's markers ({BEGIN!r} ... {END!r})")
    README.write_text(f"{head}{BEGIN}\n\n{table}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
