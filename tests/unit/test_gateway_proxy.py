import random

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from servegate.gateway.proxy import (
    forward_headers,
    response_headers,
    usage_from,
    usage_from_sse_tail,
)


def test_forward_headers_strip_hop_by_hop_and_routing() -> None:
    incoming = {
        "Host": "gw",
        "Connection": "keep-alive",
        "Content-Length": "10",
        "Content-Type": "application/json",
        "X-Gateway-Destination-Endpoint": "169.254.169.254:80",
        "x-prefiller-host-port": "1.2.3.4:5",
        "Authorization": "Bearer k",
        "x-session-id": "s1",
    }
    out = forward_headers(incoming, "rid", strip_authorization=True)
    assert out == {"Content-Type": "application/json", "x-session-id": "s1", "X-Request-ID": "rid"}
    kept = forward_headers(incoming, "rid", strip_authorization=False)
    assert kept["Authorization"] == "Bearer k"


def test_response_headers_drop_framing() -> None:
    upstream = CIMultiDictProxy(
        CIMultiDict(
            {
                "Content-Type": "text/event-stream",
                "Transfer-Encoding": "chunked",
                "Date": "x",
                "X-Y": "1",
            }
        )
    )
    assert dict(response_headers(upstream)) == {"Content-Type": "text/event-stream", "X-Y": "1"}


def test_usage_from_the_last_sse_usage_chunk() -> None:
    tail = (
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
        b"data: [DONE]\n\n"
    )
    usage = usage_from_sse_tail(tail)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (5, 2, 4)
    assert usage_from_sse_tail(b'data: {"usage": broken\n\n') is None


def _by_lines(tail: bytes) -> object:
    """The plain reading: the last `data: {` line naming a usage, parsed (or None)."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                return usage_from(orjson.loads(line[6:]))
            except orjson.JSONDecodeError:
                return None
    return None


def test_the_tail_search_reads_what_a_line_by_line_reading_does() -> None:
    pieces = [
        b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 4}}',
        b"data: [DONE]",
        b': "usage" in a comment',
        b'data: {"x": 1}',
        b"",
        b'data: {"usage": {"prompt_tokens": 9}',
        b'data: {"choices":[],"usage":{"prompt_tokens":1,"prompt_tokens_details":'
        b'{"cached_tokens":1}}}\r',
        b"event: x",
        b'"usage"',
    ]
    rng = random.Random(7)
    for _ in range(5000):
        tail = b"\n".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        if rng.random() < 0.3:
            tail = tail[rng.randint(0, len(tail)) :]  # a tail cut mid-line
        assert usage_from_sse_tail(tail) == _by_lines(tail), tail
