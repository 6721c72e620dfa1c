"""Stage 01's configuration: every flag of `01_prepare_datasets.py`, its default and its
validation (the door, `eagle3/prepare/stage.py`, runs it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import StageFlags, arg
from eagle3.core.target import TRUST_HELP, check_remote_code


@dataclass
class PrepareConfig(StageFlags):
    recipe: Path = arg(help="dataset recipe JSON (see datasets/)")
    target: Path = arg(help="target model folder: its tokenizer and chat template render "
                            "every sample (its weights are read only to write a self_written "
                            "dataset with --gen-backend hf)")
    trust_remote_code: bool = arg(False, TRUST_HELP)
    thinking: bool = arg(True, "render with thinking on, the served reasoning mode (must "
                               "match 01b's --thinking)")
    num_workers: int = arg(0, "worker processes (0 = one per CPU core, at most 64)")
    chunk_size: int = arg(1000, "rows per chunk, the unit of parallel work and of resume")
    verify_every: int = arg(100, "re-check 1 in N kept records with the exact, slow "
                                 "tokenization; a difference stops the stage (0 = never)")
    exact_render: bool = arg(False, "tokenize every record the exact, slow way")
    max_loss: float = arg(0.5, "warn (summary and manifest) when a dataset quarantines more "
                               "than this share of the rows read, 0..1; one with no record "
                               "always warns")
    gen_backend: str = arg("hf", "who writes self_written datasets: hf (the target loaded in "
                                 "process, eagle3.generate.fast) or sglang (a server's "
                                 "/generate, for targets too large to load here)",
                           choices=["hf", "sglang"])
    server_url: list[str] = arg(["http://127.0.0.1:30000"], "sglang: server base URLs of the "
                                                            "target")
    gen_batch_size: int = arg(64, "self_written: prompts generated together (hf: one batch; "
                                  "sglang: requests in flight over every dataset); part of what "
                                  "fixes the sampled turns (changing it starts the dataset "
                                  "over)")
    dtype: str = arg("float32", "hf: model dtype", choices=["float32", "bfloat16", "float16"])
    device: str = arg("cpu", "hf: torch device (cuda, cuda:1, cpu)")

    def __post_init__(self) -> None:
        check_remote_code(self.target, self.trust_remote_code)
        if self.num_workers < 0:
            raise ValueError("--num-workers must be >= 0 (0 = one per CPU core)")
        if self.chunk_size < 1:
            raise ValueError("--chunk-size must be >= 1")
        if not 0 <= self.max_loss <= 1:
            raise ValueError("--max-loss must be within 0..1 (a share of the rows read)")
        if self.verify_every < 0:
            raise ValueError("--verify-every must be >= 0 (0 = never)")
        if self.gen_batch_size < 1:
            raise ValueError("--gen-batch-size must be >= 1")
        if not (Path(self.target) / "tokenizer_config.json").is_file():
            raise ValueError(f"--target {self.target}: no tokenizer_config.json there; point "
                             "it at the target model folder")
