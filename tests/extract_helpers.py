"""Test data and comparisons for stage 02b: a small merged split folder, output equality."""

from __future__ import annotations

import filecmp
import importlib
import random
import shutil
from pathlib import Path

from eagle3.core.records import JsonlAppender
from eagle3.core.stage import open_stage

STAGE = "02b_hidden_states"
# Lengths around the fake server's chunk size (48) and up to five chunks; ids with characters a
# rid or a file name must escape, and one long enough that its dump file name gets a hash.
LENGTHS = [1, 2, 7, 47, 48, 49, 96, 130, 231, 12, 60, 5, 150, 33, 88, 3, 200, 64, 17, 110]
ODD_IDS = ["sharegpt/a b#1", "tools/x+y%z", "ünï/çødé", "long/" + "z" * 300]


def write_merged(workdir: Path, n_train: int = 20, n_eval: int = 5, vocab: int = 554,
                 seed: int = 0) -> Path:
    """`<workdir>/01c_merged/{train,eval}.jsonl` with a complete manifest; returns workdir."""
    rng = random.Random(seed)
    stage = open_stage(workdir, "01c_merged", {})
    k = 0
    for split, n in (("train", n_train), ("eval", n_eval)):
        with JsonlAppender(stage.dir / f"{split}.jsonl") as out:
            for i in range(n):
                T = LENGTHS[k % len(LENGTHS)]
                rid = ODD_IDS[i] if split == "train" and i < len(ODD_IDS) else f"{split}/r{i}"
                out.write({"id": rid, "source": f"src{i % 2}", "seq_len": T,
                           "input_ids": [rng.randrange(vocab) for _ in range(T)],
                           "loss_mask": [rng.randrange(2) for _ in range(T)]})
                k += 1
    stage.finish(outputs={})
    return workdir


def copy_merged(src_workdir: Path, dst_workdir: Path) -> Path:
    shutil.copytree(src_workdir / "01c_merged", dst_workdir / "01c_merged")
    return dst_workdir


def data_files(workdir: Path) -> list[Path]:
    """Data files of the stage, relative to its folder, sorted."""
    root = workdir / STAGE
    return sorted(p.relative_to(root) for p in root.rglob("data_*.pt"))


def assert_same_outputs(workdir: Path, reference: Path) -> None:
    """The same data files, byte for byte (torch.save is deterministic), and no strays."""
    got, want = data_files(workdir), data_files(reference)
    assert got == want, (set(got) ^ set(want))
    different = [p for p in got if not filecmp.cmp(workdir / STAGE / p, reference / STAGE / p,
                                                   shallow=False)]
    assert not different, different
    strays = [p for p in (workdir / STAGE).rglob("*") if p.is_file()
              and p.name not in ("index.jsonl", "failures.jsonl", "manifest.json")
              and not p.name.startswith("data_")]
    assert not strays, strays


def main_02b():
    return importlib.import_module("02b_extract_hidden_states_sglang").main


def build_vocab(workdir: Path, target: Path, draft_vocab: int = 64) -> None:
    """Stage 03 in `workdir` (the draft vocabulary that `--dtype fp8-topk` needs)."""
    main = importlib.import_module("03_build_vocab_mapping").main
    assert main(["--workdir", str(workdir), "--target", str(target),
                 "--draft-vocab", str(draft_vocab)]) == 0
