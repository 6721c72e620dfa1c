"""eagle3/bench/sse.py against the WHATWG standard's own examples (HTML, 9.2.6 "Interpreting an
event stream"), each fed whole, byte by byte and with every line end the standard allows; and
the readers 05's clients build on it (`message_data`, `json_chunk`)."""

from __future__ import annotations

import asyncio

import pytest

from eagle3.bench.sse import Event, SSEError, SSEParser, json_chunk, message_data

# (stream, the events it dispatches): the standard's examples, verbatim.
EXAMPLES = [
    ("data: YHOO\ndata: +2\ndata: 10\n\n", [Event("YHOO\n+2\n10")]),
    (": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\n"
     "data:  third event\n\n",
     [Event("first event", id="1"), Event("second event", id=""), Event(" third event")]),
    ("data\n\ndata\ndata\n\ndata:", [Event(""), Event("\n")]),
    ("data:test\n\ndata: test\n\n", [Event("test"), Event("test")]),
    ("event: add\ndata: 73857293\n\nevent: remove\ndata: 2153\n\nevent: add\n"
     "data: 113411\n\n",
     [Event("73857293", "add"), Event("2153", "remove"), Event("113411", "add")]),
]


def _parse(pieces, **kw) -> list[Event]:
    parser = SSEParser(**kw)
    return [e for piece in pieces for e in parser.feed(piece)]


def _ends(stream: str, end: str) -> bytes:
    return stream.replace("\n", end).encode()


@pytest.mark.parametrize("stream,events", EXAMPLES)
@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_the_standards_examples_whole_and_byte_by_byte(stream, events, end):
    data = _ends(stream, end)
    assert _parse([data]) == events
    assert _parse([data[i:i + 1] for i in range(len(data))]) == events


def test_a_crlf_split_between_pieces_is_one_line_end():
    assert _parse([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]) == [Event("a\nb")]


def test_bom_comments_retry_unknown_fields_and_a_colon_in_the_value():
    data = b"\xef\xbb\xbfretry: 3000\n: keep-alive\nfoo: bar\ndata: {\"a\": \"x:y\"}\n\n"
    for pieces in ([data], [data[:1], data[1:2], data[2:]]):
        assert _parse(pieces) == [Event('{"a": "x:y"}', retry=3000)]
    assert _parse([b"retry: 3s\ndata: x\n\n"]) == [Event("x")]  # not digits: ignored


def test_a_line_past_the_limit_is_an_error_not_a_growing_buffer():
    with pytest.raises(SSEError, match="over 64 bytes"):
        _parse([b"data: " + b"1" * 100], max_line_bytes=64)
    with pytest.raises(SSEError, match="not UTF-8"):
        _parse([b"data: \xff\xfe\n\n"])


class _Body:
    """An aiohttp body (`iter_any`) that yields `pieces`."""

    def __init__(self, pieces):
        self.pieces = pieces

    async def iter_any(self):
        for piece in self.pieces:
            yield piece


def _messages(pieces) -> list[str]:
    async def go():
        return [d async for d in message_data(_Body(pieces))]
    return asyncio.run(go())


def test_message_data_yields_message_events_up_to_done():
    body = (b": hi\r\nevent: ping\r\ndata: {}\r\n\r\ndata: 1\r\n\r\nevent: message\r\n"
            b"data: 2\r\n\r\ndata: [DONE]\r\n\r\ndata: 3\r\n\r\n")
    assert _messages([body]) == ["1", "2"]
    assert _messages([body[i:i + 3] for i in range(0, len(body), 3)]) == ["1", "2"]
    assert _messages([b"data: 1\n\ndata: cut"]) == ["1"]  # the last event never ended


@pytest.mark.parametrize("data,match", [("{cut", "not JSON"), ("[1]", "not a JSON object"),
                                        ('{"error": "overloaded"}', "streamed an error")])
def test_json_chunk_refuses_what_is_not_an_answer_chunk(data, match):
    assert json_chunk('{"a":\n 1}') == {"a": 1}
    with pytest.raises(SSEError, match=match):
        json_chunk(data)
