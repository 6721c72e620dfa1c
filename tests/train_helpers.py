"""Tiny synthetic training setups for the trainer tests (no target model needed).

Hidden-state files are random but learnable: the aux states and the final state are fixed
random functions of the token at that position, so the draft can learn the teacher's next-token
distribution from them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from eagle3.core import hidden_states as hs
from eagle3.core.stage import atomic_torch_save
from eagle3.draft.model import DraftConfig
from eagle3.train.data import index_files, list_files
from eagle3.train.distributed import DistInfo
from eagle3.train.loop import TrainConfig, TrainData, build_draft, build_runtime, train

ROOT = Path(__file__).resolve().parent.parent

H, VT, VD = 16, 40, 24


def write_dataset(root: Path, n: int, seed: int, lengths=(12, 60), layouts=("bf16",),
                  topk: int = 8) -> None:
    """`n` hidden-state files under `root/shard_00000/` (docs/PIPELINE.md layout); file i in layout
    `layouts[i % len(layouts)]` (fp8-topk: the teacher of tiny_teacher_head(topk))."""
    head = tiny_teacher_head(topk) if "fp8-topk" in layouts else None
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(VT, 4, H, generator=torch.Generator().manual_seed(99))
    for i in range(n):
        T = int(torch.randint(lengths[0], lengths[1], (1,), generator=g))
        ids = torch.randint(0, VT, (T,), generator=g)
        mask = (torch.arange(T) >= T // 3).long()
        states = table[ids]  # [T, 4, H]
        layout = layouts[i % len(layouts)]
        data = hs.pack(ids, mask, [states[:, j] for j in range(3)], states[:, 3],
                       {"id": f"t/{i}", "capture_layers": [2, 4, 5], "final": "post_norm"},
                       layout, head if layout == "fp8-topk" else None)
        atomic_torch_save(data, hs.file_path(root, i))


def write_splits(root: Path, train: int, eval: int) -> Path:
    """A train and an eval split of `write_dataset` files under `root` (seeds 1 and 2)."""
    write_dataset(root / "train", train, seed=1)
    write_dataset(root / "eval", eval, seed=2)
    return root


def tiny_parts(seed: int = 0, kv_heads: int = 1):
    """(draft, embed, teacher) of a 16-wide draft with a 24-id draft vocabulary (`kv_heads=2`:
    every linear layer's sizes are multiples of 16, as FP8 GEMMs need)."""
    dcfg = DraftConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=kv_heads,
                       head_dim=8,
                       intermediate_size=32, vocab_size=VT, draft_vocab_size=VD,
                       target_hidden_size=H, capture_layers=[2, 4, 5])
    hot = torch.arange(VD) + 3
    t2d = torch.zeros(VT, dtype=torch.bool)
    t2d[hot] = True
    draft = build_draft(dcfg, seed, hot - torch.arange(VD), t2d)
    g = torch.Generator().manual_seed(7)
    return draft, torch.randn(VT, H, generator=g), torch.randn(VD, H, generator=g)


def tiny_lm_head():
    """(full lm_head `[VT, H]` whose draft-vocabulary rows are tiny_parts' teacher, d2t)."""
    _, _, teacher = tiny_parts()
    full = torch.randn(VT, H, generator=torch.Generator().manual_seed(8))
    full[torch.arange(VD) + 3] = teacher
    return full, torch.full((VD,), 3, dtype=torch.long)


def tiny_teacher_head(k: int):
    from eagle3.extract.teacher import TeacherHead

    return TeacherHead(*tiny_lm_head(), k)


def tiny_config(workdir: Path, **overrides) -> TrainConfig:
    base = dict(target=workdir, workdir=workdir, ttt_steps=3, epochs=2, max_seq_len=64,
                pack_tokens=128, lr=3e-3, warmup_steps=2, eval_every=5, save_every=3,
                log_every=1, num_workers=0, seed=0, device="cpu", tensorboard=False)
    base.update(overrides)
    return TrainConfig(**base)


def load_tiny_data(data_root: Path) -> TrainData:
    splits, topk = {}, 0
    for split in ("train", "eval"):
        files = list_files(data_root / split)
        index = index_files(files)
        splits[split] = (files, index.lengths)
        topk = max([topk, *index.topk])
    return TrainData(*splits["train"], *splits["eval"], teacher_topk=topk)


def run_tiny(data_root: Path, out_dir: Path, dist: DistInfo | None = None,
             kill_at_step: int | None = None, kv_heads: int = 1, **overrides):
    """Train the tiny draft; returns (summary, draft). `kill_at_step`: SIGKILL this process
    right after the optimizer update of that step (a crash mid-epoch, no cleanup)."""
    torch.set_num_threads(1)
    if kill_at_step is not None:
        calls = {"n": 0}
        original = torch.optim.AdamW.step

        def step_then_die(self, *a, **kw):
            out = original(self, *a, **kw)
            calls["n"] += 1
            if calls["n"] == kill_at_step + 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        torch.optim.AdamW.step = step_then_die
    cfg = tiny_config(out_dir, **overrides)
    draft, embed, teacher = tiny_parts(kv_heads=kv_heads)
    rt = build_runtime(cfg, torch.device("cpu"), dist or DistInfo())
    summary = train(cfg, Path(out_dir), load_tiny_data(data_root), draft, embed, teacher, rt,
                    tiny_lm_head()[0])
    return summary, draft


def first_eval_loss(out_dir: Path) -> float:
    """The first eval loss a run wrote to its metrics.jsonl."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["eval_loss"][0] for r in rows if "eval_loss" in r)


def ddp_worker(rank: int, world: int, data_root: str, out_dir: str, port: int) -> None:
    """One rank of a gloo DDP run (torch.multiprocessing.spawn target)."""
    from eagle3.train import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = DistInfo(rank, world, rank)
    distributed.init(info, "cpu")
    _, draft = run_tiny(Path(data_root), Path(out_dir), dist=info, grad_accum=1)
    if rank == 0:
        torch.save(draft.state_dict(), Path(out_dir) / "draft.pt")
    distributed.shutdown()


if __name__ == "__main__":  # used by the kill-and-resume test: DATA OUT [KILL_AT_STEP]
    kill = int(sys.argv[3]) if len(sys.argv) > 3 else None
    run_tiny(Path(sys.argv[1]), Path(sys.argv[2]), kill_at_step=kill, num_workers=1)
