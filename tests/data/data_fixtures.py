"""Fixtures for the data tests: a DataConfig factory and a writer of small data files.

Test modules import them by name (`from data_fixtures import make_cfg, write`). They are not in a
conftest.py because a second conftest module would shadow tests/conftest.py for `from conftest import`.
"""

import csv
import gzip
import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def make_cfg():
    """make_cfg(**overrides) -> a DataConfig as the CLI builds it (a structured DictConfig)."""
    from omegaconf import OmegaConf

    from rlhf_cli.config import DataConfig

    def make(**overrides: Any):
        cfg = OmegaConf.structured(DataConfig)
        for key, value in overrides.items():
            OmegaConf.update(cfg, key.replace("__", "."), value, merge=False)
        return cfg

    return make


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    """Write rows as .json (an array), .jsonl, .jsonl.gz, .parquet or .csv, chosen by the suffix."""
    name = path.name
    if name.endswith(".jsonl.gz"):
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    elif name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif name.endswith(".csv"):
        cols = list(dict.fromkeys(k for r in rows for k in r))
        with open(path, "w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
    else:
        raise ValueError(name)
    return str(path)


@pytest.fixture
def write(tmp_path):
    """write(name, rows) -> path of a data file in tmp_path."""
    return lambda name, rows: write_rows(tmp_path / name, rows)
