"""The patched SGLang server stage 02b dumps hidden states from: its flags, and whether it
answers at all.

Server flags are the keys of SGLang's `/server_info` answer (the `ServerArgs` field names, plus
`version`). Each flag refused here makes the dump silently incomplete or wrong. `SilenceWatch`
tells a server that does not answer the API (hung, or another service on the port) from one
record's bad luck.
"""

from __future__ import annotations

from eagle3.core.preflight import Problem
from eagle3.core.server import NoAnswer, NotJSONAnswer, RetriesExhausted, ServerError
from eagle3.extract.writer import ExtractError


def check_dump_server(info: dict) -> list[Problem]:
    """Flags of a patched SGLang server used to dump hidden states (stage 02b)."""
    problems = []

    def err(msg):
        problems.append(Problem("error", msg))

    if not info.get("disable_radix_cache"):
        err("radix cache is on: cached prefixes are not recomputed, so their states would be "
            "missing. Start the server with --disable-radix-cache")
    if info.get("enable_mixed_chunk"):
        err("--enable-mixed-chunk is on: chunks run in MIXED passes are not dumped. Remove it")
    if info.get("speculative_algorithm"):
        err(f"a speculative draft is loaded ({info['speculative_algorithm']}): target-verify "
            "passes would mix with prefill. Start the dump server without --speculative-*")
    if (info.get("pp_size") or 1) > 1:
        err("pipeline parallelism is on: no rank sees the final state of every layer. Use plain "
            "TP (--pp-size 1)")
    if info.get("enable_two_batch_overlap"):
        err("two-batch overlap splits batches. Remove --enable-two-batch-overlap")
    if info.get("allow_auto_truncate"):
        err("--allow-auto-truncate would cut prompts silently. Remove it")
    # Prefill CUDA graph replays rebuild the batch without request ids: nothing gets dumped.
    if "cuda_graph_backend_prefill" in info:
        if info["cuda_graph_backend_prefill"] not in ("disabled", None):
            err("prefill CUDA graphs are on (cuda_graph_backend_prefill="
                f"{info['cuda_graph_backend_prefill']!r}): start the server with "
                "--cuda-graph-backend-prefill disabled")
    elif "disable_piecewise_cuda_graph" in info and not info["disable_piecewise_cuda_graph"]:
        err("piecewise (prefill) CUDA graphs are on: start the server with "
            "--disable-piecewise-cuda-graph")
    if not info.get("skip_server_warmup", True):
        problems.append(Problem("warning", "server warmup is on; its requests are ignored by the "
                                           "dump (rid prefix), --skip-server-warmup saves time"))
    return problems


class SilenceWatch:
    """Requests of a server that is up (it answers `/model_info`) and answers no `/generate`.

    `check` raises ExtractError (one line naming the server and what it answered) for a request
    whose every attempt of the per-request retries got no answer within the deadline or a 200
    that is not a JSON object (an empty body, a web page), when no request was answered yet or
    for `max_records` records in a row: every other record would wait out the same retries.
    `answered` resets the row. Other failures (an HTTP 500, a cut answer) stay the record's."""

    def __init__(self, url: str, max_records: int):
        self.url, self.max_records = url, max_records
        self.ever_answered = False
        self.silent: set[str] = set()  # records without an answer since the last one

    def answered(self) -> None:
        self.ever_answered = True
        self.silent.clear()

    def check(self, error: ServerError, rid: str, timeout_s: float) -> None:
        if not isinstance(error, RetriesExhausted) or not error.every(NoAnswer, NotJSONAnswer):
            return
        self.silent.add(rid.split("+retry")[0])  # a record's retries are one record
        if self.ever_answered and len(self.silent) < self.max_records:
            return
        n, last = len(error.errors), error.errors[-1]
        if error.every(NotJSONAnswer):
            raise ExtractError(
                f"dump server {self.url} does not answer the API: the {n} attempts of request "
                f"{rid} all came back so (last: {str(last).split(': ', 1)[-1]})"[:700]) from None
        what = ("no request was ever answered" if not self.ever_answered
                else f"{len(self.silent)} records in a row got no answer")
        raise ExtractError(
            f"dump server {self.url} accepts requests but answers none: {n} attempts of "
            f"request {rid} got no answer within --request-timeout-s {timeout_s:g}s ({what}). "
            "It is hung or not the dump server: check its log, restart it and re-run this "
            "command (the stage resumes), or raise --request-timeout-s if one prefill takes "
            "longer") from None
