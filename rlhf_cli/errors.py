"""Every error that is the user's mistake, in one place: the CLI prints it as one line and exits with status 2.

    ConfigError        an invalid configuration (a key, a value, a combination)        ValueError
    DataError          unusable data: names the file, and for a bad row its number and field   ValueError
    ModelSourceError   a model or tokenizer source that cannot be found                  FileNotFoundError
    SaveError          an output that could not be written (disk full, quota, read-only)  OSError
    RewardError        a reward function that raised or returned unusable values          ValueError
    RewardServerError  a reward server that failed or answered unusably (the run stays resumable)  RewardError

`USER_ERRORS` (these and PermissionError, an unwritable output dir) is what `rlhf_cli.cli` catches. This
module imports nothing from the package, so every layer can raise these.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user's configuration is invalid. The message is one line meant for the user."""


class DataError(ValueError):
    """Unusable data. The message is one line for the user naming the file, and for a bad row the
    1-based row number and the field, e.g.

        harmless-base-test.jsonl.gz row 87, field 'chosen': empty final assistant response
        (set data.skip_invalid=true to skip such rows)

    A row-level problem without a field (a line that is not JSON) reads `data.jsonl: row 3: not valid JSON ...`.
    """

    def __init__(self, source: str, detail: str, *, row: int | None = None, field: str | None = None,
                 reason: str | None = None, hint: str | None = None):
        self.source, self.detail, self.row, self.field, self.reason = source, detail, row, field, reason
        where = source
        if row is not None:
            where += f" row {row}" if field is not None else f": row {row}"
        if field is not None:
            where += f", field '{field}'" if row is not None else f" field '{field}'"
        msg = f"{where}: {detail}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)


class ModelSourceError(FileNotFoundError):
    """A model or tokenizer source cannot be found; the message says what to do."""


class SaveError(OSError):
    """An output (checkpoint, final model, pointer file) could not be written: disk full, quota,
    read-only file system... The message is one line for the user; `errno` is the cause's. Whatever the
    write would have replaced is left as it was (atomic writes), so the previous checkpoint stays good."""


class RewardError(ValueError):
    """A reward function (`reward.function`, or the checker) raised, or returned the wrong number of values or a
    non-finite one. The message is one line naming the function and the data row; nothing is trained on it."""


class RewardServerError(RewardError):
    """A reward server (`reward.type=http`) or an LLM judge's endpoint (`reward.type=judge`) that failed after its
    retries, or answered with the wrong count or type of scores. The message is one line naming the URL and what
    came back. The server, not the run, is at fault:
    the run is not marked failed, so that `resume=true` continues it from its last checkpoint once the server is
    up."""


USER_ERRORS = (ConfigError, DataError, ModelSourceError, SaveError, RewardError, PermissionError)
