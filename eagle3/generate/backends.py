"""The two server backends of stage 01b: what each sends, and how an answer becomes a record.

`sglang` (native `/generate`): we send the prompt ids our template code rendered, `rid` = the
record id (a retry adds `~retryN`, so that a server still running an abandoned attempt does not
see a duplicate id), greedy unless told otherwise, and the record keeps the exact `output_ids`
the server produced. `meta_info.prompt_tokens` must equal the ids sent (a server that truncated
the prompt would otherwise yield a record whose reply continues a prompt the target never saw).
SGLang answers `meta_info.finish_reason` as a dict, `{"type": "stop", "matched": <id>}` or
`{"type": "length", "length": n}`, or `{"type": "abort", "message": ...}` (retried).
An answer that cannot be the record's is retried (BadAnswer) and never becomes a record: output
ids that are not token ids or lie outside the target's vocabulary (config.json's `vocab_size`),
the answer of another request (`meta_info.id` naming another rid), a count that differs from
`completion_tokens`, exceeds `max_new_tokens` or falls short of the `length` the reply was cut
at, an empty reply, a body without the API's fields (a `prompt_tokens` that is not a count is
none; a null `completion_tokens` is not reported, not a contradiction). These are
eagle3.core.server's `check_generated` and `check_rid`, the checks 05 runs on its answers. A
`text` that disagrees with the ids is named and the ids are taken: they are what the target
produced, the text is informational (a warning; the raw line keeps the text and the reason, from
which the stage lists the record in `<dataset>/text_mismatch.jsonl` and counts it).

The openai backend likewise retries a reply without a finish reason (cut or aborted) and one
longer than `max_tokens`: by `usage.completion_tokens`, and by the tokens of its content and
reasoning, which the target must have generated at least (a server that ignores `max_tokens`
and reports no count).

`openai` (`/v1/chat/completions`): we send the prompt messages and tools with the template
kwargs as `chat_template_kwargs` (vLLM, SGLang and `transformers serve` accept them), keep the
reply's `reasoning_content` (or `reasoning`) and `tool_calls`, and re-render the conversation
with the target's template. The record is the serving prompt followed by the re-rendered reply;
`usage.prompt_tokens` must equal our prompt's length (else the server's template differs). Where
the re-rendered reply can differ from the tokens the server generated:
- decoding drops special tokens the model emitted inside the text, and turns bytes of an
  incomplete UTF-8 character into U+FFFD;
- re-tokenizing text picks the tokenizer's canonical split, not necessarily the model's;
- reasoning and tool-call parsers move text between fields, may strip whitespace, and
  re-serialize tool arguments (key order, spacing);
- a reply without reasoning is rendered with whatever the template puts there (the tiny
  target's: an empty `<think></think>`), whether or not the model emitted it;
- a reply cut by the length limit is rendered closed (`</think>` when cut inside reasoning, and
  the end-of-turn token, which we remove again: the target did not produce it).
Use `sglang` for training data whenever the server has `/generate`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from eagle3.core.chat import ChatRenderer
from eagle3.core.server import (
    BadAnswer,
    RetryPolicy,
    ServerPool,
    TransientError,
    check_generated,
    check_rid,
    finish_kind,
    post_once,
    post_pool_once,
)
from eagle3.generate.jobs import GenerationJob, generated_record

log = logging.getLogger(__name__)

TEXT_MISMATCH = "text_mismatch"  # the raw line's field holding a disagreeing text's reason


class RecordFailure(ValueError):
    """An answer that cannot become a record (not retried); the message is the reason."""


# OpenAI finish reasons of a reply the server finished by itself (TGI says "eos_token").
OPENAI_FINISHED = ("stop", "length", "tool_calls", "function_call", "eos_token", "stop_sequence")
# ... and of one it did not finish: retried, never recorded as a finished reply.
OPENAI_UNFINISHED = (None, "abort", "error")


@dataclass
class SGLangBackend:
    """SGLang's native `/generate`, prompt ids in, exact output ids kept."""

    pool: ServerPool
    end_of_turn_id: int
    policy: RetryPolicy
    temperature: float = 0.0  # 0 = greedy
    vocab_size: int | None = None  # the target's lm_head rows: no output id reaches it
    # ids -> text as SGLang detokenizes them (skip_special_tokens); None: text not compared
    decode: Callable[[list[int]], str] | None = None
    name: str = "sglang"
    probe_path: str = "/model_info"  # any HTTP answer here means the server process is up
    stats: dict = field(default_factory=lambda: {"appended_stop_token": 0,
                                                 "text_mismatch": 0})

    @staticmethod
    def rid(job: GenerationJob, attempt: int) -> str:
        return job.id if attempt == 0 else f"{job.id}~retry{attempt}"

    def payload(self, job: GenerationJob, attempt: int) -> dict:
        rid = self.rid(job, attempt)
        return {"input_ids": job.prompt_ids.tolist(), "rid": rid,
                "sampling_params": {"max_new_tokens": job.max_new_tokens,
                                    "temperature": self.temperature,
                                    "stop_token_ids": [self.end_of_turn_id]}}

    async def request(self, session: aiohttp.ClientSession, job: GenerationJob,
                      attempt: int) -> dict:
        """One attempt; raises TransientError (retry) or ServerError (do not)."""
        return await post_pool_once(session, self.pool, "/generate", self.payload(job, attempt),
                                    self.policy.timeout_s, f"request {job.id}")

    def to_record(self, job: GenerationJob, answer: dict,
                  attempt: int = 0) -> tuple[dict, dict]:
        """(tokenized record, raw answer to keep) of attempt `attempt`'s `/generate` answer;
        BadAnswer (retry) for an answer that cannot be the record's, RecordFailure for one
        that is final."""
        meta, output = answer.get("meta_info"), answer.get("output_ids")
        if not isinstance(meta, dict) or not isinstance(output, list) \
                or type(meta.get("prompt_tokens")) is not int:
            raise BadAnswer(f"malformed answer: no output_ids list or meta_info.prompt_tokens "
                            f"count ({str(answer)[:200]})")
        check_rid(meta, self.rid(job, attempt))
        if meta["prompt_tokens"] != len(job.prompt_ids):
            raise RecordFailure(f"prompt truncated: the server saw {meta['prompt_tokens']} "
                                f"prompt tokens, {len(job.prompt_ids)} were sent (do not start "
                                "the server with --allow-auto-truncate; raise --context-length)")
        reason = meta.get("finish_reason")
        kind = finish_kind(reason)
        if kind == "abort":
            raise TransientError(f"request {job.id} aborted by the server: {reason}")
        if kind not in ("stop", "length"):
            raise RecordFailure(f"unknown finish reason {reason!r}")
        check_output_ids(job, output, meta, reason, self.vocab_size)
        matched = reason.get("matched") if isinstance(reason, dict) else None
        if kind == "stop" and not output and not isinstance(matched, int):
            raise BadAnswer("empty reply: finish_reason stop with no output id and no matched "
                            "stop token")
        if kind == "stop" and isinstance(matched, int) and output[-1:] != [matched]:
            # The stop token the target emitted closes the turn and is supervised
            # (docs/PIPELINE.md); releases that leave it out of output_ids still name it as
            # `matched`.
            output = output + [matched]
            self.stats["appended_stop_token"] += 1
        raw = {"id": job.id, "backend": self.name, "output_ids": output, "finish_reason": kind,
               "meta_info": meta}
        # Last: only an answer that becomes the record is named (a retried one is not).
        mismatch = self._text_mismatch(job, answer.get("text"), output, matched)
        if mismatch is not None:
            raw["text_disagreeing_with_ids"], raw[TEXT_MISMATCH] = answer["text"], mismatch
        return generated_record(job, output, kind), raw

    def _text_mismatch(self, job: GenerationJob, text, output: list[int],
                       matched) -> str | None:
        """The reason (`text mismatch: ...`) when the answer's `text` is not what its ids
        decode to (the ids are kept), else None. The matched stop token is not in SGLang's
        text, and a reply cut inside a character ends in U+FFFD on one side only."""
        if self.decode is None or not isinstance(text, str):  # not reported
            return None
        ids = output[:-1] if isinstance(matched, int) and output[-1:] == [matched] else output
        decoded, said = self.decode(ids).rstrip("\ufffd"), text.rstrip("\ufffd")
        if decoded == said:
            return None
        at = next((i for i, (a, b) in enumerate(zip(decoded, said)) if a != b),
                  min(len(decoded), len(said)))
        self.stats["text_mismatch"] += 1
        if self.stats["text_mismatch"] <= 3:
            log.warning("record %s: the answer's text disagrees with its output_ids (the ids "
                        "are kept; listed in text_mismatch.jsonl)%s", job.id,
                        "; further ones are counted only" if self.stats["text_mismatch"] == 3
                        else "")
        return (f"text mismatch: the answer's text ({len(said)} characters) is not what its "
                f"{len(ids)} output ids decode to ({len(decoded)}), from character {at}: text "
                f"{said[at:at + 40]!r}, ids {decoded[at:at + 40]!r}; the ids are kept")

    async def abort(self, session: aiohttp.ClientSession, job: GenerationJob) -> None:
        """Best effort: ask every server to drop an abandoned request (SGLang `/abort_request`)."""
        for url in self.pool.urls:
            try:
                await post_once(session, url + "/abort_request", {"rid": job.id}, 5.0,
                                f"abort {job.id}")
            except Exception as e:  # noqa: BLE001 - shutting down; the server may be gone
                log.debug("abort of %s on %s failed: %s", job.id, url, e)


def check_output_ids(job: GenerationJob, output: list, meta: dict, reason,
                     vocab_size: int | None = None) -> None:
    """BadAnswer unless the output ids are token ids (non-negative ints, below `vocab_size`)
    whose count agrees with `completion_tokens`, the request's budget and, for a reply cut by
    the limit, its length."""
    n = check_generated(output, meta.get("completion_tokens"), job.max_new_tokens,
                        vocab_size=vocab_size)
    cut_at = reason.get("length") if isinstance(reason, dict) else None
    if finish_kind(reason) == "length" and type(cut_at) is int and cut_at != n:
        raise BadAnswer(f"reply cut short: finish_reason says length {cut_at} but the answer "
                        f"holds {n} output ids")


@dataclass
class OpenAIBackend:
    """Any OpenAI-compatible `/v1/chat/completions`; the reply is re-rendered by our template."""

    pool: ServerPool
    renderer: ChatRenderer
    policy: RetryPolicy
    model: str  # the served model name the server expects in "model"
    temperature: float = 0.0
    api_key: str | None = None
    check_prompt_tokens: bool = True
    name: str = "openai"
    probe_path: str = "/v1/models"
    stats: dict = field(default_factory=dict)

    def payload(self, job: GenerationJob) -> dict:
        body = {"model": self.model, "messages": job.messages,
                "max_tokens": job.max_new_tokens, "temperature": self.temperature,
                "stream": False}
        if job.tools:
            body["tools"] = job.tools
        if self.renderer.template_kwargs:
            body["chat_template_kwargs"] = self.renderer.template_kwargs
        return body

    async def request(self, session: aiohttp.ClientSession, job: GenerationJob,
                      attempt: int) -> dict:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        return await post_pool_once(session, self.pool, "/v1/chat/completions",
                                    self.payload(job), self.policy.timeout_s,
                                    f"request {job.id}", headers)

    def to_record(self, job: GenerationJob, answer: dict,
                  attempt: int = 0) -> tuple[dict, dict]:
        try:
            choice = answer["choices"][0]
            message, finish = choice["message"], choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise BadAnswer(f"malformed answer: no choices[0].message "
                            f"({str(answer)[:200]})") from e
        if not isinstance(message, dict):
            raise BadAnswer(f"malformed answer: choices[0].message is not an object "
                            f"({str(answer)[:200]})")
        if finish in OPENAI_UNFINISHED:  # cut or aborted: never a finished reply
            raise BadAnswer(f"reply not finished: finish_reason {finish!r}")
        if finish not in OPENAI_FINISHED:
            raise RecordFailure(f"unusable finish reason {finish!r}")
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        n_out = usage.get("completion_tokens")
        if type(n_out) is int and n_out > job.max_new_tokens:
            raise BadAnswer(f"wrong token count: usage.completion_tokens {n_out} is more than "
                            f"max_tokens {job.max_new_tokens}")
        if self.check_prompt_tokens and usage.get("prompt_tokens") not in (None,
                                                                           len(job.prompt_ids)):
            raise RecordFailure(
                f"prompt mismatch: the server counted {usage['prompt_tokens']} prompt tokens, "
                f"our template renders {len(job.prompt_ids)}: the server's chat template or "
                "template kwargs differ from --target's (--thinking?)")
        reply = reply_message(message)
        at_least = self.generated_at_least(reply)
        if at_least > job.max_new_tokens:
            raise BadAnswer(f"wrong token count: a reply of at least {at_least} tokens (its "
                            f"content and reasoning) for max_tokens {job.max_new_tokens}: the "
                            "server does not honour max_tokens")
        reason = "length" if finish == "length" else "stop"
        output = self.reply_ids(job, reply, cut_end_of_turn=reason == "length")
        raw = {"id": job.id, "backend": self.name, "message": reply, "finish_reason": finish,
               "usage": usage}
        return generated_record(job, output, reason), raw

    def generated_at_least(self, reply: dict) -> int:
        """Tokens the target generated at least for `reply`: those of its content and reasoning
        text, which it wrote (canonically tokenized; U+FFFD, a character cut by the limit,
        left out). Tool-call arguments are not counted: parsers re-serialize them."""
        tok = self.renderer.tokenizer
        return sum(len(tok.encode(text.replace("\ufffd", ""), add_special_tokens=False))
                   for text in (reply.get("content"), reply.get("reasoning_content"))
                   if isinstance(text, str) and text)

    def reply_ids(self, job: GenerationJob, reply: dict, cut_end_of_turn: bool) -> list[int]:
        """Token ids the template renders for `reply` after the job's serving prompt."""
        try:
            full = self.renderer.render_ids(job.messages + [reply], job.tools,
                                            add_generation_prompt=False)
        except Exception as e:  # jinja errors on odd replies (e.g. a tool call without name)
            raise RecordFailure(f"template cannot render the reply: {e}") from e
        prompt = job.prompt_ids.tolist()
        if full[: len(prompt)] != prompt:
            raise RecordFailure("re-rendered conversation does not begin with the serving "
                                "prompt: the template renders this history differently")
        reply_ids = full[len(prompt):]
        eot = self.renderer.end_of_turn_id
        # The turn ends at its last end-of-turn token; anything a template adds after it is
        # not the target's output.
        end = max((i + 1 for i, t in enumerate(reply_ids) if t == eot), default=len(reply_ids))
        reply_ids = reply_ids[:end]
        if cut_end_of_turn and reply_ids[-1:] == [eot]:
            reply_ids = reply_ids[:-1]
        if not reply_ids:
            raise RecordFailure("empty reply")
        return reply_ids


def reply_message(message: dict) -> dict:
    """The assistant message to re-render: content, reasoning and tool calls of the answer."""
    reply = {"role": "assistant", "content": message.get("content") or ""}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        reply["reasoning_content"] = reasoning
    calls = []
    for k, tc in enumerate(message.get("tool_calls") or []):
        fn = tc.get("function") or {}
        calls.append({"id": tc.get("id") or f"call_{k}", "type": tc.get("type", "function"),
                      "function": {"name": fn.get("name"), "arguments": fn.get("arguments")}})
    if calls:
        reply["tool_calls"] = calls
    return reply

