import pytest

from servegate.scheduling.flowcontrol import BandLimits, FlowQueues, QueueFull, Ticket


def t(flow: str, priority: int = 0, size: int = 10) -> Ticket:
    return Ticket(flow=flow, priority=priority, size=size)


def drain_flows(q: FlowQueues) -> list[str]:
    return [ticket.flow for ticket in q.drain()]


def test_strict_priority_between_bands() -> None:
    q = FlowQueues()
    for ticket in (t("low", -1), t("mid", 0), t("high", 10), t("mid2", 0)):
        q.push(ticket)
    assert drain_flows(q) == ["high", "mid", "mid2", "low"]


def test_round_robin_between_flows_fcfs_within() -> None:
    q = FlowQueues()
    tickets = [t("a"), t("a"), t("a"), t("b"), t("c"), t("b")]
    for ticket in tickets:
        q.push(ticket)
    order = q.drain()
    # turns: a, b, c, a, b, a — and a's tickets leave in arrival order
    assert [x.flow for x in order] == ["a", "b", "c", "a", "b", "a"]
    assert [x for x in order if x.flow == "a"] == [tickets[0], tickets[1], tickets[2]]


def test_remove_frees_capacity_and_skips_the_ticket() -> None:
    q = FlowQueues(default_band=BandLimits(max_requests=2, max_bytes=100))
    first, second = t("a"), t("b")
    q.push(first)
    q.push(second)
    with pytest.raises(QueueFull):
        q.push(t("c"))
    assert q.remove(first)
    assert not q.remove(first)
    q.push(t("c"))
    assert drain_flows(q) == ["b", "c"]
    assert (q.requests, q.bytes) == (0, 0)


@pytest.mark.parametrize(
    ("queues", "pushes", "refused"),
    [
        # band: 2 requests
        pytest.param(
            FlowQueues(default_band=BandLimits(2, 10**9)), [10, 10, 10], 1, id="band-requests"
        ),
        # band: 25 bytes → 10 + 10 fit, the next 10 does not
        pytest.param(
            FlowQueues(default_band=BandLimits(100, 25)), [10, 10, 10], 1, id="band-bytes"
        ),
        # global: 2 requests over two bands
        pytest.param(FlowQueues(max_requests=2), [10, 10, 10, 10], 2, id="global-requests"),
        # global: 15 bytes
        pytest.param(FlowQueues(max_bytes=15), [10, 10], 1, id="global-bytes"),
    ],
)
def test_limits(queues: FlowQueues, pushes: list[int], refused: int) -> None:
    failures = 0
    for i, size in enumerate(pushes):
        try:
            priority = i % 2 if queues.max_requests or queues.max_bytes else 0
            queues.push(Ticket(flow="f", priority=priority, size=size))
        except QueueFull:
            failures += 1
    assert failures == refused


def test_bands_from_templates() -> None:
    q = FlowQueues(
        bands={10: BandLimits(1, 100)},
        default_band=BandLimits(3, 100),
        default_negative_band=BandLimits(0 + 1, 5),
    )
    assert q.band(10).limits == BandLimits(1, 100)
    assert q.band(7).limits == BandLimits(3, 100)
    assert q.band(-2).limits == BandLimits(1, 5)
    assert [b.priority for b in q.bands()] == [10, 7, 0, -2]
    assert q.peek_priority() is None
    q.push(t("x", 7))
    assert q.peek_priority() == 7
