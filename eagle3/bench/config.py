"""Stage 05's configuration: every flag of `05_benchmark.py`, its default and its validation,
and what the draft check hands the backends (the door, `eagle3/bench/stage.py`, runs both)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.bench.settings import check_distinct_urls, check_spec_args
from eagle3.core.cli import UpstreamStageFlags, arg
from eagle3.core.preflight import Problem
from eagle3.core.target import TRUST_HELP, check_remote_code

BACKENDS = ("hf", "sglang", "vllm")  # one module each: eagle3/bench/<name>.py
SERVER_BACKENDS = ("sglang", "vllm")
SPEC_DEFAULT = ("--speculative-num-steps 3 --speculative-eagle-topk 1 "
                "--speculative-num-draft-tokens 4")


@dataclass
class BenchmarkConfig(UpstreamStageFlags):
    target: Path | None = arg(None, "target model folder: tokenizer and config (weights for hf)")
    trust_remote_code: bool = arg(False, TRUST_HELP)
    draft: Path | None = arg(None, "draft folder (default: <workdir>/04_train/final; vllm: the "
                                   "folder 04 wrote for it, final_speculators/ or an MLA "
                                   "draft's final/)")
    backend: str = arg("hf", "hf: offline in transformers; sglang, vllm: baseline vs "
                             "speculative servers", choices=list(BACKENDS))
    check_only: bool = arg(False, "run the preflight checks and exit (0 ok, 1 refused)")
    prompt_sets: list[str] = arg(["eval"], "eval, chat, code, math, tools, or JSONL paths")
    num_prompts: int = arg(64, "prompts per set (the first N)")
    max_new_tokens: int = arg(256, "tokens generated per prompt")
    ignore_eos: bool = arg(False, "sglang, vllm: every request generates exactly "
                                  "--max-new-tokens (fixed lengths: the server's ignore_eos); "
                                  "default: each stops at its end of turn (natural lengths)")
    temperature: float = arg(0.0, "0 = greedy; > 0 = sampling (hf: speculative sampling)")
    seed: int = arg(0, "sampling seed (hf backend)")
    steps: list[int] = arg([3, 7], "hf: chain lengths (draft tokens per verify pass); vllm: "
                                   "one value, num_speculative_tokens")
    context_bucket_tokens: int = arg(1024, "hf: width in tokens of the context-length buckets "
                                           "of the acceptance-by-context table")
    device: str = arg("cpu", "hf: torch device")
    dtype: str = arg("float32", "hf: target and draft dtype")
    baseline_url: str | None = arg(None, "sglang: running server without a draft")
    spec_url: list[str] | None = arg(None, "sglang: running servers with this draft (EAGLE3), one "
                                           "URL each, measured one after the other against the "
                                           "one baseline; each labelled from its /server_info "
                                           "(chain 3, tree 4x2/8)")
    launch_args: str | None = arg(None, "sglang, vllm: launch the servers here (the baseline, "
                                        "then each speculative one), one after the other, "
                                        "with these flags (sglang: --model-path, "
                                        "--tp-size ...; vllm: --tensor-parallel-size ..., the "
                                        "model is --target)")
    spec_args: list[str] = arg([SPEC_DEFAULT], "sglang: flags of each launched speculative "
                                               "server, one quoted string a server (05 adds "
                                               "--speculative-algorithm EAGLE3 and the draft), "
                                               "launched one after the other after the "
                                               "baseline")
    port: int = arg(30000, "sglang: port of the launched servers")
    sglang_python: str = arg(sys.executable, "sglang: python that runs sglang.launch_server")
    vllm_python: str = arg(sys.executable, "vllm: python that runs vLLM's api_server (a venv "
                                           "of its own, e.g. .venv-vllm/bin/python)")
    ready_timeout_s: float = arg(3600.0, "sglang, vllm: seconds a launched server may take to "
                                         "load")
    request_timeout_s: float = arg(600.0, "sglang, vllm: seconds one attempt of a request may "
                                          "take (then it is retried)")
    retries: int = arg(3, "sglang, vllm: retries of a request after a server error, timeout, "
                          "cut stream or miscounted answer (backoff doubling from "
                          "--retry-delay-s); then it is listed in failed_requests.jsonl and "
                          "left out of every figure")
    retry_delay_s: float = arg(1.0, "sglang, vllm: first backoff before a retry, seconds")
    max_bad: int = arg(0, "prompt-set lines that cannot be used (bad JSON, torn, no prompt) "
                          "skipped and listed in skipped.jsonl before the stage stops; 0 (the "
                          "default) stops at the first, since a skipped prompt makes the "
                          "figures incomparable with another run's; -1 = no limit")
    concurrency: list[int] = arg([1, 4, 16, 64], "sglang: requests in flight, per level")
    stream: bool = arg(True, "sglang: stream answers (needed for TTFT)")
    sglang_version: str | None = arg(None, "release that will serve the draft, for the layer "
                                           "check without a server (default: both rules)")

    def __post_init__(self):
        if self.request_timeout_s <= 0 or self.retry_delay_s < 0 or self.retries < 0:
            raise ValueError("--request-timeout-s must be positive, --retries and "
                             "--retry-delay-s at least 0")
        if self.max_bad < -1:
            raise ValueError(f"--max-bad must be >= 0, or -1 for no limit; got {self.max_bad}")
        if self.context_bucket_tokens <= 0:
            raise ValueError(f"--context-bucket-tokens must be positive, got "
                             f"{self.context_bucket_tokens}")
        if self.target is not None:
            check_remote_code(self.target, self.trust_remote_code)
        if self.backend == "hf" and self.ignore_eos:
            raise ValueError("--ignore-eos is for the served backends (sglang, vllm): the "
                             "offline evaluator stops each prompt at its end of turn")
        if self.backend == "hf" and self.target is None:
            raise ValueError("--backend hf needs --target (the transformers model folder)")
        attach = self.baseline_url is not None or self.spec_url is not None
        if self.backend == "vllm":
            if self.target is None:
                raise ValueError("--backend vllm needs --target (the served model folder)")
            if len(self.steps) != 1:
                raise ValueError("--backend vllm takes one --steps value (num_speculative_tokens "
                                 "of the speculative server), e.g. --steps 3")
        if self.backend in SERVER_BACKENDS and not self.check_only:
            if attach == (self.launch_args is not None):
                raise ValueError(f"--backend {self.backend} needs either --baseline-url and "
                                 "--spec-url "
                                 "(running servers) or --launch-args (start them here)")
            if attach and (self.baseline_url is None or self.spec_url is None):
                raise ValueError("give both --baseline-url and --spec-url")
        self._check_spec_servers(attach)

    def _check_spec_servers(self, attach: bool) -> None:
        """Several speculative servers (sglang): each given once, by the flag that fits."""
        if isinstance(self.spec_url, str):  # a config built in code with one URL
            self.spec_url = [self.spec_url]
        if isinstance(self.spec_args, str):
            self.spec_args = [self.spec_args]
        if not self.spec_args:
            raise ValueError("--spec-args needs at least one flag string")
        if self.backend != "sglang":
            if self.spec_url is not None and len(self.spec_url) > 1:
                raise ValueError(f"--backend {self.backend} takes one --spec-url")
            return
        if self.spec_url is not None:
            check_distinct_urls(self.spec_url)
        if attach and self.spec_args != [SPEC_DEFAULT] and not self.check_only:
            raise ValueError("--spec-args is for the servers 05 launches (--launch-args); an "
                             "attached server's settings are read from its /server_info")
        check_spec_args(self.spec_args)


@dataclass
class DraftCheck:
    """A backend's check of the draft folder, before any folder is made or server started."""

    problems: list[Problem] = field(default_factory=list)
    layers: str = ""  # the layer report line: which captures the serving engine will read
    captures: list[int] | None = None  # the captures the draft was trained on (None: unknown)
