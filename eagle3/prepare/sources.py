"""Where a recipe dataset's rows come from: local files or a Hugging Face dataset id.

Local sources are a file, a folder (every supported file under it, sorted) or a glob, of JSONL
(`.jsonl`, also `.json` files holding one object a line), JSON arrays (`.json`) and Parquet
(`.parquet`); `.gz` variants of the JSON formats are read too. Rows are addressed by position
so that a seeded sample and a resumed run read exactly the same rows:

- `RowSource.rows(positions)` reads rows by position (every local source, HF without
  streaming); `RowSource.stream()` reads them in order (HF streaming).
- A row is `(key, payload)`: key `file:line` or `hf-id[split]:index` names it in quarantine
  files; payload is the raw bytes of a JSONL line (parsed later, so that a broken line is
  quarantined rather than fatal) or an already parsed row.

Hugging Face ids load through the optional `datasets` package, imported only when a recipe
names one (`pip install datasets`).
"""

from __future__ import annotations

import bisect
import glob
import gzip
import json
import logging
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from eagle3.core.progress import progress

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, which some editors put before the first row
RawRow = tuple[str, Any]


class SourceError(ValueError):
    """A dataset source that cannot be read; the message names the file, id or field."""


@dataclass
class HFSpec:
    """A Hugging Face dataset to load with `datasets.load_dataset`."""

    id: str
    config: str | None = None
    split: str = "train"
    revision: str | None = None
    streaming: bool = False
    shuffle_buffer: int = 10_000  # streaming + random sample: `IterableDataset.shuffle` buffer


class RowSource:
    """Rows of one dataset, readable by position (`rows`) or in order (`stream`)."""

    name: str = ""

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def random_access(self) -> bool:
        return True

    def rows(self, positions: Sequence[int]) -> list[RawRow]:
        raise NotImplementedError

    def stream(self) -> Iterator[RawRow]:
        yield from self.rows(range(len(self)))


def local_files(path: Path) -> list[Path]:
    """The files a local `path` names: itself, every supported file under a folder, a glob."""
    path = Path(path)
    if any(ch in str(path) for ch in "*?["):
        files = [Path(p) for p in sorted(glob.glob(str(path), recursive=True))]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
    elif path.is_file():
        files = [path]
    else:
        raise SourceError(f"dataset path {path} does not exist (a file, a folder or a glob)")
    bad = [p for p in files if not p.name.endswith(SUFFIXES)]
    if bad:
        raise SourceError(f"dataset file {bad[0]}: unsupported format (use {', '.join(SUFFIXES)})")
    if not files:
        raise SourceError(f"dataset path {path} holds no {', '.join(SUFFIXES)} file")
    return files


class LocalSource(RowSource):
    """Rows of local files, in file order then row order."""

    def __init__(self, path: Path):
        self.name = str(path)
        self.files = local_files(path)
        try:
            self._parts = [_open_file(f) for f in self.files]
        except OSError as e:  # unreadable: permissions, a folder named like a file, ...
            raise SourceError(f"dataset file {e.filename}: cannot be read ({e.strerror})") from e
        self._starts = [0]
        for part in self._parts:
            self._starts.append(self._starts[-1] + len(part))

    def __len__(self) -> int:
        return self._starts[-1]

    def rows(self, positions: Sequence[int]) -> list[RawRow]:
        by_part: dict[int, list[tuple[int, int]]] = {}
        for k, pos in enumerate(positions):
            f = bisect.bisect_right(self._starts, pos) - 1
            by_part.setdefault(f, []).append((k, pos - self._starts[f]))
        out: list[RawRow | None] = [None] * len(positions)
        for f, wanted in by_part.items():
            got = self._parts[f].rows([i for _, i in wanted])
            for (k, _), row in zip(wanted, got):
                out[k] = row
        return out  # type: ignore[return-value]


def _open_file(path: Path):
    name = path.name
    if name.endswith(".parquet"):
        return _ParquetFile(path)
    raw = _read_gzip(path) if name.endswith(".gz") else None
    head = (raw[:4096] if raw is not None else _head(path)).removeprefix(BOM).lstrip()
    if name.endswith((".json", ".json.gz")) and head[:1] == b"[":
        return _JsonArrayFile(path, raw)
    if name.endswith((".json", ".json.gz")) and not _first_line_is_json(
            raw.splitlines() if raw is not None else _lines(path)):
        raise SourceError(f"dataset file {path}: neither a JSON array nor JSON lines")
    if raw is not None:
        return _JsonlLines(path, raw.splitlines(keepends=True))
    return _JsonlFile(path)


def _read_gzip(path: Path) -> bytes:
    """The whole decompressed file; a truncated or non-gzip file is a SourceError naming it."""
    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
        raise SourceError(f"dataset file {path}: not a readable gzip file ({type(e).__name__}: "
                          f"{e}); re-download it, or drop the .gz suffix if it is plain") from e


def _head(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(4096)


def _lines(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        yield from f


def _first_line_is_json(lines) -> bool:
    for k, line in enumerate(lines):
        if line.strip():
            try:
                return isinstance(json.loads(line.removeprefix(BOM) if k == 0 else line), dict)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                return False
    return True  # an empty file: no rows


class _JsonlFile:
    """A JSONL file indexed by line offsets; rows are the raw line bytes."""

    def __init__(self, path: Path):
        self.path = path
        self.offsets = array("q")
        self.lines = array("q")  # 1-based line numbers of non-blank lines
        bar = progress(total=path.stat().st_size, desc=f"index {path.name}", unit="B")
        with path.open("rb") as f, bar:
            pos = 0
            for n, line in enumerate(f, start=1):
                if line.strip():
                    self.offsets.append(pos)
                    self.lines.append(n)
                pos += len(line)
                if n % 65536 == 0:
                    bar.update(pos - bar.n)
            bar.update(pos - bar.n)

    def __len__(self) -> int:
        return len(self.offsets)

    def rows(self, idx: list[int]) -> list[RawRow]:
        out = []
        with self.path.open("rb") as f:
            for i in idx:
                f.seek(self.offsets[i])
                out.append((f"{self.path.name}:{self.lines[i]}", f.readline()))
        return out


class _JsonlLines:
    """JSONL lines held in memory (compressed files)."""

    def __init__(self, path: Path, lines: list[bytes]):
        self.path = path
        self.items = [(n, ln) for n, ln in enumerate(lines, start=1) if ln.strip()]

    def __len__(self) -> int:
        return len(self.items)

    def rows(self, idx: list[int]) -> list[RawRow]:
        return [(f"{self.path.name}:{self.items[i][0]}", self.items[i][1]) for i in idx]


class _JsonArrayFile:
    """A JSON array of row objects, loaded whole (the format allows nothing else)."""

    def __init__(self, path: Path, raw: bytes | None = None):
        self.path = path
        raw = (raw if raw is not None else path.read_bytes()).removeprefix(BOM)
        try:
            self.items = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise SourceError(f"dataset file {path}: not a valid JSON array ({e})") from e
        if not isinstance(self.items, list):
            raise SourceError(f"dataset file {path}: a JSON {type(self.items).__name__}, not "
                              "an array of rows")

    def __len__(self) -> int:
        return len(self.items)

    def rows(self, idx: list[int]) -> list[RawRow]:
        return [(f"{self.path.name}:[{i}]", self.items[i]) for i in idx]


class _ParquetFile:
    """A Parquet file; its table is read on first use and rows taken by position."""

    def __init__(self, path: Path):
        import pyarrow.parquet as pq

        self.path = path
        try:
            self._len = pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses
            raise SourceError(f"dataset file {path}: not a readable Parquet file ({e})") from e
        self._table = None

    def __len__(self) -> int:
        return self._len

    def rows(self, idx: list[int]) -> list[RawRow]:
        import pyarrow.parquet as pq

        if self._table is None:
            self._table = pq.read_table(self.path)
        rows = self._table.take(idx).to_pylist()
        return [(f"{self.path.name}:{i}", r) for i, r in zip(idx, rows)]


class HFSource(RowSource):
    """A Hugging Face dataset (needs the optional `datasets` package)."""

    def __init__(self, spec: HFSpec, seed: int | None):
        try:
            import datasets
        except ImportError as e:
            raise SourceError(
                f"dataset {spec.id!r} is a Hugging Face id, which needs the `datasets` "
                "package: `pip install datasets`, or download it and set `path` in the "
                "recipe instead of `hf_id`") from e
        self.name = f"{spec.id}[{spec.split}]"
        self.spec = spec
        try:
            ds = datasets.load_dataset(spec.id, spec.config, split=spec.split,
                                       revision=spec.revision, streaming=spec.streaming)
        except Exception as e:  # hub, network and config errors all end here
            raise SourceError(f"dataset {spec.id!r} (config {spec.config!r}, split "
                              f"{spec.split!r}) failed to load: {e}") from e
        if spec.streaming and seed is not None:
            ds = ds.shuffle(seed=seed, buffer_size=spec.shuffle_buffer)
        self.ds = ds

    @property
    def random_access(self) -> bool:
        return not self.spec.streaming

    def __len__(self) -> int:
        if self.spec.streaming:
            raise SourceError(f"{self.name}: a streaming dataset has no length")
        return len(self.ds)

    def rows(self, positions: Sequence[int]) -> list[RawRow]:
        batch = self.ds.select(list(positions)).to_list()
        return [(f"{self.name}:{p}", r) for p, r in zip(positions, batch)]

    def stream(self) -> Iterator[RawRow]:
        for i, row in enumerate(self.ds):
            yield f"{self.name}:{i}", row


def open_source(path: Path | None, hf: HFSpec | None, seed: int | None = None) -> RowSource:
    """The source a recipe entry names (exactly one of `path` and `hf`)."""
    if (path is None) == (hf is None):
        raise SourceError("a dataset needs exactly one of `path` and `hf_id`")
    return LocalSource(path) if path is not None else HFSource(hf, seed)


def parse_row(payload: Any) -> tuple[Any, str | None]:
    """(row, None) or (None, reason): JSONL bytes are parsed here, parsed rows pass through.
    A leading BOM is dropped; NaN and Infinity (which Python's json reads) are refused."""
    if not isinstance(payload, (bytes, bytearray)):
        return payload, None
    try:
        return json.loads(bytes(payload).removeprefix(BOM).decode("utf-8"),
                          parse_constant=_refuse_constant), None
    except UnicodeDecodeError as e:
        return None, f"invalid utf-8: byte {e.start} of the line ({e.reason})"
    except json.JSONDecodeError as e:
        return None, f"malformed json: {e.msg} at char {e.pos}"
    except RecursionError:
        return None, "too deeply nested: the line's JSON nests past the parser's limit"
    except _NonFinite as e:
        return None, f"non-finite number: the line holds {e}, which JSON does not allow"


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str):
    raise _NonFinite(name)


def raw_for_quarantine(payload: Any) -> Any:
    """The row as stored in a quarantine line: JSONL bytes decoded (bad bytes escaped)."""
    if isinstance(payload, (bytes, bytearray)):
        return payload.decode("utf-8", "backslashreplace").rstrip("\n")
    return payload  # written with ensure_ascii, so even lone surrogates survive


def describe(source: RowSource) -> dict:
    """Manifest entry for a source (files with sizes, or the HF id and split)."""
    if isinstance(source, LocalSource):
        return {"files": [{"path": str(f), "bytes": f.stat().st_size} for f in source.files],
                "rows": len(source)}
    spec = source.spec
    return {"hf_id": spec.id, "config": spec.config, "split": spec.split,
            "revision": spec.revision, "streaming": spec.streaming}

