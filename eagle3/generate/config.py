"""Stage 01b's configuration: every flag of `01b_generate_synthetic.py`, its default and its
validation (the door, `eagle3/generate/stage.py`, runs it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import UpstreamStageFlags, arg
from eagle3.core.target import TRUST_HELP, check_remote_code


@dataclass
class GenerateConfig(UpstreamStageFlags):
    target: Path = arg(help="target model folder (tokenizer + chat template; weights for hf)")
    trust_remote_code: bool = arg(False, TRUST_HELP)
    backend: str = arg("hf", "who generates: sglang (native /generate, exact output ids), "
                             "openai (/v1/chat/completions, reply re-rendered), hf (in process)",
                       choices=["hf", "sglang", "openai"])
    server_url: list[str] = arg(["http://127.0.0.1:30000"], "sglang/openai: server base URLs "
                                "(several: requests are spread over them)")
    pool_policy: str = arg("least_outstanding", "how requests pick a server",
                           choices=["least_outstanding", "round_robin"])
    max_new_tokens: int = arg(2048, "generation budget per reply, tokens (also capped by the "
                                    "dataset's max_seq_len)")
    temperature: float = arg(0.0, "sampling temperature (0 = greedy)")
    thinking: bool = arg(True, "render prompts with thinking on (the served reasoning mode)")
    keep_length: bool = arg(True, "keep replies cut by the length limit (finish_reason "
                                  "'length'); --no-keep-length drops them")
    concurrency: int = arg(200, "sglang/openai: requests in flight over every dataset (one "
                                "pool; 150-200 up to ~10K context)")
    long_concurrency: int = arg(32, "requests in flight in the second, long-context pass (every "
                                    "dataset's long jobs, after all the short ones)")
    long_context_threshold: int = arg(10240, "prompt + budget tokens above which a request "
                                             "runs in the long-context pass")
    max_attempts: int = arg(6, "attempts per record before it goes to failures.jsonl")
    request_timeout_s: float = arg(3600.0, "per-request timeout, seconds")
    retry_delay_s: float = arg(1.0, "first retry backoff, seconds (doubles per attempt, "
                                    "capped at 30s, jittered)")
    server_down_timeout_s: float = arg(1800.0, "stop when no server answers for this long, "
                                               "seconds (also the wait for readiness at start)")
    poll_s: float = arg(5.0, "how often a down or starting server is polled, seconds")
    probe_timeout_s: float = arg(30.0, "how long one poll of a down or starting server waits "
                                       "for its answer, seconds (a slow answer is not a dead "
                                       "server)")
    served_model: str = arg("", "openai: model name to request ('' = first of /v1/models)")
    api_key_env: str = arg("", "openai: name of the environment variable holding the API key "
                               "('' = no key); the key itself is never a flag")
    check_prompt_tokens: bool = arg(True, "openai: fail a record whose usage.prompt_tokens "
                                          "differs from our rendered prompt")
    max_failure_fraction: float = arg(0.01, "largest share of failed records that still "
                                            "completes the stage")
    max_bad: int = arg(10, "damaged lines of the input conversations.jsonl files (torn, not "
                           "JSON, not a conversation record) skipped and listed in "
                           "skipped.jsonl before the stage stops; stage 01 writes none, so any "
                           "is damage: 10 rides over a few in a days-long run and stops early "
                           "on a wrong or corrupt file (0 = stop at the first, -1 = no limit)")
    batch_size: int = arg(8, "hf backend: prompts generated together (a fixed batch; the fast "
                             "engine on a GPU: 256-1024, its cache holds batch x (prompt + "
                             "budget) tokens)")
    # fast: eagle3/generate/fast.py (static KV cache, decode steps replayed from CUDA graphs on
    # a GPU, greedy or sampled; Llama, Qwen2/3, DeepSeek-V3 targets); generate: transformers'
    # model.generate (greedy only, any target), the reference fast is tested against
    hf_engine: str = arg("fast", "hf backend: fast (static KV cache, CUDA-graph decoding, "
                                 "greedy or sampled; Llama, Qwen2/3, DeepSeek-V3) or generate "
                                 "(transformers' generate: greedy, any target)",
                         choices=["fast", "generate"])
    dtype: str = arg("float32", "hf backend: model dtype (float32, bfloat16)")
    device: str = arg("cpu", "hf backend: torch device")

    def __post_init__(self) -> None:
        check_remote_code(self.target, self.trust_remote_code)
        for name in ("max_new_tokens", "batch_size", "concurrency", "long_concurrency",
                     "long_context_threshold", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("request_timeout_s", "server_down_timeout_s", "poll_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (seconds)")
        if self.temperature < 0:
            raise ValueError("--temperature must be >= 0 (0 = greedy)")
        if self.max_bad < -1:
            raise ValueError("--max-bad must be >= 0, or -1 for no limit")
        if not 0 <= self.max_failure_fraction <= 1:
            raise ValueError("--max-failure-fraction must be in [0, 1]")
        if self.backend == "hf" and self.hf_engine == "generate" and self.temperature > 0:
            raise ValueError("--hf-engine generate is greedy only: use --temperature 0 or "
                             "--hf-engine fast")
        if self.api_key_env and self.backend != "openai":
            raise ValueError("--api-key-env is for --backend openai")
