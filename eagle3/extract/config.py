"""Stage 02b's configuration: every flag of `02b_extract_hidden_states_sglang.py`, its default
and its validation (the door, `eagle3/extract/stage.py`, runs it; the backends read it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import UpstreamStageFlags, arg
from eagle3.core.hidden_states import DTYPES
from eagle3.core.spool import SPOOL_DIR
from eagle3.core.target import TRUST_HELP, check_remote_code
from eagle3.extract.sglang_dump import DEFAULT_RID_PREFIX

BACKENDS = ("sglang", "hf")  # one module each: eagle3/extract/<name>.py


@dataclass
class ExtractConfig(UpstreamStageFlags):
    target: Path = arg(help="target model folder (config.json; weights for --backend hf and "
                            "--verify-against-hf)")
    trust_remote_code: bool = arg(False, TRUST_HELP)
    backend: str = arg("sglang", "sglang: a patched SGLang dump server; hf: in-process "
                                 "transformers target", choices=list(BACKENDS))
    capture_layers: list[int] = arg([], "capture indices (residual entering layer i); "
                                        "empty = SGLang's default [2, N//2, N-3]")
    dtype: str = arg("bf16", "file layout: bf16; fp8 (aux states e4m3 + per-token scale); "
                             "fp8-all (the final state too); fp8-topk (fp8 aux states and the "
                             "top-k teacher instead of the final state; needs 03 first)",
                     choices=list(DTYPES))
    teacher_topk: int = arg(64, "fp8-topk: draft-vocabulary log-probs stored per token (K)")
    teacher_device: str = arg("", "fp8-topk: torch device of the teacher's lm_head matmuls "
                                  "('' = --device; a GPU at Kimi size)")
    splits: list[str] = arg(["train", "eval"], "merged splits to extract")
    disk_margin: float = arg(0.1, "free disk required beyond the estimate (fraction)")
    accept_failures: bool = arg(False, "complete the stage even if records failed every attempt")
    max_bad: int = arg(100, "records skipped as bad (an invalid merged line, NaN/Inf target "
                            "states; listed in skipped.jsonl) before the stage stops (-1 = no "
                            "limit). Like --max-failures: a few are the data's, hundreds mean "
                            "a systematic fault (another tokenizer or target)")
    server_url: str = arg("http://127.0.0.1:30000", "sglang: the dump server")
    dump_dir: Path | None = arg(None, "sglang: the server's EAGLE3_DUMP_DIR (same machine)")
    rid_prefix: str = arg(DEFAULT_RID_PREFIX, "sglang: the server's EAGLE3_DUMP_RID_PREFIX")
    concurrency: int = arg(0, "sglang: requests in flight (0 = auto, ~4 prefill batches)")
    workers: int = arg(4, "sglang: threads converting dumps into files")
    max_attempts: int = arg(3, "sglang: attempts per record before it counts as failed")
    max_failures: int = arg(100, "sglang: stop when more records failed (-1 = never)")
    dump_wait_s: float = arg(30.0, "sglang: seconds a dump file may lag behind its answer")
    server_wait_s: float = arg(1800.0, "sglang: seconds to wait for a server that went down")
    request_timeout_s: float = arg(600.0, "sglang: seconds one dump request may wait for its "
                                          "answer before it is retried (a prefill of one "
                                          "record: minutes mean a hung server)")
    verify_against_hf: int = arg(0, "sglang: compare the first N samples with the target run "
                                    "in transformers (0 = off)")
    verify_tolerance: float = arg(0.05, "sglang: max relative L2 error in that comparison")
    max_batch_tokens: int = arg(16384, "hf: padded tokens per forward pass")
    max_batch_size: int = arg(64, "hf: records per forward pass (1 = each record alone)")
    model_dtype: str = arg("float32", "hf: dtype the target runs in")
    device: str = arg("cpu", "hf: torch device")
    stream: bool = arg(False, "stream mode: hand the train split to a `04_train.py --stream` "
                              "running at the same time, through --spool, in 04's reading "
                              "order, deleting each file once read (the other splits are "
                              "written as usual first); eagle3/extract/stream.py")
    spool: Path | None = arg(None, "stream: the spool folder (default <workdir>/02b_spool); "
                                   "the same path for 04; a shared filesystem works between "
                                   "an extraction node and a training node")
    stream_wait_s: float = arg(3600.0, "stream: stop with an error after waiting this long "
                                       "for a 04 that has not been heard from")
    spool_gb: float = arg(50.0, "stream: the most the spool holds, GB (1e9 bytes); beyond the "
                                "working window, records are kept for later epochs instead of "
                                "being extracted again")

    def __post_init__(self):
        if self.backend == "hf" or self.verify_against_hf:  # transformers loads the target
            check_remote_code(self.target, self.trust_remote_code)
        if self.backend == "sglang" and self.dump_dir is None:
            raise ValueError("--backend sglang needs --dump-dir: the EAGLE3_DUMP_DIR the patched "
                             "server was started with")
        if not self.rid_prefix:
            raise ValueError("--rid-prefix must not be empty (it keeps other traffic out of "
                             "the dump); use the server's EAGLE3_DUMP_RID_PREFIX")
        if min(self.workers, self.max_attempts, self.max_batch_size) < 1:
            raise ValueError("--workers, --max-attempts and --max-batch-size must be >= 1")
        if self.concurrency < 0 or self.verify_against_hf < 0 or self.disk_margin < 0:
            raise ValueError("--concurrency, --verify-against-hf and --disk-margin must be >= 0")
        if self.max_bad < -1:
            raise ValueError("--max-bad must be >= 0, or -1 for no limit")
        if self.stream and "train" not in self.splits:
            raise ValueError("--stream streams the train split: keep 'train' in --splits")
        if not self.request_timeout_s > 0:
            raise ValueError("--request-timeout-s must be > 0 (seconds)")
        if self.spool_gb <= 0:
            raise ValueError("--spool-gb must be > 0")
        if self.teacher_topk < 1:
            raise ValueError("--teacher-topk must be >= 1 (64 keeps Kimi-K2.5 under 22 KB/token)")

    @property
    def spool_dir(self) -> Path:
        return self.spool if self.spool is not None else self.workdir / SPOOL_DIR

    @property
    def topk(self) -> int:
        """K of the stored teacher; 0 when the layout stores the final state."""
        return self.teacher_topk if self.dtype == "fp8-topk" else 0
