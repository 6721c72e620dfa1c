"""The stored teacher of the fp8-topk layout: top-k draft-vocabulary log-probs of the target.

04's teacher is `softmax(lm_head_hot @ final)` over the draft vocabulary (eagle3/train/ttt.py);
the final state is stored only to compute it. The fp8-topk layout stores the teacher instead
(eagle3/core/hidden_states.py): the K largest draft-vocabulary log-probs with their draft ids,
and the target's full-vocabulary argmax (a target id), which the acceptance estimate needs to
count a miss wherever the target's choice lies outside the draft vocabulary.

Costs `2 * H * (V_draft + V_target)` FLOPs a token (Kimi-K2.5: 2.8 GFLOP, against about 64 GFLOP
for the target's own forward): on a GPU a few percent of 02b, on a CPU impractical at Kimi size.
Computed from the bf16-rounded final state (as training from a bf16 file sees it) in the
lm_head's own dtype (bf16 for Kimi, as the server's logits; float32 for a float32 target), the
log-softmax in float32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.core.hidden_states import TOPK_MAX_DRAFT_VOCAB
from eagle3.core.stage import STAGE_DIRS, require_upstream
from eagle3.vocab.mapping import MAPPING_FILE, hot_ids_from_d2t, vocab_sha256

ROW_BLOCK = 512  # rows per matmul: [512, 163840] float32 logits are 335 MB


class TeacherHead:
    """The target's lm_head (all rows) and the draft vocabulary; `topk(final)` is a file's teacher.

    `lm_head_VH` `[target_vocab, H]`, `d2t` `[draft_vocab]` (target id = draft id + d2t), `k` in
    1..draft_vocab; `device` runs the matmuls.
    """

    def __init__(self, lm_head_VH: torch.Tensor, d2t: torch.Tensor, k: int,
                 device: str | torch.device = "cpu"):
        draft_vocab = d2t.numel()
        if draft_vocab > TOPK_MAX_DRAFT_VOCAB:
            raise ValueError(f"--dtype fp8-topk stores draft ids as int16: the draft vocabulary "
                             f"({draft_vocab}) must be <= {TOPK_MAX_DRAFT_VOCAB} "
                             "(03 --draft-vocab)")
        if not 1 <= k <= draft_vocab:
            raise ValueError(f"--teacher-topk {k}: expected 1..{draft_vocab} "
                             "(the draft vocabulary size)")
        self.k, self.device = k, torch.device(device)
        hot = hot_ids_from_d2t(d2t.to(torch.int64))
        self.full_VH = lm_head_VH.to(self.device)  # its own dtype: bf16 for Kimi (2.3 GB)
        self.hot_VdH = self.full_VH[hot.to(self.device)]
        self.draft_vocab, self.sha = draft_vocab, vocab_sha256(d2t)

    def meta(self) -> dict:
        return {"topk": self.k, "draft_vocab": self.draft_vocab, "vocab_sha256": self.sha}

    @torch.no_grad()
    def topk(self, final_TH: torch.Tensor) -> dict:
        """`teacher_ids` int16 `[T, K]`, `teacher_logprobs` float16 `[T, K]`, `target_top` int32
        `[T]` of the post-norm final states `[T, H]`."""
        ids, logprobs, top = [], [], []
        for start in range(0, final_TH.shape[0], ROW_BLOCK):
            x = final_TH[start:start + ROW_BLOCK].to(self.device, self.full_VH.dtype)
            lp = torch.log_softmax((x @ self.hot_VdH.T).float(), dim=-1)  # the draft vocab
            v, i = lp.topk(self.k, dim=-1, sorted=True)
            ids.append(i.to(torch.int16).cpu())
            logprobs.append(v.to(torch.float16).cpu())
            top.append((x @ self.full_VH.T).argmax(-1).to(torch.int32).cpu())  # target ids
        return {"teacher_ids": torch.cat(ids), "teacher_logprobs": torch.cat(logprobs),
                "target_top": torch.cat(top)}


def load_teacher_head(target: Path, mapping_path: Path, k: int, device: str,
                      lm_head_VH: torch.Tensor | None = None) -> TeacherHead:
    """The TeacherHead of a target folder and a 03 vocab mapping; `lm_head_VH` when the target
    is already loaded (the hf backend), else read from the target's safetensors."""
    from safetensors.torch import load_file

    from eagle3.core.target import load_lm_head

    if not Path(mapping_path).exists():
        raise FileNotFoundError(f"--dtype fp8-topk needs the draft vocabulary: {mapping_path} is "
                                "missing (run 03_build_vocab_mapping.py before 02b)")
    d2t = load_file(str(mapping_path))["d2t"]
    head = lm_head_VH if lm_head_VH is not None else load_lm_head(target)
    return TeacherHead(head.detach(), d2t, k, device)


def maybe_teacher(cfg, model=None) -> TeacherHead | None:
    """The TeacherHead of 02b's `--dtype fp8-topk` (None for the other layouts), from the loaded
    hf model's lm_head when given; `cfg` is 02b's ExtractConfig."""
    if not cfg.topk:
        return None
    vocab = cfg.workdir / STAGE_DIRS["03"]
    require_upstream(vocab, cfg.allow_partial)
    head = model.get_output_embeddings().weight if model is not None else None
    return load_teacher_head(cfg.target, vocab / MAPPING_FILE, cfg.teacher_topk,
                             cfg.teacher_device or cfg.device, head)
