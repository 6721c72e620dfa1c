"""Stage 02b with the `sglang` backend: a concurrent `/generate` client of a patched SGLang server.

The server (patched by `python -m eagle3.extract.patching`, started with `EAGLE3_DUMP_DIR`) writes the
states of every prefilled request whose rid starts with the rid prefix to
`<dump_dir>/<rid>.safetensors` (format in `eagle3/extract/dump_file.py`), from a writer thread
that works off the forward path: the file appears shortly after the answer, and a prompt
prefilled in chunks grows chunk by chunk. For each record this client:

1. sends `/generate` with the record's `input_ids`, `max_new_tokens: 1` and rid = prefix +
   the record id percent-encoded (`+retryN` appended on a retry, so that a retry never reads
   the file of an earlier attempt);
2. checks the answer: its `meta_info.id` is the rid (when given), `cached_tokens == 0` (else
   the radix cache is on: fatal) and `prompt_tokens == len(input_ids)`;
3. waits (up to `--dump-wait-s`) for the dump file to hold the whole prompt (the `num_tokens`
   of its header) and checks it (eagle3/extract/dumps.py): a regular file no larger
   than a dump of the record can be; its rid; its `input_ids` equal to the ids sent (the
   dump's identity: a server that computed another prompt under the rid is caught however
   alike the shapes); the states' dtypes (bf16, or fp8 aux states with their scales in the fp8
   layout); capture layers; and widths: aux `[T, 3H]` and final
   `[T, H]` with H from the target's config.json. A wrong width or layer list is a wrong server
   or target, a dump of an older format (`<rid>.pt`) a server running an older dump module,
   and an fp8 dump for `--dtype bf16` a server with the wrong layout: those stop the run at
   once;
4. splits the aux states into the three `[T, H]` captures, writes `data_<idx>.pt` (same bytes
   as the `hf` backend would write from the same states) and deletes the dump file.
   The dump always holds the bf16 final state; the compact layouts are made here: fp8 aux
   states are quantized here from a bf16 dump (an fp8 dump brings them quantized, same bytes),
   fp8-all quantizes the final state, fp8-topk replaces it by the teacher the client computes
   with the target's lm_head (`--teacher-device`: a GPU beside the server at Kimi size,
   eagle3/extract/teacher.py).

Requests run concurrently (enough in flight to fill the server's prefill batches) on an event
loop; loading, converting and saving run in a few threads. The first record goes alone, as a
probe: if its dump never appears the server is not set up for dumping and the run stops with a
checklist.

Faults, per record. An HTTP 5xx or 429, no answer within the request deadline, or an answer cut
by a closed connection is retried with backoff by the HTTP client (`ClientTuning.retry`); what
still fails, an answer whose `prompt_tokens` is not the record's length or that names another
request, and a dump that is missing, unreadable (truncated), short, of the wrong shape or dtype,
of other tokens, or not a plain file of a dump's size fail the attempt. The record is
tried again, after a backoff and under a new rid, up to `max_attempts` times, then written with
its reasons to `<split>/failures.jsonl` (the stage stays incomplete; a re-run retries it). Every
wait has a deadline: the request timeout (`--request-timeout-s`), `--dump-wait-s`, `--server-wait-s`. States with NaN
or Inf skip the record as bad (`eagle3/extract/checks.py`; not requested again). Files that
fail `--verify-against-hf`, and any the run wrote without verifying them, are removed with their
index lines before the stage stops (VerificationFailed), so that a re-run extracts them again
instead of keeping them as good. A server that is up but does not answer the API (every
attempt of a request an empty or non-JSON 200, or no answer within the request deadline: before
any answer, or for `max_attempts` records in a row) stops the run in one line: it is the
server, not the records. A server that
stops answering (restart, crash) is waited for, its flags are checked again, and the requests in
flight are re-sent without counting against their records. A stop signal lets the records in
flight finish and starts no new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from eagle3.core.hidden_states import SavedFile
from eagle3.core.preflight import PreflightError, raise_on_errors
from eagle3.core.progress import human_bytes
from eagle3.core.server import (
    MODEL_INFO_PATHS,
    PROBE_TIMEOUT_S,
    RetryPolicy,
    ServerError,
    generate,
    get_json,
    get_server_info,
    wait_ready,
)
from eagle3.core.target import TargetInfo
from eagle3.extract import hf, sglang_dump
from eagle3.extract.checks import BadStates
from eagle3.extract.config import ExtractConfig
from eagle3.extract.dump_server import SilenceWatch, check_dump_server
from eagle3.extract.dumps import (
    Expected,
    SampleError,
    check_answer,
    check_dump_dir,
    clean_dump_dir,
    convert_dump,
    make_rid,
    remove_dump,
)
from eagle3.extract.teacher import maybe_teacher
from eagle3.extract.writer import (
    FAILURES_FILE,
    ExtractCounts,
    ExtractError,
    ExtractProgress,
    FailureLog,
    SplitWriter,
    VerificationFailed,
)

log = logging.getLogger(__name__)

PROBE_FLOOR_S = 5.0  # the shortest wait of a flags or readiness probe (see SglangExtractor)
SERVER_FLAGS_RECORDED = ("model_path", "tp_size", "disable_radix_cache", "chunked_prefill_size",
                         "max_prefill_tokens", "enable_mixed_chunk", "cuda_graph_backend_prefill",
                         "disable_piecewise_cuda_graph", "version")


class DumpServerRefused(ExtractError, PreflightError):
    """The dump server's flags make the dump incomplete or wrong (the list and the fixes)."""


@dataclass
class ClientTuning:
    """Client settings that are not flags (the tests shorten them)."""

    poll_s: float = 5.0  # readiness polling while waiting for the server
    # Per-request HTTP retries (None: 0.5 s first backoff, --request-timeout-s per attempt).
    retry: RetryPolicy | None = None

    def resolved(self, cfg: ExtractConfig) -> ClientTuning:
        if self.retry is not None:
            return self
        return ClientTuning(self.poll_s, RetryPolicy(base_delay_s=0.5,
                                                     timeout_s=cfg.request_timeout_s))


def extract(cfg: ExtractConfig, writers: dict[str, SplitWriter], layers: list[int],
            info: TargetInfo, tuning: ClientTuning | None = None) -> tuple[dict, dict]:
    """The backend's door: every split; returns (outputs per split, manifest extras)."""
    verify, teacher = None, maybe_teacher(cfg)
    if cfg.verify_against_hf:
        verify = hf.make_verifier(hf.load_model(cfg), layers, cfg.verify_tolerance, teacher)
    expected = Expected(info.hidden_size, tuple(layers), cfg.target)
    return asyncio.run(extract_sglang(cfg, expected, writers, verify, teacher,
                                      tuning or ClientTuning()))


async def extract_sglang(cfg: ExtractConfig, expected: Expected, writers: dict[str, SplitWriter],
                         verify: Callable | None = None, teacher=None,
                         tuning: ClientTuning | None = None) -> tuple[dict, dict]:
    """Every split through the dump server; returns (outputs per split, manifest extras).

    `verify(writer, idxs)`, when given, checks the first `--verify-against-hf` records of the
    first split before the others are sent. `teacher`: the TeacherHead of `--dtype fp8-topk`
    (the client turns each dump's final state into the stored teacher;
    eagle3/extract/teacher.py).
    """
    outputs, extra = {}, {}
    verify_n = cfg.verify_against_hf
    async with SglangExtractor(cfg, expected, teacher, tuning) as client:
        info = await client.preflight(list(writers.values()))
        for k, (split, writer) in enumerate(writers.items()):
            prog = ExtractProgress(writer, f"02b {split}")
            try:
                counts, report = await client.run_split(writer, prog, verify_n if k == 0 else 0,
                                                         verify)
            finally:
                prog.close()
            outputs[split] = {"samples": len(writer.records), **asdict(counts)}
            if report is not None:
                extra["verify_against_hf"] = report
        extra["server"] = {"url": client.url, "concurrency": client.concurrency,
                           "restarts": client.restarts,
                           "flags": {k: info.get(k) for k in SERVER_FLAGS_RECORDED}}
    # Dumps of failed attempts that the writer landed after the client had moved on.
    if late := clean_dump_dir(cfg.dump_dir, cfg.rid_prefix):
        log.info("removed %d dump files of failed attempts", late)
    return outputs, extra


def auto_concurrency(info: dict, mean_tokens: float) -> int:
    """Requests in flight to keep ~4 prefill batches of the server queued (8 to 256)."""
    budget = max(info.get("max_prefill_tokens") or 16384, info.get("chunked_prefill_size") or 0)
    return int(min(256, max(8, math.ceil(4 * budget / max(mean_tokens, 1.0)))))


class SglangExtractor:
    """One client session: preflight, then `run_split` for each split."""

    def __init__(self, cfg: ExtractConfig, expected: Expected, teacher=None,
                 tuning: ClientTuning | None = None):
        self.cfg, self.expected, self.teacher = cfg, expected, teacher
        self.dtype = cfg.dtype
        self.tuning = (tuning or ClientTuning()).resolved(cfg)
        self.url = cfg.server_url.rstrip("/")
        self.concurrency = cfg.concurrency
        self.restarts = 0
        self._any_success = False
        # Reading the flags and asking whether the server is up wait no longer than a request
        # may (--request-timeout-s), so that a server that holds every connection ends the run
        # within that bound too; but at least PROBE_FLOOR_S, so that a short request deadline
        # does not take a busy server for a dead one.
        self._probe_s = min(PROBE_TIMEOUT_S, max(cfg.request_timeout_s, PROBE_FLOOR_S))
        self._silence = SilenceWatch(self.url, cfg.max_attempts)

    async def __aenter__(self) -> SglangExtractor:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._pool = concurrent.futures.ThreadPoolExecutor(self.cfg.workers, "02b-convert")
        self._restart_lock = asyncio.Lock()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def preflight(self, writers: list[SplitWriter]) -> dict:
        """Server flags and dump directory, before the first request; returns the server info."""
        info = await self._checked_flags(f"dump server {self.url}")
        lengths = [len(w.records[i]["input_ids"]) for w in writers for i in w.pending()]
        if not self.concurrency:
            self.concurrency = auto_concurrency(info, sum(lengths) / max(len(lengths), 1))
            log.info("concurrency %d: ~4 prefill batches of %s tokens in flight",
                     self.concurrency, info.get("max_prefill_tokens") or 16384)
        self._slots = asyncio.Semaphore(self.concurrency)
        check_dump_dir(self.cfg.dump_dir, lengths, self.expected,
                       self.concurrency + 2 * self.cfg.workers)
        stale = clean_dump_dir(self.cfg.dump_dir, self.cfg.rid_prefix)
        if stale:
            log.info("removed %d dump files left by an earlier client", stale)
        return info

    async def _checked_flags(self, what: str) -> dict:
        """The server's `/server_info`, checked for the dump (check_dump_server); an answer that
        is not its flags (an HTML page, no answer) is an ExtractError naming the URL."""
        try:
            info = await get_server_info(self._session, self.url, self._probe_s)
        except ServerError as e:
            raise ExtractError(f"{what}: cannot read its flags: {e}") from None
        if not info:  # SGLang's /server_info always holds its ServerArgs
            raise ExtractError(f"{what}: cannot read its flags: {self.url}/server_info answered "
                               "HTTP 200 with no flags (an empty body or {}): is --server-url "
                               "the patched SGLang server (and port)?")
        try:
            raise_on_errors(check_dump_server(info), what)
        except PreflightError as e:
            raise DumpServerRefused(str(e)) from None
        return info

    async def run_split(self, writer: SplitWriter, prog: ExtractProgress, verify_n: int = 0,
                        verify: Callable | None = None) -> tuple[ExtractCounts, list | None]:
        """Extract every record of the split still without a file; verify the first ones."""
        failures = FailureLog(writer.root / FAILURES_FILE, self.cfg.max_failures)
        pending = writer.pending()
        head = [i for i in pending if i < verify_n]
        try:
            await self._run(head, writer, prog, failures)
            report = None
            if verify is not None and verify_n and not writer.stopping:
                report = await self._verify(writer, verify, verify_n)
            await self._run([i for i in pending if i >= verify_n], writer, prog, failures)
        except BaseException:
            writer.abandon()  # failures.jsonl is already on disk (written at each failure)
            raise
        failures.close(writer)
        return writer.close(), report

    async def _verify(self, writer: SplitWriter, verify: Callable, verify_n: int) -> list:
        """`--verify-against-hf` on the files of the first `verify_n` records; its report.

        Nothing the run wrote stays as good unless it passed: when a file fails, the stage
        stops after removing the files that failed and every file this run wrote that was not
        verified (their index lines too), so that a re-run extracts them again; when the
        verifier itself cannot finish, every file this run wrote is removed before its error
        goes on."""
        idxs = [i for i in range(min(verify_n, len(writer.records))) if i in writer.done]
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, verify, writer, idxs)
        except VerificationFailed as e:  # written, then found wrong: never left as good
            unverified = sorted(writer.written_now - set(idxs))
            removed = writer.discard([*e.idxs, *unverified])
            also = f" and the {len(unverified)} written unverified" if unverified else ""
            raise ExtractError(f"{e} Removed the {len(e.idxs)} files that failed{also} "
                               f"(first: {removed[0]}); the re-run extracts them again") from None
        except BaseException:
            removed = writer.discard(sorted(writer.written_now))
            if removed:
                log.error("verification did not finish: removed the %d files this run wrote "
                          "(first: %s); the re-run extracts them again", len(removed),
                          removed[0])
            raise

    async def _run(self, idxs: list[int], writer: SplitWriter, prog: ExtractProgress,
                   failures: FailureLog) -> None:
        idxs = list(idxs)
        while idxs and not self._any_success and not writer.stopping:  # the probe: one by one
            await self._process(idxs.pop(0), writer, prog, failures, probe=True)
        if not idxs:
            return
        queue = iter(idxs)

        async def worker() -> None:
            for idx in queue:  # one shared iterator: each record is taken once
                if writer.stopping:  # the records in flight finish; no new one starts
                    return
                await self._process(idx, writer, prog, failures)

        # More tasks than request slots: the extra ones hold answered records whose dumps wait
        # for a conversion thread, so the server never idles behind the client.
        n_tasks = min(len(idxs), self.concurrency + 2 * self.cfg.workers)
        tasks = [asyncio.create_task(worker()) for _ in range(n_tasks)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:  # a fatal error stops every other request
                    raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _process(self, idx: int, writer: SplitWriter, prog: ExtractProgress,
                       failures: FailureLog, probe: bool = False) -> None:
        rec = writer.records[idx]
        reasons = []
        for attempt in range(self.cfg.max_attempts):
            if attempt:  # back off: a server that failed this record may be overloaded
                await asyncio.sleep(self.tuning.retry.delay_s(attempt))
            rid = make_rid(self.cfg.rid_prefix, rec["id"], attempt)
            dump = sglang_dump.dump_file_path(self.cfg.dump_dir, rid)
            remove_dump(dump)
            try:
                saved = await self._attempt(rid, dump, rec, functools.partial(writer.save, idx))
            except SampleError as e:
                reasons.append(str(e))
                log.warning("record %s (attempt %d/%d): %s", rec["id"], attempt + 1,
                            self.cfg.max_attempts, e)
                continue
            except BadStates as e:  # the target's own states: a new request gives the same
                self._any_success = True  # the server dumps: the probe has its answer
                writer.skip(idx, str(e))
                return
            finally:
                remove_dump(dump)
                remove_dump(sglang_dump.legacy_dump_path(self.cfg.dump_dir, rid))
            self._any_success = True
            writer.mark_written(idx, len(rec["input_ids"]), saved.bytes, saved.sha256)
            prog.advance(len(rec["input_ids"]), saved.bytes)
            return
        if probe and not self._any_success and reasons[-1].startswith("missing dump"):
            raise ExtractError(self._no_dump_help(rec, reasons[-1]))
        failures.add(idx, rec["id"], reasons)

    async def _attempt(self, rid: str, dump: Path, rec: dict,
                       save: Callable[[dict], SavedFile]) -> SavedFile:
        ids = rec["input_ids"]
        answer = await self._send(rid, ids)
        check_answer(answer, rid, len(ids))
        dump = await self._wait_for_dump(rid, dump, len(ids))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, convert_dump, dump, rid, rec,
                                          self.expected, self.dtype, save, self.teacher)

    async def _wait_for_dump(self, rid: str, dump: Path, num_tokens: int) -> Path:
        """The file to read once the dump holds the whole prompt: the server's writer lands it
        after the answer (chunk by chunk for a chunked prompt); what sits there at the deadline
        is read and judged (a short dump). An older server's `<rid>.pt` is returned as it is."""
        legacy = sglang_dump.legacy_dump_path(self.cfg.dump_dir, rid)
        deadline = time.monotonic() + self.cfg.dump_wait_s
        delay = 0.005
        while True:
            if os.path.lexists(legacy):
                return legacy
            if os.path.lexists(dump):
                held = sglang_dump.peek_num_tokens(dump)  # None: not a v3 header, read it
                if held is None or held >= num_tokens or time.monotonic() > deadline:
                    return dump
            elif time.monotonic() > deadline:
                free = shutil.disk_usage(self.cfg.dump_dir).free
                raise SampleError(f"missing dump: no {dump} {self.cfg.dump_wait_s:.0f}s after "
                                  f"the answer ({human_bytes(free)} free in the dump directory)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _send(self, rid: str, ids: list[int]) -> dict:
        """/generate, riding out server restarts (which do not count against the record)."""
        downs = 0
        while True:
            try:
                async with self._slots:
                    answer = await generate(self._session, self.url, ids, rid,
                                            {"max_new_tokens": 1}, self.tuning.retry)
                self._silence.answered()
                return answer
            except ServerError as e:
                if await self._is_up():
                    self._silence.check(e, rid, self.tuning.retry.timeout_s)
                    raise SampleError(f"server error: {e}"[:500]) from e
                downs += 1
                if downs > self.cfg.max_attempts:
                    raise SampleError(f"server down {downs} times during this request") from e
                await self._wait_for_server()

    async def _is_up(self) -> bool:
        try:
            await get_json(self._session, self.url, MODEL_INFO_PATHS, timeout_s=self._probe_s)
            return True
        except ServerError:
            return False

    async def _wait_for_server(self) -> None:
        async with self._restart_lock:  # one waiter logs and re-checks; the others then pass
            if await self._is_up():
                return
            t0 = time.monotonic()
            log.warning("server %s is not answering; waiting up to %.0fs for it to come back",
                        self.url, self.cfg.server_wait_s)
            try:
                await wait_ready(self._session, self.url, timeout_s=self.cfg.server_wait_s,
                                 poll_s=self.tuning.poll_s, request_timeout_s=self._probe_s)
            except ServerError:
                raise ExtractError(f"server {self.url} did not come back within "
                                   f"{self.cfg.server_wait_s:.0f}s; restart it and re-run "
                                   "this command (the stage resumes)") from None
            await self._checked_flags(f"restarted dump server {self.url}")
            self.restarts += 1
            log.warning("server %s is back after %.0fs; flags checked, re-sending", self.url,
                        time.monotonic() - t0)

    def _no_dump_help(self, rec: dict, reason: str) -> str:
        return (
            f"the first request (record {rec['id']}) produced no dump: {reason}. Check that the "
            "server runs a patched SGLang (python -m eagle3.extract.patching --check); was started with "
            f"EAGLE3_DUMP_DIR={self.cfg.dump_dir} (--dump-dir, same machine) and "
            f"EAGLE3_DUMP_RID_PREFIX unset or {self.cfg.rid_prefix!r} (--rid-prefix); and runs "
            "no prefill CUDA graph (--disable-piecewise-cuda-graph on SGLang <= 0.5.13, "
            "--cuda-graph-backend-prefill disabled later). The server log says why a pass was "
            "skipped (lines with 'eagle3 dump')")
