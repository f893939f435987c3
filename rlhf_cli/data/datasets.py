"""Load, validate, split and tokenise preference and prompt data; summarise what was kept and dropped.

Entry points:

    load_preference_data(data_cfg, tokenizer, splits=("train", "eval")) -> PreferenceData
    load_prompt_data(data_cfg, tokenizer, split="train") -> PromptData (a list of prompt dicts)
    load_sft_data(data_cfg, tokenizer) -> SFTData (demonstrations, train-sft)
    load_unpaired_data(data_cfg, tokenizer) -> UnpairedData (labelled completions, train-kto)

Steps, in order:
  1. read     `data.path` (local .json/.jsonl/.jsonl.gz/.parquet/.csv via `datasets`, or a hub name with
              `data.split`); null = the built-in arithmetic task (see builtin.py)
  2. parse    every row with the detected or given `data.format`; a bad row raises one DataError naming
              the file, row and field, or with `data.skip_invalid=true` is counted per reason
  3. select   seeded shuffle (`data.seed`), keep `data.max_samples` rows, hold out `data.test_size`
              (fraction or count) for eval unless `data.eval_path` names an eval file (max_samples then
              caps each file). Prompt data drops duplicate prompts first.
  4. tokenise see tokenize.py (chat template, exact prompt/response boundary, EOS, left truncation)

Every row is accounted for in the summary: rows_read = sum(kept) + sum(dropped) + unused (train-kto reads a
preference pair as two rows: each of them counts).

Hostile input, decided once:
  - A row the file gets wrong is INVALID: a JSON-lines line that is not UTF-8, not JSON or not an object
    (`bad_json`), a missing/null field, a wrong type, an empty response, an HH transcript without an
    assistant turn, a lone surrogate ("\\ud800", `invalid_unicode`)... and a pair whose chosen and rejected
    texts are identical (`identical_responses`: it carries no preference signal). Invalid rows fail the
    load with one DataError naming the file, row and field, or are skipped and counted per reason with
    `data.skip_invalid=true`.
  - A VALID row the config cannot use is always dropped and counted, whatever `skip_invalid` says: a
    response longer than `data.max_length` (`response_too_long`), a pair whose different texts
    tokenise identically (`identical_after_truncation`, e.g. one ends in the EOS string), a repeated
    prompt in prompt data (`duplicate_prompt`), a prompt that cannot keep one token of its content in its
    budget (`prompt_too_long`), a demonstration whose first response cannot fit whole (`no_response_left`: no
    response token would be left to train on). Other too-long prompts are truncated (`Encoder.fit_prompt`) and
    counted in `truncated`.
  - Exact duplicate pairs are KEPT (a repeated row is a legitimate up-weighting) and counted in
    `DataSummary.duplicates`.
  - Damage to a whole file (empty, only blank lines, a truncated gzip stream, no valid row at all)
    raises DataError in both modes: there is no row to skip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import logging
import os
import random
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rlhf_cli.config import DATA_FILE_TYPES
from rlhf_cli.data import builtin as builtin_task
from rlhf_cli.data import builtin_envs
from rlhf_cli.data.formats import (
    BAD_JSON,
    BAD_MESSAGES,
    DUPLICATE_PROMPT,
    IDENTICAL_AFTER_TRUNCATION,
    MISSING_FIELD,
    NO_RESPONSE_LEFT,
    NOT_STRING,
    PREFERENCE_FORMATS,
    PROMPT_TOO_LONG,
    RESPONSE_TOO_LONG,
    SFT_FORMATS,
    SKIP_HINT,
    TEMPLATE_ERROR,
    UNPAIRED_FORMATS,
    DataError,
    Demo,
    Keys,
    Pair,
    Prompt,
    RowError,
    Unpaired,
    detect_format,
    parse_demo,
    parse_pair,
    parse_prompt,
    parse_unpaired,
    required_columns,
)
from rlhf_cli.data.tokenize import Encoder, lengths_summary, pair_budget
from rlhf_cli.errors import ConfigError
from rlhf_cli.seeds import derive_seed

logger = logging.getLogger(__name__)

LOCAL_BUILDERS = DATA_FILE_TYPES
SPLITS = ("train", "eval")


# ----------------------------------------------------------------------------------------------
# records


@dataclass
class DataSummary:
    """What a load read, kept and dropped; `line()` is the one-line report printed at load.

    Invariant: rows_read == sum(kept.values()) + sum(dropped.values()) + unused.
    """

    source: str
    format: str
    rendering: str
    """`chat template` or `raw text`."""
    rows_read: int = 0
    kept: dict[str, int] = field(default_factory=dict)
    """Examples per split after tokenisation."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Rows dropped per reason (invalid rows, too-long responses, duplicate prompts...)."""
    unused: int = 0
    """Valid rows left out by `max_samples` or held out for a split that was not requested."""
    truncated: int = 0
    """Kept examples whose prompt was truncated (older turns dropped or content cut, see `Encoder.fit_prompt`), or,
    for train-sft, whose conversation lost its later turns (`Encoder.fit_demo`)."""
    lengths: dict[str, int] = field(default_factory=dict)
    """Token-length percentiles {p50, p90, max} of prompt + longer response (prompt alone for prompt
    data, prompt + first response for demonstrations), before truncation."""
    duplicates: int = 0
    """Kept pairs identical to an earlier kept pair (same prompt, chosen and rejected tokens), in any
    split: kept, and counted here (prompt data drops repeated prompts instead, as `duplicate_prompt`)."""

    def line(self) -> str:
        kept = " / ".join(f"{k} {v}" for k, v in self.kept.items())
        dropped = ", ".join(f"{v} {k}" for k, v in sorted(self.dropped.items())) or "none"
        ln = self.lengths or lengths_summary([])
        dup = f" (incl. {self.duplicates} duplicate pairs)" if self.duplicates else ""
        return (f"data: {self.source} ({self.format}, {self.rendering}): {self.rows_read} rows read, kept {kept}{dup}; "
                f"dropped {dropped}; unused {self.unused}; prompts truncated {self.truncated}; "
                f"tokens p50/p90/max {ln['p50']}/{ln['p90']}/{ln['max']}")

    __str__ = line

    def drops(self) -> str:
        """Each drop reason with its count and the key that would keep those rows, most first: `27
        response_too_long (raise data.max_length=512)`; `no row was dropped` when none was."""
        if not self.dropped:
            return "no row was dropped"
        return "; ".join(f"{n} {reason}" + (f" ({KEEPS[reason]})" if reason in KEEPS else "")
                         for reason, n in sorted(self.dropped.items(), key=lambda kv: -kv[1]))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


KEEPS = {
    RESPONSE_TOO_LONG: "raise data.max_length", PROMPT_TOO_LONG: "raise data.max_prompt_length or data.max_length",
    IDENTICAL_AFTER_TRUNCATION: "raise data.max_length", NO_RESPONSE_LEFT: "raise data.max_length",
    DUPLICATE_PROMPT: "prompts are deduplicated: repeat them with ppo.n_samples_per_prompt",
    MISSING_FIELD: "name the columns with data.prompt_key, data.chosen_key, ...",
    BAD_JSON: "fix the file", NOT_STRING: "fix the file", BAD_MESSAGES: "fix the file",
}
"""A drop reason -> the key (or fix) that would keep such rows, for `DataSummary.drops`."""


@dataclass
class PreferenceData:
    """Tokenised preference pairs. Each example is a dict:

        prompt_ids    list[int]  rendered prompt (truncated to fit: `Encoder.fit_prompt`)
        chosen_ids    list[int]  preferred response, ending in exactly one EOS
        rejected_ids  list[int]  dispreferred response, ending in exactly one EOS
        row           int        1-based row in the source file (split index for the built-in task)
        margin        float      only when `data.margin_key` is set
    """

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    summary: DataSummary


class PromptData(list):
    """A list of prompt dicts (prompt_ids, prompt_text, row, and answer when known) with `.summary`."""

    def __init__(self, items: Sequence[dict[str, Any]], summary: DataSummary):
        super().__init__(items)
        self.summary = summary


@dataclass
class _Parsed:
    """Valid records of one source (Pairs or Prompts, each with its row) and the drop counts."""

    name: str
    format: str
    rows_read: int
    items: list[Any]
    dropped: Counter


# ----------------------------------------------------------------------------------------------
# reading


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def _builder(path: str) -> str | None:
    low = path.lower()
    return next((b for ext, b in LOCAL_BUILDERS.items() if low.endswith(ext)), None)


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


@dataclass
class _BadRow:
    """A row of a JSON file that is not a JSON object (not UTF-8, not JSON, or another JSON value).

    It stays in the row list, so row numbers stay those of the file, and the loader reports it as its
    row's error or counts it under `bad_json` like any other invalid row."""

    detail: str


@dataclass
class _Raw:
    """What one source holds before parsing: rows (dicts, or _BadRow for unreadable JSON rows), the
    union of their columns, and for JSON lines the 1-based file line of each row (blank lines are
    not rows, so a row's number and its line differ after one)."""

    name: str
    columns: list[str]
    rows: list[Any]
    lines: list[int] | None = None


def _json_row(raw: bytes) -> Any:
    """One JSON-lines line -> its object, or a _BadRow saying why it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _BadRow(f"not valid UTF-8 (byte {e.start} is {raw[e.start:e.start + 1]!r})")
    try:
        value = json.loads(text)
    except RecursionError:
        return _BadRow("not valid JSON (nested too deeply)")
    except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
        where = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        return _BadRow(f"not valid JSON ({getattr(e, 'msg', str(e))}{where})")
    if not isinstance(value, dict):
        return _BadRow(f"not a JSON object (a JSON {_json_type(value)})")
    return value


def _read_json(path: str, name: str) -> _Raw:
    """Read a .json/.jsonl file (optionally gzip-compressed) with the json module.

    JSON lines are parsed one line at a time, so a bad line is one bad row (reported with its row
    number, or skipped and counted) instead of a failure of the whole file as with `datasets`; a UTF-8
    BOM at the start is ignored; blank lines are not rows. A `.json` file whose content starts with `[`
    is one array of row objects. Damage to the file as a whole (a truncated or corrupt gzip stream, a
    broken array) raises DataError.
    """
    opener = gzip.open if path.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except EOFError:
        raise DataError(name, "the compressed file is truncated (it ends before the end of its gzip stream); "
                              "download or compress it again") from None
    except (OSError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(name, f"cannot read the file ({e})") from None
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    json_lines = path.lower().endswith((".jsonl", ".jsonl.gz"))
    if not json_lines and data.lstrip()[:1] == b"[":
        return _read_json_array(data, name)
    rows, lines = [], []
    for i, raw in enumerate(data.split(b"\n"), 1):
        if raw.strip():
            rows.append(_json_row(raw))
            lines.append(i)
    if not json_lines and len(rows) > 1 and isinstance(rows[0], _BadRow) and _is_one_object(data):
        raise DataError(name, "holds a single JSON object spread over several lines; write an array of row "
                              "objects, or one object per line (JSON lines)")
    columns = list(dict.fromkeys(k for r in rows if isinstance(r, dict) for k in r))
    return _Raw(name, columns, rows, lines)


def _is_one_object(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data.decode("utf-8")), dict)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return False


def _read_json_array(data: bytes, name: str) -> _Raw:
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(name, f"not valid UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise DataError(name, "not valid JSON (nested too deeply)") from None
    except ValueError as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise DataError(name, f"not valid JSON ({getattr(e, 'msg', str(e))}{where})") from None
    if not isinstance(value, list):
        raise DataError(name, "expected an array of row objects, or one JSON object per line")
    rows = [v if isinstance(v, dict) else _BadRow(f"not a JSON object (a JSON {_json_type(v)})") for v in value]
    return _Raw(name, list(dict.fromkeys(k for r in rows if isinstance(r, dict) for k in r)), rows)


def _read(path: str, split: str = "train") -> _Raw:
    """Read a local file or directory, or a hub dataset: see `read_rows`. JSON files keep unreadable
    rows as _BadRow entries."""
    from datasets import load_dataset

    local = os.path.expanduser(path)
    if os.path.isfile(local):
        name = os.path.basename(local)
        builder = _builder(local)
        if builder is None:
            raise DataError(name, f"unsupported file type; use one of {', '.join(LOCAL_BUILDERS)}")
        if builder == "json":
            return _read_json(local, name)
        try:
            with _quiet_datasets():
                ds = load_dataset(builder, data_files=local, split="train")
        except Exception as e:  # datasets wraps parser errors in several exception types
            raise DataError(
                name, f"cannot read the file: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from e
    elif os.path.isdir(local):
        name = os.path.basename(os.path.normpath(local))
        try:
            with _quiet_datasets():
                ds = load_dataset(local, split=split)
        except Exception as e:
            raise DataError(name, f"cannot load this directory as a dataset: {type(e).__name__}: {e}") from e
    else:
        if _builder(local) or local.startswith((".", "/", "~")):
            raise DataError(path, "file not found")
        name = f"{path}[{split}]"
        try:
            with _quiet_datasets():
                ds = load_dataset(path, split=split)
        except Exception as e:
            raise DataError(path, f"not a local file, and loading it from the hub failed "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    return _Raw(name, list(ds.column_names), ds.to_list())


def read_rows(path: str, split: str = "train") -> tuple[str, list[str], list[dict[str, Any]]]:
    """Read a local data file or a hub dataset: (name for messages, columns, rows).

    .json/.jsonl(.gz) files are read with the json module, parquet/csv files, directories and hub
    datasets through `datasets`. Local files have a single `train` split; `split` applies to hub
    datasets. Raises DataError, also for the first row of a JSON file that is not a JSON object.
    """
    raw = _read(path, split)
    for i, row in enumerate(raw.rows, 1):
        if isinstance(row, _BadRow):
            raise DataError(raw.name, row.detail, row=i, reason=BAD_JSON, hint=SKIP_HINT)
    return raw.name, raw.columns, raw.rows


def check_rows(data_cfg: Any, want: str, keys: Sequence[str] = ("path", "eval_path"),
               max_bytes: int = 64 << 20) -> None:
    """Parse the rows of the files that `data.<key>` names, for each of `keys` (those the command reads), as the
    command will (`want`: `pairs`, `prompts`, `demos` or `unpaired`): format, columns and every row, with the load's
    one-line errors (file, row, field), but no tokenizer. For a local JSON or JSON-lines file up to `max_bytes` (read
    with the json module, no torch): the CLI calls it before anything heavy loads. Other sources (parquet, csv, a dir,
    a hub dataset) are left to the load. Raises DataError."""
    for key in keys:
        path = data_cfg.get(key)
        local = os.path.expanduser(str(path)) if path else ""
        if local and os.path.isfile(local) and _builder(local) == "json" and os.path.getsize(local) <= max_bytes:
            _parse_source(str(path), data_cfg, want)


# ----------------------------------------------------------------------------------------------
# parsing, selection


def _parse_source(path: str, data_cfg: Any, want: str) -> _Parsed:
    """Read and validate one source; `want` is `pairs`, `prompts`, `demos` (train-sft) or `unpaired` (train-kto: a
    file whose valid rows are all of one label is refused, naming the label column)."""
    keys = Keys.from_cfg(data_cfg)
    raw = _read(path, data_cfg.split)
    name, columns, rows = raw.name, raw.columns, raw.rows
    if not rows:
        raise DataError(name, "holds no rows (the file is empty or has only blank lines)")
    records = [r for r in rows if isinstance(r, dict)]
    if not records:  # not one readable row: report the first, or say that all were skipped
        if not data_cfg.skip_invalid:
            raise DataError(name, rows[0].detail, row=1, reason=BAD_JSON, hint=SKIP_HINT)
        raise DataError(name, f"no valid rows: all {len(rows)} rows are skipped as {BAD_JSON}")
    fmt = (data_cfg.format if data_cfg.format != "auto"
           else detect_format(columns, records, keys, name, sft=want == "demos", unpaired=want == "unpaired"))
    if want == "pairs" and fmt not in PREFERENCE_FORMATS:
        held = ("demonstrations (supervised fine-tuning)" if fmt in SFT_FORMATS else
                "unpaired labelled completions (KTO)" if fmt == "unpaired" else "prompts only")
        raise DataError(name, f"format '{fmt}' holds {held}; reward-model training needs chosen/rejected "
                              f"pairs (data.format one of {', '.join(PREFERENCE_FORMATS)} or auto)")
    if want == "demos" and fmt not in SFT_FORMATS:
        held = "preference pairs" if fmt in PREFERENCE_FORMATS else "prompts"
        raise DataError(name, f"format '{fmt}' holds {held}; supervised fine-tuning needs demonstrations "
                              f"(data.format one of {', '.join(SFT_FORMATS)} or auto)")
    if want == "unpaired" and fmt not in UNPAIRED_FORMATS:
        held = "demonstrations (no label)" if fmt in SFT_FORMATS else "prompts"
        raise DataError(name, f"format '{fmt}' holds {held}; KTO needs labelled completions (data.format one of "
                              f"{', '.join(UNPAIRED_FORMATS)} or auto)")
    key_cfg = dataclasses.replace(keys, margin=None) if want == "prompts" else keys
    missing = required_columns(fmt, key_cfg, columns)
    if missing:
        raise DataError(name, f"column '{missing[0]}' not found for format '{fmt}' (columns: {', '.join(columns)}); "
                              f"set data.format or the data.*_key naming it")
    items, dropped = [], Counter()
    for i, row in enumerate(rows, 1):
        try:
            if isinstance(row, _BadRow):
                raise RowError(None, BAD_JSON, row.detail)
            if want == "pairs":
                item = parse_pair(row, fmt, keys)
                item.row = i
            elif want == "demos":
                item = parse_demo(row, fmt, keys)
                item.row = i
            elif want == "unpaired":
                item = parse_unpaired(row, fmt, keys)
                for u in item:
                    u.row = i
            else:
                item = (i, parse_prompt(row, fmt, keys))
        except RowError as e:
            if not data_cfg.skip_invalid:
                line = raw.lines[i - 1] if raw.lines else i
                detail = e.detail if line == i else f"{e.detail} (line {line} of the file)"
                raise DataError(name, detail, row=i, field=e.field, reason=e.reason, hint=SKIP_HINT) from None
            dropped[e.reason] += 1
            continue
        if want == "unpaired":
            items.extend(item)
        else:
            items.append(item)
    if not items:
        counts = ", ".join(f"{v} {k}" for k, v in sorted(dropped.items()))
        raise DataError(name, f"no valid rows: all {len(rows)} rows are skipped ({counts})")
    if want == "unpaired":
        check_classes(items, name, keys.label)
    return _Parsed(name, fmt, len(rows), items, dropped)


def check_classes(items: Sequence[Unpaired], source: str, label_key: str) -> None:
    """Refuse unpaired rows that are all of one label (train-kto): KTO weighs desirable against undesirable
    completions, and its reference point alone would be the only other term (TRL only warns of its weights here).
    Raises DataError naming the source and the label column."""
    labels = {u.desirable for u in items}
    if len(labels) == 1:
        which = "desirable (true)" if labels == {True} else "undesirable (false)"
        raise DataError(source, f"all {len(items)} valid rows are {which}: KTO needs both desirable and undesirable "
                                f"completions in a file", field=label_key)


def _dedupe_prompts(parsed: _Parsed) -> None:
    seen, out = set(), []
    for row, p in parsed.items:
        key = (p.text, tuple((m["role"], m["content"]) for m in p.messages))
        if key in seen:
            parsed.dropped[DUPLICATE_PROMPT] += 1
            continue
        seen.add(key)
        out.append((row, p))
    parsed.items = out


def _shuffled_cap(items: list[Any], seed: int, max_samples: int | None) -> tuple[list[Any], int]:
    """Seeded shuffle, then at most `max_samples` items: (kept, number left out)."""
    items = list(items)
    random.Random(seed).shuffle(items)
    if max_samples is not None and len(items) > max_samples:
        return items[:max_samples], len(items) - max_samples
    return items, 0


def _eval_count(n: int, test_size: float, source: str, what: str = "data.test_size") -> int:
    n_eval = int(test_size) if test_size >= 1 else max(1, round(n * test_size))
    if n_eval >= n:
        raise DataError(source, f"{what}={test_size} holds out {n_eval} of {n} rows, leaving none "
                                f"for training; lower it or set data.eval_path")
    return n_eval


def _item_row(item: Any) -> int:
    return item.row if hasattr(item, "row") else item[0]


def row_parts(rows_read: int, data_cfg: Any, source: str) -> dict[int, str]:
    """Which part each source row (1-based) belongs to: "eval", "ppo", "train" or "unused".

    Decided on row numbers by a seeded shuffle (`data.seed`), before any row is parsed, so the pairs
    and the prompts read from one file fall into the same, disjoint parts. Of the first
    `data.max_samples` rows of the shuffle (all when null), the first `data.test_size` are held out
    ("eval"), the next `data.ppo_size` are PPO prompts ("ppo"), the rest train the reward model.
    """
    order = list(range(1, rows_read + 1))
    random.Random(int(data_cfg.seed)).shuffle(order)
    n = min(rows_read, data_cfg.max_samples or rows_read)
    n_eval = 0 if data_cfg.eval_path else _eval_count(n, float(data_cfg.test_size), source)
    ppo_size = float(data_cfg.ppo_size or 0)
    n_ppo = 0 if ppo_size <= 0 else (int(ppo_size) if ppo_size >= 1 else max(1, round(n * ppo_size)))
    if n_eval + n_ppo >= n:
        raise DataError(source, f"data.test_size={data_cfg.test_size} and data.ppo_size={data_cfg.ppo_size} leave "
                                f"no rows of {n} for reward-model training")
    bounds = ((n_eval, "eval"), (n_eval + n_ppo, "ppo"), (n, "train"))
    return {row: next((name for end, name in bounds if k < end), "unused") for k, row in enumerate(order)}


def _select(data_cfg: Any, load: Any, splits: Sequence[str], want: str = "pairs"
            ) -> tuple[dict[str, list[Any]], list[_Parsed], int]:
    """Parse the sources and pick each split's records: ({split: items}, parsed sources, unused count).

    `load(path)` parses one source. The eval split comes from `data.eval_path` when set, else from the
    held-out rows of `data.path` (see `row_parts`). With `data.ppo_size`, prompts (`want="prompts"`)
    of the train split are the PPO part's rows, and pairs of the train split exclude them.
    """
    seed, cap = int(data_cfg.seed), data_cfg.max_samples
    main = load(data_cfg.path)
    items, unused = _shuffled_cap(main.items, seed, None)  # max_samples is applied to rows in row_parts
    sources = [main]
    parts = row_parts(main.rows_read, data_cfg, main.name)
    train_part = "ppo" if want == "prompts" and float(data_cfg.ppo_size or 0) > 0 else "train"
    train = [it for it in items if parts[_item_row(it)] == train_part]
    if data_cfg.eval_path:
        evals: list[Any] = []
        if "eval" in splits:
            other = load(data_cfg.eval_path)
            sources.append(other)
            evals, more = _shuffled_cap(other.items, seed, cap)
            unused += more
        main_evals: list[Any] = []
    else:
        evals = main_evals = [it for it in items if parts[_item_row(it)] == "eval"]
    unused += len(items) - len(train) - len(main_evals)  # the other part (PPO prompts or RM pairs)
    chosen = {"train": train, "eval": evals}
    for s in SPLITS:
        if s not in splits:
            unused += len(chosen[s])
    return {s: chosen[s] for s in splits}, sources, unused


def _summary(sources: list[_Parsed], encoder: Encoder) -> DataSummary:
    dropped: Counter = Counter()
    for s in sources:
        dropped.update(s.dropped)
    return DataSummary(source=" + ".join(s.name for s in sources), format=sources[0].format,
                       rendering="chat template" if encoder.use_chat else "raw text",
                       rows_read=sum(s.rows_read for s in sources), dropped=dict(dropped))


def _check_splits(splits: Sequence[str]) -> None:
    bad = [s for s in splits if s not in SPLITS]
    if bad or not splits:
        raise ValueError(f"splits must be a non-empty subset of {SPLITS} (got {tuple(splits)})")


# ----------------------------------------------------------------------------------------------
# built-in task as sources


def builtin_pair(p: builtin_task.BuiltinProblem, row: int) -> Pair:
    """A built-in problem as a Pair (raw form: "Question: ...\\nAnswer:" + " <reply>")."""
    return Pair(prompt=builtin_prompt(p), chosen=" " + p.chosen, rejected=" " + p.rejected, row=row)


def builtin_prompt(p: builtin_task.BuiltinProblem) -> Prompt:
    return Prompt(messages=[{"role": "user", "content": p.question}], text=f"Question: {p.question}\nAnswer:",
                  answer=p.answer)


def builtin_demo(p: builtin_task.BuiltinProblem, row: int, tools: list[dict[str, Any]] | None = None) -> Demo:
    """A built-in problem as a demonstration: its prompt and its correct worked solution (the pair's chosen). With
    `tools` (`data.builtin.tool_calls`: `[builtin_envs.calculator_schema()]`, made once per split), a tool
    transcript instead: an assistant turn holding one `calculate` call of the problem's expression
    (`builtin_envs.Calculator`), the tool's result, then the worked solution, as a `messages` row with a `tools`
    column parses."""
    if tools is None:
        return Demo(prompt=builtin_prompt(p), response=" " + p.chosen, later=[], row=row)
    prompt = builtin_prompt(p)
    prompt.tools = tools
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": p.expression}}}
    result = [{"role": "tool", "name": "calculate", "content": builtin_envs.Calculator().calculate(p.expression)}]
    return Demo(prompt=prompt, response=" ", later=[(result, " " + p.chosen)], row=row, calls=[[call], []])


def builtin_unpaired(p: builtin_task.BuiltinProblem, row: int, seed: int) -> Unpaired:
    """A built-in problem as one unpaired row (train-kto): its correct or its wrong reply, drawn from `seed` and the
    row with even odds, labelled by the task's checker (desirable where the reply's final number is the answer).
    One row per problem, so no two rows share a prompt."""
    reply = p.chosen if random.Random(derive_seed(seed, row)).random() < 0.5 else p.rejected
    return Unpaired(prompt=builtin_prompt(p), completion=" " + reply,
                    desirable=builtin_task.check_answer(reply, p.answer) == 1.0, row=row)


def _builtin_source(data_cfg: Any, split: str, want: str) -> _Parsed:
    problems = builtin_task.builtin_splits(data_cfg.builtin)[split]
    if want == "pairs":
        items = [builtin_pair(p, i) for i, p in enumerate(problems, 1)]
    elif want == "unpaired":
        items = [builtin_unpaired(p, i, data_cfg.builtin.seed) for i, p in enumerate(problems, 1)]
    elif want == "demos":
        tools = [builtin_envs.calculator_schema()] if data_cfg.builtin.tool_calls else None
        items = [builtin_demo(p, i, tools) for i, p in enumerate(problems, 1)]
    else:
        items = [(i, builtin_prompt(p)) for i, p in enumerate(problems, 1)]
    return _Parsed(f"builtin:{split}(seed {data_cfg.builtin.seed})", "builtin arithmetic", len(problems), items,
                   Counter())


def _chosen_rows(data_cfg: Any, kind: str, splits: Sequence[str], encoder: Encoder
                 ) -> tuple[dict[str, list[Any]], DataSummary, Counter]:
    """The rows of `kind` ("pairs", "demos", "unpaired") a supervised loader reads per split: from `data.path`'s
    sources, or the built-in rm_train / rm_eval splits when it is null; with the data summary (its unused rows
    set) and the drop counter the loader adds its own reasons to."""
    if data_cfg.reasoning_gym.tasks:
        raise ConfigError(f"data.reasoning_gym gives prompts only (for PPO and the evaluation of a policy), no "
                          f"{kind}: name a file with data.path, or data.reasoning_gym.tasks=[] for the built-in task")
    if data_cfg.path is None:
        chosen, sources, unused = _builtin_select(data_cfg, kind, {"train": "rm_train", "eval": "rm_eval"}, splits)
    else:
        chosen, sources, unused = _select(data_cfg, lambda p: _parse_source(p, data_cfg, kind), splits)
    summary = _summary(sources, encoder)
    summary.unused = unused
    return chosen, summary, Counter(summary.dropped)


def _reasoning_gym_select(data_cfg: Any, split: str) -> tuple[dict[str, list[Any]], list[_Parsed], int]:
    """The prompts of `data.reasoning_gym`'s tasks for `split` (`reasoning_gym.reasoning_gym_splits`), shuffled
    and capped by `data.max_samples` as a file's are."""
    from rlhf_cli.data.reasoning_gym import EVAL_SEED_OFFSET, reasoning_gym_splits

    rg = data_cfg.reasoning_gym
    items = reasoning_gym_splits(data_cfg)[split]
    seed = rg.seed + (0 if split == "train" else EVAL_SEED_OFFSET)
    src = _Parsed(f"reasoning_gym:{split}({','.join(rg.tasks)}, seed {seed})", "reasoning-gym", len(items), items,
                  Counter())
    kept, unused = _shuffled_cap(items, int(data_cfg.seed), data_cfg.max_samples)
    return {split: kept}, [src], unused


def _builtin_select(data_cfg: Any, want: str, names: dict[str, str], splits: Sequence[str]
                    ) -> tuple[dict[str, list[Any]], list[_Parsed], int]:
    out, sources, unused = {}, [], 0
    for s in splits:
        src = _builtin_source(data_cfg, names[s], want)
        cap = data_cfg.max_samples if data_cfg.max_samples is not None else data_cfg.builtin.max_samples
        out[s], more = _shuffled_cap(src.items, int(data_cfg.seed), cap)
        sources.append(src)
        unused += more
    return out, sources, unused


# ----------------------------------------------------------------------------------------------
# entry points


def load_preference_data(data_cfg: Any, tokenizer: Any, *, splits: Sequence[str] = SPLITS,
                         eos_ids: Sequence[int] = ()) -> PreferenceData:
    """Load, validate, split and tokenise preference pairs for reward-model training and evaluation.

    `data_cfg` is a `DataConfig` (dataclass or DictConfig); `data.path=null` uses the built-in task's
    rm_train / rm_eval splits. Splits not requested come back empty. Raises DataError for unusable data
    (one line naming the file, row and field). The summary is logged at INFO and returned. `eos_ids`: the model's
    EOS set (`eos.eos_ids`): a response whose text ends in the text of any of them ends there (`Encoder`).
    """
    _check_splits(splits)
    encoder = Encoder(tokenizer, data_cfg.chat_template, data_cfg.system_prompt, eos_ids)
    chosen, summary, drops = _chosen_rows(data_cfg, "pairs", splits, encoder)
    out: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    lengths: list[int] = []
    for split, pairs in chosen.items():
        out[split] = _tokenize_pairs(pairs, encoder, data_cfg, drops, lengths, summary)
        summary.kept[split] = len(out[split])
    summary.duplicates = count_duplicates(out["train"] + out["eval"])
    summary.dropped = dict(drops)
    summary.lengths = lengths_summary(lengths)
    logger.info(summary.line())
    return PreferenceData(train=out["train"], eval=out["eval"], summary=summary)


def count_duplicates(examples: Sequence[dict[str, Any]]) -> int:
    """How many tokenised pairs repeat an earlier one exactly (prompt, chosen and rejected ids)."""
    seen = set()
    for ex in examples:
        seen.add((tuple(ex["prompt_ids"]), tuple(ex["chosen_ids"]), tuple(ex["rejected_ids"])))
    return len(examples) - len(seen)


def _render(encoder: Encoder, rows_prompts: list[tuple[int, Prompt]], data_cfg: Any, drops: Counter,
            source: str) -> tuple[list[int], list[str], list[list[tuple[str, bool]]]]:
    """Render prompts; a chat template that rejects a row's messages (some templates demand strictly
    alternating roles) is a bad row: DataError, or counted under `chat_template_error` when skipping.
    Returns (indices of the rendered items, rendered texts, their `Encoder.segments`)."""
    keep, texts, segments = [], [], []
    for i, (row, prompt) in enumerate(rows_prompts):
        try:
            segs = encoder.segments(prompt)  # their text, joined, is the rendered prompt
        except Exception as e:  # jinja2 TemplateError, or the template's own raise_exception
            if not data_cfg.skip_invalid:
                raise DataError(source, f"the tokenizer's chat template rejects this prompt ({e})", row=row,
                                field=data_cfg.prompt_key, reason=TEMPLATE_ERROR, hint=SKIP_HINT) from None
            drops[TEMPLATE_ERROR] += 1
            continue
        keep.append(i)
        texts.append("".join(t for t, _ in segs))
        segments.append(segs)
    return keep, texts, segments


def _tokenize_pairs(pairs: list[Pair], encoder: Encoder, data_cfg: Any, drops: Counter, lengths: list[int],
                    summary: DataSummary) -> list[dict[str, Any]]:
    keep, _, segments = _render(encoder, [(p.row, p.prompt) for p in pairs], data_cfg, drops, summary.source)
    pairs = [pairs[i] for i in keep]
    prompt_ids = encoder.encode_segments(segments)
    chosen_ids = encoder.encode_responses([p.chosen for p in pairs])
    rejected_ids = encoder.encode_responses([p.rejected for p in pairs])
    examples = []
    for pair, p_ids, c_ids, r_ids in zip(pairs, prompt_ids, chosen_ids, rejected_ids):
        lengths.append(len(p_ids) + max(len(c_ids), len(r_ids)))
        budget, reason = pair_budget(c_ids, r_ids, data_cfg.max_length, data_cfg.max_prompt_length)
        fitted = None if budget is None else encoder.fit_prompt(pair.prompt, p_ids, budget)
        if fitted is None:
            drops[reason or PROMPT_TOO_LONG] += 1
            continue
        summary.truncated += fitted != p_ids
        ex: dict[str, Any] = {"prompt_ids": fitted, "chosen_ids": c_ids, "rejected_ids": r_ids, "row": pair.row}
        if pair.margin is not None:
            ex["margin"] = pair.margin
        examples.append(ex)
    return examples


@dataclass
class SFTData:
    """Tokenised demonstrations (train-sft): `train` and `eval` lists of examples

        input_ids  list[int]  prompt, then each kept assistant turn (content + EOS) and the template text between
        loss_mask  list[int]  1 = a response token, a target of the next-token loss; 0 = prompt or template text
        row        int        1-based row in the source (split index for the built-in task)
    """

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    summary: DataSummary


def load_sft_data(data_cfg: Any, tokenizer: Any, *, splits: Sequence[str] = SPLITS,
                  eos_ids: Sequence[int] = ()) -> SFTData:
    """Load, validate, split and tokenise demonstrations for train-sft (`data.format` `completion` or `messages`,
    or `auto`); `data.path=null` uses the built-in task's correct worked solutions (the chosen replies of its
    rm_train problems; held out: rm_eval's). Split, shuffle and caps as `load_preference_data`; truncation and
    drops (`prompt_too_long`, `no_response_left`) as `Encoder.fit_demo` says, counted in the summary. Raises
    DataError for unusable data (one line naming the file, row and field). `eos_ids`: the model's EOS set
    (`eos.eos_ids`): a response whose text ends in the text of any of them ends there (`Encoder`)."""
    _check_splits(splits)
    encoder = Encoder(tokenizer, data_cfg.chat_template, data_cfg.system_prompt, eos_ids)
    chosen, summary, drops = _chosen_rows(data_cfg, "demos", splits, encoder)
    out: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    lengths: list[int] = []
    for split, demos in chosen.items():
        keep, _, segments = _render(encoder, [(d.row, d.prompt) for d in demos], data_cfg, drops, summary.source)
        demos = [demos[i] for i in keep]
        prompt_ids = encoder.encode_segments(segments)
        response_ids = encoder.encode_responses([d.response for d in demos])
        for demo, p_ids, r_ids in zip(demos, prompt_ids, response_ids):
            lengths.append(len(p_ids) + len(r_ids))
            try:
                fit = encoder.fit_demo(demo, p_ids, r_ids, data_cfg.max_length, data_cfg.max_prompt_length)
            except Exception as e:  # a later turn's messages the chat template rejects
                if not data_cfg.skip_invalid:
                    raise DataError(summary.source, f"the tokenizer's chat template rejects this conversation ({e})",
                                    row=demo.row, field=data_cfg.messages_key, reason=TEMPLATE_ERROR,
                                    hint=SKIP_HINT) from None
                fit = TEMPLATE_ERROR
            if isinstance(fit, str):
                drops[fit] += 1
                continue
            ids, mask, truncated = fit
            summary.truncated += truncated
            out[split].append({"input_ids": ids, "loss_mask": mask, "row": demo.row})
        summary.kept[split] = len(out[split])
    summary.dropped = dict(drops)
    summary.lengths = lengths_summary(lengths)
    logger.info(summary.line())
    return SFTData(train=out["train"], eval=out["eval"], summary=summary)


@dataclass
class UnpairedData:
    """Tokenised unpaired rows (train-kto): `train` and `eval` lists of examples

        prompt_ids      list[int]  rendered prompt (truncated to fit: `Encoder.fit_prompt`)
        completion_ids  list[int]  the completion, ending in exactly one EOS
        label           bool       True = desirable
        row             int        1-based row in the source (a preference pair's two rows share it; split index for
                                   the built-in task)
    """

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    summary: DataSummary


def load_unpaired_data(data_cfg: Any, tokenizer: Any, *, splits: Sequence[str] = SPLITS,
                       eos_ids: Sequence[int] = ()) -> UnpairedData:
    """Load, validate, split and tokenise unpaired labelled completions for train-kto (`data.format` `unpaired`, a
    preference format whose pairs become a desirable and an undesirable row each, or `auto`); `data.path=null`
    uses the built-in task's problems, one reply each labelled by its checker (`builtin_unpaired`; rm_train, held
    out: rm_eval). Split, shuffle and caps as `load_preference_data`, decided on source rows (a pair's two rows stay
    in one split); a completion longer than `data.max_length` is dropped (`response_too_long`), a prompt truncated
    to fit beside it. Raises DataError for unusable data (one line naming the file, row and field), also for a file
    whose rows are all of one label. `eos_ids`: the model's EOS set (`eos.eos_ids`)."""
    _check_splits(splits)
    encoder = Encoder(tokenizer, data_cfg.chat_template, data_cfg.system_prompt, eos_ids)
    chosen, summary, drops = _chosen_rows(data_cfg, "unpaired", splits, encoder)
    out: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    lengths: list[int] = []
    for split, rows in chosen.items():
        keep, _, segments = _render(encoder, [(u.row, u.prompt) for u in rows], data_cfg, drops, summary.source)
        rows = [rows[i] for i in keep]
        prompt_ids = encoder.encode_segments(segments)
        completion_ids = encoder.encode_responses([u.completion for u in rows])
        for u, p_ids, c_ids in zip(rows, prompt_ids, completion_ids):
            lengths.append(len(p_ids) + len(c_ids))
            if len(c_ids) > data_cfg.max_length:
                drops[RESPONSE_TOO_LONG] += 1
                continue
            fitted = encoder.fit_prompt(u.prompt, p_ids, min(data_cfg.max_prompt_length,
                                                            data_cfg.max_length - len(c_ids)))
            if fitted is None:
                drops[PROMPT_TOO_LONG] += 1
                continue
            summary.truncated += fitted != p_ids
            out[split].append({"prompt_ids": fitted, "completion_ids": c_ids, "label": u.desirable, "row": u.row})
        summary.kept[split] = len(out[split])
    summary.dropped = dict(drops)
    summary.lengths = lengths_summary(lengths)
    logger.info(summary.line())
    return UnpairedData(train=out["train"], eval=out["eval"], summary=summary)


def load_prompt_data(data_cfg: Any, tokenizer: Any, split: str = "train") -> PromptData:
    """Prompts for PPO rollouts and evaluation: a PromptData list of dicts

        prompt_ids   list[int]  rendered prompt, truncated to `data.max_prompt_length` (`Encoder.fit_prompt`)
        prompt_text  str        the rendered prompt (before truncation)
        row          int        1-based row in the source (split index for the built-in task)
        answer       any        ground truth, when known (built-in task, or the `data.answer_key` column)
        columns      dict       the data row's columns (a data file's rows; what a reward server receives)
        messages     list       the prompt's chat messages, before `data.system_prompt` (`rollout.env` renders
                                them again, with its tools)

    From a prompt-only file, or the prompts of a preference file (identical prompts kept once; response
    fields are not validated). `data.path=null` uses the built-in ppo_train / ppo_eval splits.
    """
    _check_splits((split,))
    encoder = Encoder(tokenizer, data_cfg.chat_template, data_cfg.system_prompt)
    if data_cfg.reasoning_gym.tasks:
        chosen, sources, unused = _reasoning_gym_select(data_cfg, split)
    elif data_cfg.path is None:
        chosen, sources, unused = _builtin_select(data_cfg, "prompts", {"train": "ppo_train", "eval": "ppo_eval"},
                                                  (split,))
    else:
        def load(path: str) -> _Parsed:
            parsed = _parse_source(path, data_cfg, "prompts")
            _dedupe_prompts(parsed)
            return parsed

        chosen, sources, unused = _select(data_cfg, load, (split,), want="prompts")
    summary = _summary(sources, encoder)
    summary.unused = unused
    drops: Counter = Counter(summary.dropped)
    keep, rendered, segments = _render(encoder, chosen[split], data_cfg, drops, summary.source)
    items = [chosen[split][i] for i in keep]
    ids = encoder.encode_segments(segments)
    out = []
    for (row, prompt), text, p_ids in zip(items, rendered, ids):
        cut = encoder.fit_prompt(prompt, p_ids, data_cfg.max_prompt_length)
        if cut is None:
            drops[PROMPT_TOO_LONG] += 1
            continue
        summary.truncated += cut != p_ids
        ex: dict[str, Any] = {"prompt_ids": cut, "prompt_text": text, "row": row,
                              "messages": [dict(m) for m in prompt.messages]}  # rollout.env renders them again
        if prompt.answer is not None:
            ex["answer"] = prompt.answer
        if prompt.columns is not None:
            ex["columns"] = prompt.columns
        out.append(ex)
    summary.dropped = dict(drops)
    summary.kept[split] = len(out)
    summary.lengths = lengths_summary([len(x) for x in ids])
    logger.info(summary.line())
    return PromptData(out, summary)
