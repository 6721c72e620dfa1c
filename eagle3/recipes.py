"""Dataset recipes (`datasets/*.json`): which sources, how many samples, regenerate or not.

A recipe is JSON:

    {"name": "demo",
     "datasets": [{"name": "sharegpt_demo", "adapter": "sharegpt",
                   "path": "samples/sharegpt_demo.jsonl", "id_field": "id",
                   "max_samples": null, "regenerate": true, "max_seq_len": 2048}]}

`path` is relative to the recipe file. Rows are read from local JSONL, JSON or Parquet files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

from eagle3.adapters import ADAPTERS


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the recipe, entry and field."""


@dataclass
class DatasetSpec:
    """One source of a recipe."""

    name: str  # folder name under 01_prepared/ and the `source` of its records
    adapter: str  # key of eagle3.adapters.ADAPTERS
    path: Path  # local file (.jsonl, .json, .parquet)
    id_field: str | None = None  # row field holding a stable id; None = content hash
    max_samples: int | None = None  # first N usable rows; None = all
    regenerate: bool = True  # 01b regenerates the responses with the target
    max_seq_len: int = 8192  # context limit in tokens (prompt + response)


@dataclass
class Recipe:
    name: str
    datasets: list[DatasetSpec]


def load_recipe(path: Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist (see datasets/ for the shipped ones)")
    raw = json.loads(path.read_text())
    known = {f.name for f in fields(DatasetSpec)}
    specs = []
    for i, entry in enumerate(raw.get("datasets", [])):
        unknown = set(entry) - known
        if unknown:
            raise RecipeError(f"recipe {path}: dataset {i} has unknown fields {sorted(unknown)}")
        spec = DatasetSpec(**entry)
        if spec.adapter not in ADAPTERS:
            raise RecipeError(
                f"recipe {path}: dataset {spec.name!r} names adapter {spec.adapter!r}; "
                f"known: {sorted(ADAPTERS)}"
            )
        spec.path = (path.parent / spec.path).resolve()
        specs.append(spec)
    if not specs:
        raise RecipeError(f"recipe {path} lists no datasets")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise RecipeError(f"recipe {path}: dataset names repeat: {names}")
    return Recipe(name=raw.get("name", path.stem), datasets=specs)


def iter_rows(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    """Yield (row number, row, error) from a local file; a broken row gives (n, None, reason)."""
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"dataset file {path} does not exist")
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            for n, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    yield n, json.loads(raw.decode("utf-8")), None
                except UnicodeDecodeError as e:
                    yield n, None, f"invalid utf-8: line {n} ({e.reason})"
                except json.JSONDecodeError as e:
                    yield n, None, f"malformed json: line {n} ({e.msg})"
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        for n, row in enumerate(data if isinstance(data, list) else [data], start=1):
            yield n, row, None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for n, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield n, row, None
    else:
        raise RecipeError(f"dataset file {path}: unsupported suffix (use .jsonl, .json, .parquet)")
