"""Server-sent events as the WHATWG HTML standard defines them (section 9.2, "Server-sent
events", the event stream interpretation), for 05's streamed answers (SGLang `/generate`, vLLM
`/v1/completions`).

What a legal stream may hold, and what `SSEParser` does with it:
- lines end in CRLF, LF or CR (a CR at the end of one piece and the LF at the start of the next
  are one line end); a UTF-8 BOM at the start of the stream is dropped;
- a line starting with ":" is a comment (`: keep-alive`) and ignored;
- `field: value` (one space after the colon dropped), or `field` alone (empty value); `data`
  lines of one event are joined with "\\n"; `event` names the event type, `id` sets the last
  event id (not with a NUL), `retry` the reconnection time (digits only); other fields are
  ignored;
- an empty line dispatches the event; one whose data buffer is empty is not dispatched, and an
  event cut by the end of the stream (no empty line after it) is never dispatched.

No library for aiohttp is kept up: `httpx-sse` reads httpx responses, `sseclient-py` a blocking
iterator, `aiohttp-sse-client` had its last release in 2021. The parser is proven against the
standard's examples in tests/bench/test_sse.py.

A line longer than `max_line_bytes` (16 MiB: a cumulative SGLang chunk of 32K ids is ~250 KB) is
a `SSEError`, not a buffer that grows until memory runs out.

Both servers send their answer as "message" events whose data is one JSON object, ending with
the data `[DONE]`: `message_data` yields the data of each such event of a response body (other
event types are not the answer's, as for an EventSource's `onmessage`), `json_chunk` parses one
(an `SSEError` for anything but a JSON object, or for an `{"error": ...}` the server streamed).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

MAX_LINE_BYTES = 16 << 20


class SSEError(ValueError):
    """A stream that is not one 05 can read (a line past the size limit, not UTF-8)."""


@dataclass
class Event:
    data: str
    event: str = "message"  # the type: "message" unless an `event` field named one
    id: str = ""  # the last event id when it was dispatched
    retry: int | None = None  # the last `retry` value seen (ms), if any


class SSEParser:
    """Feed the bytes of one response as they come (`feed`), take the events they complete."""

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES):
        self.max_line_bytes = max_line_bytes
        self._buf = b""
        self._skip_lf = False  # the last piece ended in CR: an LF starting the next ends nothing
        self._started = False  # past the BOM check
        self._data: list[str] = []
        self._event = ""
        self.last_id = ""
        self.retry: int | None = None

    def feed(self, piece: bytes) -> Iterator[Event]:
        """The events completed by `piece`."""
        if not piece:
            return
        if self._skip_lf and piece[:1] == b"\n":
            piece = piece[1:]
        self._skip_lf = False
        self._buf += piece
        if not self._started:
            if len(self._buf) < 3 and b"\xef\xbb\xbf".startswith(self._buf):
                return  # maybe a BOM, not whole yet
            self._started = True
            if self._buf.startswith(b"\xef\xbb\xbf"):
                self._buf = self._buf[3:]
        start, buf = 0, self._buf
        cr, lf = buf.find(b"\r"), buf.find(b"\n")
        while cr >= 0 or lf >= 0:
            end = lf if cr < 0 or 0 <= lf < cr else cr
            line, start = buf[start:end], end + 1
            if end == cr:
                if end + 1 < len(buf):
                    start += int(buf[end + 1:end + 2] == b"\n")
                else:
                    self._skip_lf = True  # CR last: its LF may open the next piece
                cr = buf.find(b"\r", start)
            if lf >= 0 and lf < start:
                lf = buf.find(b"\n", start)
            event = self._line(line)
            if event is not None:
                yield event
        self._buf = buf[start:]
        if len(self._buf) > self.max_line_bytes:
            raise SSEError(f"a server-sent event line over {self.max_line_bytes:,} bytes "
                           "without a line end")

    def _line(self, raw: bytes) -> Event | None:
        if len(raw) > self.max_line_bytes:
            raise SSEError(f"a server-sent event line of {len(raw):,} bytes (limit "
                           f"{self.max_line_bytes:,})")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SSEError(f"a server-sent event line that is not UTF-8 ({e})") from None
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self.last_id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self.retry = int(value)
        return None

    def _dispatch(self) -> Event | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return Event("\n".join(data), event or "message", self.last_id, self.retry)


async def message_data(content) -> AsyncIterator[str]:
    """The data of each "message" event of a streamed body (`aiohttp.StreamReader`), up to the
    data `[DONE]`; an event cut by the end of the body is not one."""
    parser = SSEParser()
    async for piece in content.iter_any():
        for event in parser.feed(piece):
            if event.event != "message":
                continue
            if event.data == "[DONE]":
                return
            yield event.data


def json_chunk(data: str) -> dict:
    """One streamed chunk: a JSON object without an `error`."""
    try:
        chunk = json.loads(data)
    except ValueError:
        raise SSEError(f"a streamed chunk that is not JSON: {data[:100]!r}") from None
    if not isinstance(chunk, dict):
        raise SSEError(f"a streamed chunk that is not a JSON object: {data[:100]!r}")
    if "error" in chunk:
        raise SSEError(f"the server streamed an error: {str(chunk['error'])[:300]}")
    return chunk
