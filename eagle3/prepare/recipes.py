"""Dataset recipes (`datasets/*.json`): which sources, how many samples, regenerate or not.

A recipe is JSON; `defaults` apply to every dataset entry unless the entry sets the field:

    {"name": "demo",
     "defaults": {"max_seq_len": 2048},
     "datasets": [{"name": "sharegpt_demo", "adapter": "sharegpt",
                   "path": "samples/sharegpt_demo.jsonl", "id_field": "id",
                   "count": null, "regenerate": true}]}

A source is either `path` (relative to the recipe file: a file, a folder or a glob; see
eagle3.prepare.sources) or `hf_id` (+ `hf_config`, `split`, `revision`, `streaming`). The `merge_*` and
`overlength` fields are read by the merge stage through 01's manifest.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from eagle3.prepare.adapters import ADAPTERS
from eagle3.prepare.sources import HFSpec


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the recipe, entry and field."""


@dataclass
class DatasetSpec:
    """One source of a recipe."""

    name: str  # folder name under 01_prepared/ and the `source` of its records
    adapter: str  # key of eagle3.prepare.adapters.ADAPTERS
    path: Path | None = None  # local file, folder or glob, relative to the recipe
    hf_id: str | None = None  # Hugging Face dataset id (needs the `datasets` package)
    hf_config: str | None = None  # HF dataset config (subset) name
    split: str = "train"  # HF split
    revision: str | None = None  # HF revision (commit or tag) to pin
    streaming: bool = False  # HF: stream instead of downloading the whole set first
    id_field: str | None = None  # row field holding a stable id; None = content hash
    count: int | None = None  # conversations wanted (usable, distinct); None = all
    sample: str = "head"  # which rows: "head" (in order) or "random" (seeded permutation)
    seed: int = 0  # seed of the "random" sample
    regenerate: bool = True  # 01b regenerates the last reply with the target
    prompt_only: bool = False  # keep only the prompt (drop the trailing assistant turn)
    max_seq_len: int = 8192  # context limit in tokens (prompt + response)
    drop_system: bool = False  # drop the source's system prompts
    merge_cap: int | None = None  # merge: at most this many records of this source
    merge_weight: float = 1.0  # merge: share of its records kept (<1) or repeats (>1)
    overlength: str = "drop"  # merge: samples over --max-seq-len are "drop"ped or "truncate"d
    description: str = ""  # free text: what the source is, where it comes from

    def __post_init__(self) -> None:
        if self.adapter not in ADAPTERS:
            raise ValueError(f"adapter {self.adapter!r} is unknown; known: {sorted(ADAPTERS)}")
        if (self.path is None) == (self.hf_id is None):
            raise ValueError("set exactly one of `path` (local files) and `hf_id`")
        if self.count is not None and self.count < 1:
            raise ValueError(f"count must be >= 1 or null, got {self.count}")
        if self.sample not in ("head", "random"):
            raise ValueError(f"sample must be 'head' or 'random', got {self.sample!r}")
        if self.prompt_only and not self.regenerate:
            raise ValueError("prompt_only needs regenerate: true (nothing would be supervised)")
        if self.max_seq_len < 16:
            raise ValueError(f"max_seq_len must be >= 16, got {self.max_seq_len}")
        if self.merge_cap is not None and self.merge_cap < 0:
            raise ValueError(f"merge_cap must be >= 0 or null, got {self.merge_cap}")
        if not self.merge_weight > 0:
            raise ValueError(f"merge_weight must be > 0, got {self.merge_weight}")
        if self.overlength not in ("drop", "truncate"):
            raise ValueError(f"overlength must be 'drop' or 'truncate', got {self.overlength!r}")
        if "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name {self.name!r} must be a plain folder name")

    @property
    def mode(self) -> str:
        """keep (replies kept), regenerate, or prompt_only (see eagle3.prepare.conversations)."""
        if not self.regenerate:
            return "keep"
        return "prompt_only" if self.prompt_only else "regenerate"

    @property
    def hf(self) -> HFSpec | None:
        if self.hf_id is None:
            return None
        return HFSpec(self.hf_id, self.hf_config, self.split, self.revision, self.streaming)

    def to_json(self) -> dict:
        d = asdict(self)
        d["path"] = None if self.path is None else str(self.path)
        return d


@dataclass
class Recipe:
    name: str
    datasets: list[DatasetSpec]
    raw: dict = field(default_factory=dict)  # the recipe file as read (for the manifest)


def load_recipe(path: Path) -> Recipe:
    """Parse and check a recipe; every error names the recipe, the entry and the field."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist (see datasets/ for the shipped ones)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"recipe {path}: not valid JSON ({e})") from e
    unknown = set(raw) - {"name", "description", "defaults", "datasets"}
    if unknown:
        raise RecipeError(f"recipe {path}: unknown top-level fields {sorted(unknown)}")
    known = {f.name for f in fields(DatasetSpec)}
    defaults = raw.get("defaults", {})
    if set(defaults) - known:
        raise RecipeError(f"recipe {path}: defaults has unknown fields "
                          f"{sorted(set(defaults) - known)}")
    specs = []
    for i, entry in enumerate(raw.get("datasets", [])):
        label = f"recipe {path}: dataset {i} ({entry.get('name', '?')})"
        unknown = set(entry) - known
        if unknown:
            raise RecipeError(f"{label} has unknown fields {sorted(unknown)}; known: "
                              f"{sorted(known)}")
        try:
            spec = DatasetSpec(**{**defaults, **entry})
        except (TypeError, ValueError) as e:
            raise RecipeError(f"{label}: {e}") from e
        if spec.path is not None:
            spec.path = (path.parent / spec.path).absolute()
        specs.append(spec)
    if not specs:
        raise RecipeError(f"recipe {path} lists no datasets")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise RecipeError(f"recipe {path}: dataset names repeat: {names}")
    return Recipe(name=raw.get("name", path.stem), datasets=specs, raw=raw)
