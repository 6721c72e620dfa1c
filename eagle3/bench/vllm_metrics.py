"""vLLM's acceptance as 05 reads it (eagle3/bench/vllm.py): its Prometheus counters on
`/metrics`, read before and after each level (deltas: only our own requests count), by a
`SpecProbe` that eagle3/bench/measure.py runs around each level.

- `vllm:spec_decode_num_drafts_total`: verify rounds (one per request per step that verified
  drafts); `..._num_draft_tokens_total`; `..._num_accepted_tokens_total`;
  `..._num_accepted_tokens_per_pos_total{position="i"}` (rounds whose draft token i was
  accepted).
- acceptance length = 1 + accepted / drafts: tokens one verify round commits, what the offline
  evaluator reports. Beside it `tokens_per_round` = (completion tokens - one prefill token a
  request) / drafts, counted from the outputs: it equals the acceptance length unless a round
  is cut by `max_tokens` or the end of turn (vLLM counts the drafts accepted there, the output
  drops them) or a step verifies no draft.

A `/metrics` read that fails (HTTP error, garbage, a counter that is NaN, infinite or
negative) is retried like a request, then the level's acceptance figures are None with the
reason in `acceptance_error`; so are deltas that cannot be (`check_counters`: counters gone
backwards after a restart, more accepted than drafted tokens, more than
`num_speculative_tokens` drafted a round, more rounds than output tokens) and a speculative
level without any verify round: never a figure computed from counters that cannot be trusted.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from eagle3.bench.faults import RequestFailed, with_retries
from eagle3.bench.measure import LoadSettings, RequestRecord
from eagle3.core.server import TransientError

log = logging.getLogger(__name__)


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (summed over engines)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)

    def minus(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda xs: list(xs) + [0.0] * (n - len(xs))  # noqa: E731
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted,
                            [a - b for a, b in zip(pad(self.accepted_per_pos),
                                                   pad(other.accepted_per_pos))])


def parse_spec_metrics(text: str) -> SpecCounters:
    """SpecCounters from a Prometheus text exposition (`/metrics`), summed over engines;
    ValueError for a spec-decode counter that is not a finite non-negative number."""
    c = SpecCounters()
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_") and not (
                    math.isfinite(sample.value) and sample.value >= 0):
                raise ValueError(f"{sample.name} is {sample.value}: not a count")
            if sample.name == "vllm:spec_decode_num_drafts_total":
                c.drafts += sample.value
            elif sample.name == "vllm:spec_decode_num_draft_tokens_total":
                c.draft_tokens += sample.value
            elif sample.name == "vllm:spec_decode_num_accepted_tokens_total":
                c.accepted += sample.value
            elif sample.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
    c.accepted_per_pos = [per_pos[i] for i in sorted(per_pos)]
    return c


async def fetch_spec_counters(session: aiohttp.ClientSession, url: str,
                              timeout_s: float = 30.0) -> SpecCounters:
    """One read of `/metrics`; TransientError when it fails or does not parse."""
    try:
        async with session.get(url.rstrip("/") + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise TransientError(f"{url}/metrics: HTTP {resp.status}")
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise TransientError(f"{url}/metrics: {e!r}") from e
    try:
        return parse_spec_metrics(text)
    except (ValueError, KeyError) as e:  # not a Prometheus exposition, or not counts
        raise TransientError(f"{url}/metrics: unusable ({e}): {text[:80]!r}") from e


def check_counters(delta: SpecCounters, records: list[RequestRecord],
                   num_speculative_tokens: int) -> str | None:
    """Why the counter deltas of a level cannot be its own (None when they can): gone backwards,
    more accepted than drafted tokens, more drafted tokens or accepted positions a round than
    the server's `num_speculative_tokens` K (acceptance above K + 1), more rounds than the
    level's output tokens (each round commits at least one), or no round at all."""
    k = num_speculative_tokens
    if min([delta.drafts, delta.draft_tokens, delta.accepted, *delta.accepted_per_pos]) < 0:
        return "the spec-decode counters went backwards (a server restart?)"
    tokens = sum(r.completion_tokens for r in records)
    if not delta.drafts:
        return (f"no verify rounds counted over {len(records)} answers ({tokens} tokens): a "
                "server that does not decode with the draft" if tokens > len(records) else
                "no verify rounds: every answer holds one token (raise --max-new-tokens)")
    problems = []
    if delta.accepted > delta.draft_tokens:
        problems.append(f"{delta.accepted:g} accepted of {delta.draft_tokens:g} drafted tokens")
    if delta.draft_tokens > k * delta.drafts or len(delta.accepted_per_pos) > k:
        problems.append(f"{delta.draft_tokens:g} tokens drafted in {delta.drafts:g} rounds "
                        f"({len(delta.accepted_per_pos)} positions), more than K = {k} a round")
    if any(a > delta.drafts for a in delta.accepted_per_pos):
        problems.append(f"a position accepted in more than the {delta.drafts:g} rounds")
    if delta.drafts > tokens:
        problems.append(f"{delta.drafts:g} rounds for {tokens} output tokens")
    if problems:
        return ("counters that cannot be this level's (" + "; ".join(problems) + "): another "
                "client's requests, or a server that miscounts")
    return None


def acceptance_figures(delta: SpecCounters | None, records, error: str | None = None,
                       num_speculative_tokens: int | None = None) -> dict:
    """The acceptance figures of one level from its counter deltas and its own requests; all
    None (with `acceptance_error`) when the counters could not be read or cannot be the
    level's (`check_counters`, with the server's `num_speculative_tokens`; None: a plain
    server, whose counters stand still)."""
    if delta is not None and num_speculative_tokens is not None:
        error = check_counters(delta, records, num_speculative_tokens)
        delta = None if error else delta
    if delta is None:
        return {"acceptance_length": None, "tokens_per_round": None, "drafts": None,
                "draft_tokens": None, "accepted_tokens": None, "per_position_acceptance": [],
                "acceptance_error": error}
    committed = sum(r.completion_tokens - 1 for r in records if r.completion_tokens > 0)
    drafts = delta.drafts
    return {
        "acceptance_length": 1 + delta.accepted / drafts if drafts else None,
        "tokens_per_round": committed / drafts if drafts else None,
        "drafts": drafts, "draft_tokens": delta.draft_tokens, "accepted_tokens": delta.accepted,
        "per_position_acceptance": [a / drafts for a in delta.accepted_per_pos] if drafts else [],
        "acceptance_error": None,
    }


class SpecProbe:
    """The acceptance figures of a level: vLLM's counters before and after it (each read
    retried per `load`), checked against the server's `num_speculative_tokens` (None: a plain
    server)."""

    def __init__(self, url: str, load: LoadSettings | None = None,
                 num_speculative_tokens: int | None = None):
        self.url, self.num_speculative_tokens = url, num_speculative_tokens
        self.load = load or LoadSettings({}, timeout_s=30.0, retries=0)

    async def read(self) -> SpecCounters | str:
        """The counters, or why they could not be read."""
        async with aiohttp.ClientSession() as session:
            try:
                counters, _ = await with_retries(
                    lambda n: fetch_spec_counters(session, self.url, self.load.timeout_s),
                    self.load.retries, self.load.retry_delay_s, f"{self.url}/metrics")
                return counters
            except RequestFailed as e:
                log.error("%s: acceptance of this level left out", e)
                return str(e)

    async def before(self) -> SpecCounters | str:
        return await self.read()

    async def after(self, before: SpecCounters | str, records: list[RequestRecord],
                    failed: int = 0) -> dict:
        now = await self.read()
        error = next((x for x in (before, now) if isinstance(x, str)), None)
        delta = None if error else now.minus(before)
        retried = sum(1 for r in records if r.attempts > 1)
        if delta is None or not (failed or retried):
            return acceptance_figures(delta, records, error, self.num_speculative_tokens)
        # The counters are the server's: they hold the rounds of every failed attempt too.
        figures = acceptance_figures(delta, records)
        figures["acceptance_length_with_failed_attempts"] = figures["acceptance_length"]
        figures.update(acceptance_length=None, tokens_per_round=None,
                       acceptance_error=f"{failed} failed and {retried} retried requests: the "
                                        "counters include rounds of answers not measured")
        return figures
