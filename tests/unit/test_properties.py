"""Property tests: any input gives a clear error or a result, never an exception that escapes."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from servegate.gateway.errors import BadRequest
from servegate.gateway.parse import parse_request
from servegate.scheduling.flowcontrol import (
    FlowControlSectionError,
    FlowControlSettings,
    FlowQueues,
    QueueFull,
    Ticket,
    from_picker_sections,
)
from servegate.scheduling.flowcontrol.queues import BandLimits
from servegate.scheduling.request import LLMRequest, RequestKind

KINDS = st.sampled_from(list(RequestKind))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = st.sampled_from(
    ["model", "messages", "prompt", "input", "stream", "max_tokens", "max_completion_tokens"]
)
BODIES = st.dictionaries(FIELDS | st.text(max_size=6), JSON, max_size=6)


def check(raw: bytes, kind: RequestKind, headers: dict[str, str]) -> None:
    error: BadRequest | None = None
    try:
        request = parse_request(raw, kind, headers, "rid")
    except BadRequest as exc:
        error = exc
    if error is not None:
        assert error.status == 400 and error.message
        return
    assert isinstance(request, LLMRequest)
    # a passthrough body may omit the model (vLLM defaults it there); every other kind names one
    assert request.model or request.kind is RequestKind.OTHER
    assert request.prompt_tokens >= 0


@given(st.binary(max_size=200), KINDS)
def test_any_bytes_parse_or_400(raw: bytes, kind: RequestKind) -> None:
    check(raw, kind, {})


@given(BODIES, KINDS, st.dictionaries(st.text(max_size=30), st.text(max_size=30), max_size=3))
def test_any_json_object_parses_or_400(
    body: dict[str, Any], kind: RequestKind, headers: dict[str, str]
) -> None:
    check(json.dumps(body).encode(), kind, {k.lower(): v for k, v in headers.items()})


@given(JSON, KINDS)
def test_any_json_value_parses_or_400(value: Any, kind: RequestKind) -> None:
    check(json.dumps(value).encode(), kind, {})


SECTION_KEYS = st.sampled_from(
    ["maxBytes", "maxRequests", "defaultRequestTTL", "priorityBands", "defaultPriorityBand",
     "saturationDetector", "pluginRef", "priority", "queueDepthThreshold"]
)  # fmt: skip


@given(
    st.none() | st.lists(st.text(max_size=20), max_size=3),
    st.none() | st.dictionaries(SECTION_KEYS | st.text(max_size=5), JSON, max_size=4),
    st.none() | st.dictionaries(SECTION_KEYS, JSON, max_size=3),
)
def test_any_flow_control_section_loads_or_says_why(
    gates: list[str] | None, flow: dict[str, Any] | None, top: dict[str, Any] | None
) -> None:
    error: FlowControlSectionError | None = None
    try:
        settings_, _ = from_picker_sections(FlowControlSettings(), gates, flow, top)
    except FlowControlSectionError as exc:
        error = exc
    if error is not None:
        assert str(error)
        return
    assert settings_.default_request_ttl_s >= 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["push", "pop", "remove"]),
        st.integers(-2, 2),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 40),
    ),
    max_size=60,
)


@settings(max_examples=200)
@given(OPS)
def test_queue_accounting_and_order_hold_under_any_operations(
    ops: list[tuple[str, int, str, int]],
) -> None:
    queues = FlowQueues(default_band=BandLimits(4, 100), max_requests=8)
    queued: list[Ticket] = []
    for op, priority, flow, size in ops:
        if op == "push":
            ticket = Ticket(flow=flow, priority=priority, size=size)
            try:
                queues.push(ticket)
                queued.append(ticket)
            except QueueFull:
                pass
        elif op == "pop":
            ticket = queues.pop()
            if ticket is None:
                assert not queued
                continue
            assert ticket.priority == max(t.priority for t in queued)
            queued.remove(ticket)
        elif queued:
            victim = queued[size % len(queued)]
            assert queues.remove(victim)
            queued.remove(victim)
        assert queues.requests == len(queued) <= 8
        assert queues.bytes == sum(t.size for t in queued)
        for band in queues.bands():
            mine = [t for t in queued if t.priority == band.priority]
            assert band.requests == len(mine) <= 4 and band.bytes <= 100
