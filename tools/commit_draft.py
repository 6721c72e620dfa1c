"""Lay out a trained draft as a committed reference folder: the draft, 04's manifest, the
held-out prompts, a manifest of the folder and a sha256 list; or check such a folder.

The folder (tests/fixtures/smollm2_chat_draft/ is the reference SmolLM2 draft that
benchmarks/bench_serve_vllm.py and `make serve-demo` serve):

    final/                 04's draft as SGLang loads it (the offline evaluator, 05 --backend hf)
    (final_speculators/    not committed: the same weights in the speculators layout, which
                           benchmarks/bench_serve_vllm.py writes from final/ for vLLM; one copy
                           of the weights keeps the tree small enough to travel to a device)
    train_manifest.json    04's manifest.json, verbatim (flags, data hashes, eval estimate)
    heldout_chat.jsonl     the held-out chat prompts (a 05 prompt-set JSONL no stage saw)
    manifest.json          where it came from (--source), 04's key figures, every file's bytes
    SHA256SUMS             `<sha256>  <path>` of every file above (`sha256sum -c SHA256SUMS`)

Only the top-level files of final/ are copied (config.json and the
safetensors; never 04's checkpoints). Git refuses files over 100 MB: a file over
MAX_FILE_BYTES stops the helper before anything is written.

    # from a 04 stage folder brought back from the GPU host, in one command:
    python tools/commit_draft.py tests/fixtures/smollm2_chat_draft \
        --from /path/to/run/04_train --prompts /path/to/heldout_chat.jsonl \
        --source "one H200, 2026-12-05: reference/run_reference.py --profile h200-smollm2 ..."
    # a folder whose final/, train_manifest.json and prompts are in place:
    python tools/commit_draft.py tests/fixtures/smollm2_chat_draft --source "..."
    # check the committed folder against its SHA256SUMS (exit 1 naming every difference):
    python tools/commit_draft.py tests/fixtures/smollm2_chat_draft --check
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
from pathlib import Path

from eagle3.bench.draft_files import check_draft_files
from eagle3.core.faults import InputFileError
from eagle3.core.stage import atomic_write_bytes, atomic_write_json, file_sha256

DRAFT_LAYOUTS = ("final",)  # 04's SGLang folder; the vLLM one is derived from it
TRAIN_MANIFEST = "train_manifest.json"
PROMPTS_FILE = "heldout_chat.jsonl"
MANIFEST = "manifest.json"
SUMS = "SHA256SUMS"
MAX_FILE_BYTES = 95_000_000  # under GitHub's 100 MB limit on one file
# 04's figures worth a glance without opening train_manifest.json
TRAIN_ARGS = ("preset", "draft_arch", "epochs", "lr", "max_seq_len", "pack_tokens", "ttt_steps",
              "seed", "precision")
TRAIN_OUTPUTS = ("num_steps", "tokens", "eval_sim_accept", "eval_sim_accept_se",
                 "eval_sim_samples", "eval_sim_rounds", "eval_loop_share")


class DraftFolderError(RuntimeError):
    """A folder that cannot become (or is not) a committed draft; the message says why."""


def folder_files(folder: Path) -> list[str]:
    """Every file under `folder` but SHA256SUMS, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name != SUMS)


def write_sha256_list(folder: Path) -> Path:
    """SHA256SUMS over every file of `folder` (the `sha256sum` format, two spaces)."""
    lines = [f"{file_sha256(folder / rel)}  {rel}\n" for rel in folder_files(folder)]
    atomic_write_bytes(folder / SUMS, "".join(lines).encode())
    return folder / SUMS


def check_sha256_list(folder: Path) -> list[str]:
    """What differs between `folder` and its SHA256SUMS (empty: every file listed, present and
    equal; nothing unlisted)."""
    sums = folder / SUMS
    if not sums.is_file():
        return [f"{sums}: missing"]
    listed: dict[str, str] = {}
    problems = []
    for n, line in enumerate(sums.read_text().splitlines(), start=1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64:
            problems.append(f"{sums}:{n}: not '<sha256>  <path>': {line!r}")
            continue
        listed[rel] = digest
    for rel, digest in listed.items():
        path = folder / rel
        if not path.is_file():
            problems.append(f"{rel}: listed in {SUMS}, missing")
        elif file_sha256(path) != digest:
            problems.append(f"{rel}: sha256 differs from {SUMS}")
    problems += [f"{rel}: not listed in {SUMS}" for rel in folder_files(folder)
                 if rel not in listed]
    return problems


def copy_drafts(src_04: Path, folder: Path) -> None:
    """final/ (its top-level files) and 04's manifest into `folder`."""
    for layout in DRAFT_LAYOUTS:
        if not (src_04 / layout).is_dir():
            raise DraftFolderError(f"{src_04 / layout}: missing; --from must be a 04 stage "
                                   "folder (<workdir>/04_train) holding final/")
    for layout in DRAFT_LAYOUTS:
        out = folder / layout
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for f in sorted((src_04 / layout).iterdir()):
            if f.is_file():
                shutil.copy2(f, out / f.name)
    shutil.copy2(src_04 / "manifest.json", folder / TRAIN_MANIFEST)


def count_prompts(path: Path) -> int:
    """Records of a 05 prompt-set JSONL (each must be an object with messages or input_ids)."""
    n = 0
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not isinstance(rec, dict) or not ({"messages", "input_ids"} & set(rec)):
            raise DraftFolderError(f"{path}:{i}: not a 05 prompt record (messages or input_ids)")
        n += 1
    return n


def folder_manifest(folder: Path, source: str) -> dict:
    """manifest.json of a laid-out folder: source, 04's key figures, prompts, files, bytes."""
    train = json.loads((folder / TRAIN_MANIFEST).read_text())
    if not train.get("complete"):
        raise DraftFolderError(f"{folder / TRAIN_MANIFEST}: 04 did not complete")
    files = {rel: (folder / rel).stat().st_size for rel in folder_files(folder)
             if rel not in (MANIFEST,)}
    args, outputs = train.get("args") or {}, train.get("outputs") or {}
    return {
        "source": source,
        "written": datetime.datetime.now().isoformat(timespec="seconds"),
        "written_by": "tools/commit_draft.py",
        "drafts": {"offline": "final", "vllm": None},  # vLLM's: written from final/
        "prompts": {"file": PROMPTS_FILE, "records": count_prompts(folder / PROMPTS_FILE)},
        "train": {"manifest": TRAIN_MANIFEST, "started": train.get("started"),
                  "seconds": train.get("seconds"), "world_size": train.get("world_size"),
                  "target": args.get("target"), "inputs": train.get("inputs"),
                  "args": {k: args.get(k) for k in TRAIN_ARGS},
                  "outputs": {k: outputs.get(k) for k in TRAIN_OUTPUTS},
                  "draft_config": train.get("draft_config")},
        "files": files,
        "bytes": sum(files.values()),
    }


def lay_out(folder: Path, source: str, src_04: Path | None = None,
            prompts: Path | None = None) -> dict:
    """Copy (when given) and check the drafts and prompts, then write manifest.json and
    SHA256SUMS; returns the manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    if src_04 is not None:
        copy_drafts(src_04, folder)
    if prompts is not None:
        shutil.copy2(prompts, folder / PROMPTS_FILE)
    for need in (*DRAFT_LAYOUTS, TRAIN_MANIFEST, PROMPTS_FILE):
        if not (folder / need).exists():
            raise DraftFolderError(f"{folder / need}: missing (--from a 04 folder brings the "
                                   f"drafts and {TRAIN_MANIFEST}, --prompts the prompts)")
    for layout in DRAFT_LAYOUTS:
        check_draft_files(folder / layout)  # a cut safetensors file, a config without keys
    big = [f"{rel} ({(folder / rel).stat().st_size:,} bytes)" for rel in folder_files(folder)
           if (folder / rel).stat().st_size > MAX_FILE_BYTES]
    if big:
        raise DraftFolderError(f"over {MAX_FILE_BYTES:,} bytes, too large for git: "
                               + ", ".join(big))
    manifest = folder_manifest(folder, source)
    atomic_write_json(folder / MANIFEST, manifest)
    write_sha256_list(folder)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="the draft folder to write (or --check)")
    ap.add_argument("--from", dest="src_04", type=Path, default=None,
                    help="a 04 stage folder (<workdir>/04_train): copy final/ "
                         "and its manifest.json from it")
    ap.add_argument("--prompts", type=Path, default=None,
                    help=f"the held-out prompt set (05 JSONL), copied as {PROMPTS_FILE}")
    ap.add_argument("--source", default=None,
                    help="where the draft was trained (host, date, command), for manifest.json")
    ap.add_argument("--check", action="store_true",
                    help=f"only check the folder against its {SUMS} (exit 1 on a difference)")
    args = ap.parse_args(argv)
    if args.check:
        problems = check_sha256_list(args.folder)
        for p in problems:
            print(f"{args.folder}: {p}", file=sys.stderr)
        print(f"{args.folder}: {'OK' if not problems else f'{len(problems)} problems'}")
        return 1 if problems else 0
    if not args.source:
        ap.error("--source is required when writing a folder (where the draft was trained)")
    try:
        manifest = lay_out(args.folder, args.source, args.src_04, args.prompts)
    except (DraftFolderError, InputFileError, OSError, json.JSONDecodeError) as e:
        print(f"commit_draft: error: {e}", file=sys.stderr)
        return 1
    for rel, size in manifest["files"].items():
        print(f"  {size:>12,}  {rel}")
    print(f"{args.folder}: {manifest['bytes']:,} bytes in {len(manifest['files'])} files (+ "
          f"{MANIFEST}, {SUMS}); {manifest['prompts']['records']} held-out prompts; "
          f"{_estimate(manifest['train'])}")
    print(f"commit it: git add {args.folder} && git commit")
    return 0


def _estimate(train: dict) -> str:
    """04's acceptance estimate on its eval split, with its chain length and loop share."""
    out, steps = train["outputs"], (train.get("args") or {}).get("ttt_steps")
    if out.get("eval_sim_accept") is None:
        return "no 04 estimate"
    loops = out.get("eval_loop_share")
    return (f"04 estimate {out['eval_sim_accept']:.3f} at {steps} steps on its eval split "
            f"(loop share {'-' if loops is None else format(loops, '.0%')}; not a measurement: "
            "05 measures the draft)")


if __name__ == "__main__":
    sys.exit(main())
