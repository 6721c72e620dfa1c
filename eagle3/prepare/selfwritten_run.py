"""Stage 01's side of the self-written source (eagle3/prepare/selfwritten.py): the template check
before the stage starts, the target loaded once for every self-written dataset, each dataset's
rounds written and resumed (one dataset after another in process; on SGLang servers every
dataset's rounds together, in one event loop, over one generator's requests in flight), its
conversations handed to 01 as a local source, and `heldout.jsonl` placed beside its output.

Files, under `01_prepared/.self_written/<dataset>/<fingerprint>/`: `round_NNNN.json` (one per
round, written whole), `conversations.jsonl` (`{"id", "messages"}` a line, read by 01 with the
`openai` adapter like any local file), `heldout.jsonl` (conversation records of one user turn,
which 05 `--prompt-sets` reads) and `stats.json` (the manifest entry). The fingerprint covers the
recipe entry, the tokenizer and template, the model's files, the backend and, for `hf`, dtype,
device type and batch size (which change the sampled numbers): a changed one starts over (the
old rounds are dropped, logged).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.core.chat import ChatRenderer
from eagle3.core.faults import StopSignals
from eagle3.core.server import ServerError, gather_or_cancel
from eagle3.core.stage import atomic_write_bytes, atomic_write_json
from eagle3.prepare.config import PrepareConfig
from eagle3.prepare.opening import TemplateCutError, derive_opening
from eagle3.prepare.recipes import DatasetSpec, Recipe, RecipeError
from eagle3.prepare.rows import json_line
from eagle3.prepare.selfwritten import (
    ConcurrentGenerator,
    SelfWriter,
    SelfWrittenError,
    WriterState,
)
from eagle3.prepare.steer import check_steer

log = logging.getLogger(__name__)

CACHE_DIR = ".self_written"  # under 01_prepared/: no dataset name starts with a dot
HELDOUT = "heldout.jsonl"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class SelfWritten:
    """One dataset's written files and its manifest entry."""

    conversations: Path
    heldout: Path
    info: dict


def check_self_written(recipe: Recipe, renderer: ChatRenderer) -> None:
    """Every self-written dataset's template cut, before any folder is made (RecipeError)."""
    for spec in recipe.datasets:
        if spec.self_written is not None:
            try:
                derive_opening(renderer, spec.self_written.system)
                if spec.self_written.steer is not None:
                    check_steer(renderer, spec.self_written.steer)
            except TemplateCutError as e:
                raise RecipeError(f"recipe {recipe.name}: dataset {spec.name} (self_written): "
                                  f"{e}") from e


def write_self_written(cfg: PrepareConfig, stage_dir: Path, specs: list[DatasetSpec],
                       renderer: ChatRenderer, render_fp: str) -> dict[str, SelfWritten]:
    """Write (or finish, or reuse) every self-written dataset; the target loads at most once.
    In process (`hf`) one dataset after another; on SGLang servers every dataset's rounds in one
    event loop, sharing the server generator's requests in flight, so that no dataset waits for
    another's last replies (a failure in one stops them all; each keeps its finished rounds)."""
    generator = _LazyGenerator(cfg, renderer)
    with StopSignals() as stop:
        writers = [open_writer(cfg, stage_dir, spec, renderer, render_fp, generator)
                   for spec in specs]
        if cfg.gen_backend == "sglang":
            written = asyncio.run(_write_together(writers, generator, cfg.gen_backend, stop))
        else:
            written = []
            for w, fp in writers:
                with _server_failure(w.name):
                    st = w.run(stop)
                written.append(_finish(w, st, fp, cfg.gen_backend))
    return {w.name: sw for (w, _), sw in zip(writers, written, strict=True)}


def open_writer(cfg: PrepareConfig, stage_dir: Path, spec: DatasetSpec, renderer: ChatRenderer,
                render_fp: str, generator: "_LazyGenerator") -> tuple[SelfWriter, str]:
    """(the dataset's writer over its cache folder, the folder's fingerprint); the folders of
    other fingerprints (a changed entry, target or setting) are dropped."""
    fp = fingerprint(cfg, spec, render_fp)
    root = Path(stage_dir) / CACHE_DIR / spec.name
    for old in sorted(root.iterdir()) if root.is_dir() else []:
        if old.name != fp:
            log.warning("%s: recipe entry, target or generation settings changed: "
                        "dropping the self-written rounds of %s", spec.name, old.name)
            shutil.rmtree(old)
    writer = SelfWriter(spec.name, spec.self_written, renderer, root / fp, count=spec.count,
                        seed=spec.seed, max_seq_len=spec.max_seq_len,
                        batch_size=cfg.gen_batch_size, load_generator=generator.get)
    return writer, fp


async def _write_together(writers: list[tuple[SelfWriter, str]], generator: "_LazyGenerator",
                          backend: str, stop: StopSignals) -> list[SelfWritten]:
    async def one(writer: SelfWriter, fp: str) -> SelfWritten:
        with _server_failure(writer.name):
            st = await writer.run_async(stop)
        return _finish(writer, st, fp, backend)

    try:
        return await gather_or_cancel(one(w, fp) for w, fp in writers)
    finally:
        await generator.aclose()


@contextmanager
def _server_failure(name: str):
    """A server's failure as the stage's one-line error naming the dataset."""
    try:
        yield
    except ServerError as e:
        raise SelfWrittenError(f"{name}: the generation server failed ({e}); restart it and "
                               "re-run the same command to resume") from e


def _finish(writer: SelfWriter, st: WriterState, fp: str, backend: str) -> SelfWritten:
    """A dataset's files once its rounds are done: conversations, held-out prompts, stats."""
    cache = writer.cache
    written = SelfWritten(cache / "conversations.jsonl", cache / HELDOUT,
                          {**writer_summary(writer), "fingerprint": fp, "backend": backend,
                           "heldout_file": HELDOUT})
    atomic_write_bytes(written.conversations, b"".join(json_line(c) for c in st.conversations))
    atomic_write_bytes(written.heldout, b"".join(json_line(h) for h in st.heldout))
    atomic_write_json(cache / "stats.json", written.info)
    return written


def place_heldout(written: SelfWritten, out_dir: Path) -> None:
    """`heldout.jsonl` beside the dataset's conversations.jsonl (written whole)."""
    atomic_write_bytes(Path(out_dir) / HELDOUT, written.heldout.read_bytes())


def fingerprint(cfg: PrepareConfig, spec: DatasetSpec, render_fp: str) -> str:
    """What decides the written conversations: entry, tokenizer, model files, numerics."""
    model = []
    for p in sorted(Path(cfg.target).iterdir()):
        if p.name in ("config.json", "generation_config.json"):
            model.append([p.name, hashlib.sha256(p.read_bytes()).hexdigest()])
        elif p.name.endswith(WEIGHT_SUFFIXES):
            model.append([p.name, p.stat().st_size])
    key = {"entry": spec.content_key(), "render": render_fp, "model": model, "backend": cfg.gen_backend,
           "batch": cfg.gen_batch_size}
    if cfg.gen_backend == "hf":
        key.update(dtype=cfg.dtype, device=cfg.device.split(":")[0])
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def writer_summary(writer: SelfWriter) -> dict:
    """The manifest entry: settings, seed, opening, filter counts and rates, turns, and the
    steer labels of the records written (axis -> label -> records)."""
    st = writer.state
    judged = max(st.judged, 1)
    turns: dict[str, int] = {}
    steered: dict[str, dict[str, int]] = {}
    for c in st.conversations + st.heldout:
        for axis, label in c.get("steer", {}).items():
            steered.setdefault(axis, {})[label] = steered.get(axis, {}).get(label, 0) + 1
    for c in st.conversations:
        n = str(sum(m["role"] == "user" for m in c["messages"]))
        turns[n] = turns.get(n, 0) + 1
    return {"settings": asdict(writer.spec), "count": writer.count, "seed": writer.seed,
            "opening": writer.opening.text, "end_of_turn": writer.opening.end_of_turn,
            "rounds": st.rounds, "candidates": st.candidates, "judged": st.judged,
            "surplus": st.surplus, "kept": st.kept, "keep_rate": round(st.kept / judged, 4),
            "rejected": dict(st.rejected),
            "rejection_rates": {k: round(n / judged, 4) for k, n in st.rejected.items()},
            "conversations": len(st.conversations), "heldout": len(st.heldout),
            "user_turns": dict(sorted(turns.items())), "ended_early": st.ended_early,
            "replies_cut_kept": st.replies_cut_kept,
            "steer_labels": {a: dict(sorted(v.items())) for a, v in sorted(steered.items())},
            "generated_tokens": st.generated_tokens, "seconds": round(st.seconds, 1)}


class _LazyGenerator:
    """The generator, built on the first round that needs it (a resumed run may need none)."""

    def __init__(self, cfg: PrepareConfig, renderer: ChatRenderer):
        self.cfg, self.renderer = cfg, renderer
        self._gen = None

    def get(self):
        if self._gen is None:
            self._gen = build_generator(self.cfg, self.renderer)
        return self._gen

    async def aclose(self) -> None:
        """Close a server generator's session of the running loop (if one was built)."""
        if isinstance(self._gen, ConcurrentGenerator):
            await self._gen.aclose()


def build_generator(cfg: PrepareConfig, renderer: ChatRenderer):
    """FastGenerator over the target loaded in process (`hf`), or the SGLang servers'."""
    tok = renderer.tokenizer
    # Stops: what closes a user turn (the opening's first stop), an assistant turn, and eos.
    stops = list(dict.fromkeys([*derive_opening(renderer, None).stop_ids,
                                renderer.end_of_turn_id]))
    if cfg.gen_backend == "sglang":
        from eagle3.core.target import read_target_info
        from eagle3.prepare.server_generator import ServerGenerator

        return ServerGenerator(cfg.server_url, stops, cfg.gen_batch_size,
                               read_target_info(cfg.target).vocab_size)
    from eagle3.core.target import load_hf_model
    from eagle3.generate.fast import FastGenerator
    from eagle3.generate.jobs import padding_id

    model = load_hf_model(cfg.target, cfg.dtype, cfg.device, cfg.trust_remote_code)
    return FastGenerator(model, stops, padding_id(tok, stops[0]), max_batch=cfg.gen_batch_size)


def summary_rows(name: str, info: dict) -> dict:
    """Lines for 01's summary: kept of judged, rounds, seed, turns; then the rejection rates."""
    turns = ", ".join(f"{n} turn{'s' if n != '1' else ''} {c:,}"
                      for n, c in info["user_turns"].items())
    rates = sorted(((k, v) for k, v in info["rejection_rates"].items() if v),
                   key=lambda kv: -kv[1])
    ended = ", ".join(f"{k} {n}" for k, n in info["ended_early"].items())
    rows = {
        f"  {name} self-written": (
            f"kept {info['kept']:,} of {info['judged']:,} user turns "
            f"({100 * info['keep_rate']:.1f}%) in {info['rounds']} rounds, seed {info['seed']}, "
            f"T {info['settings']['temperature']}; {info['heldout']:,} held out; "
            f"{turns or 'no conversation'}"),
        f"  {name} rejected": ", ".join(f"{k} {100 * v:.1f}%" for k, v in rates) or "none",
    }
    if ended:
        rows[f"  {name} ended early"] = ended
    return rows
