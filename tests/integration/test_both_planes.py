"""The same requests through every data plane, with the same outcome.

One set of recording replicas serves three gateways built from one configuration: the
HTTP gateway (a real aiohttp server), the ext_proc picker (a real gRPC server, driven
by the repo's Envoy stand-in, `extproc/client.py`, with the test forwarding where the
picker says, as Envoy's router would) and the ASGI application (`GatewayASGI`, called
in-process with ASGI messages as a host such as Ray Serve's proxy would). Every
scenario must reach the same replica with the same model and routing headers, and
answer the client with the same status and gateway headers. Before the `Director` the
planes share, ext_proc served the first pool only and ignored every model rewrite, and
the ASGI plane relayed over loopback to an HTTP gateway; these scenarios catch both.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from aiohttp import web

from servegate.config import parse_config
from servegate.extproc.client import BUFFERED_NO_RESPONSE_BODY, ProxyStream
from servegate.extproc.protocol import FULL_DUPLEX_MODES, Modes
from servegate.extproc.server import ExtProcServer
from servegate.gateway.app import Gateway, build_gateway
from servegate.integrations.asgi_gateway import GatewayASGI, Message
from servegate.testing.gateway import GatewayRunner
from tests.disagg_pickers import PD_HANDLER, disagg_picker
from tests.integration.conftest import wait_for

CHAT = "/v1/chat/completions"
ROUTING = (
    "x-prefiller-host-port",
    "x-encoder-hosts-ports",
    "x-data-parallel-host-port",
    "x-data-parallel-rank",
    "x-kv-cache-source-host-port",
    "x-request-id",
)
"""Request headers the replica's side routes by: both planes must send the same."""
ANSWER_HEADERS = (
    "x-servegate-served-model",
    "x-session-token",
    "x-gateway-destination-endpoint-served",
    "x-llm-d-request-dropped-reason",
)
"""Response headers the gateway writes: both planes must answer the same."""
QUEUE_HEADER = "x-llm-d-flow-queue-duration-ms"
"""Flow control's wait: a duration, so only its presence is compared."""


def picker(*scorers: str) -> dict[str, Any]:
    """Load scorers only: arithmetic on fixed metrics, so both gateways score alike."""
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [*({"type": s} for s in scorers), {"type": "max-score-picker"}],
    }


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class Replica:
    """A vLLM stand-in serving `models`, recording every inference request it gets."""

    def __init__(self, name: str, models: Sequence[str]) -> None:
        self.name = name
        self.models = list(models)
        self.calls: list[Call] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> Replica:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post(CHAT, self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = [
            f'vllm:{metric}{{engine="0",model_name="{model}"}} 0.0'
            for model in self.models
            for metric in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model"} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.calls.append(Call(request.path, headers, body))
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        return web.json_response(answer)


@dataclass(frozen=True)
class Scenario:
    id: str
    model: str
    headers: tuple[tuple[str, str], ...] = ()
    subset: tuple[str, ...] | None = None
    """Replica names the proxy narrows the candidates to."""


@dataclass
class Outcome:
    status: int
    replica: str | None
    """The replica that got the request (None: none did)."""
    model: str | None
    """The model the replica was asked for."""
    routing: dict[str, str]
    answer: dict[str, str]
    queue_header: bool
    scores: Any = None
    calls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


SCENARIOS = [
    Scenario("first-pool", "alpha"),
    Scenario("second-pool", "beta"),
    Scenario("weighted-split", "public"),
    Scenario("rewrite-header", "alpha", (("x-llm-d-model-name-rewrite", "beta"),)),
    Scenario("rule-wins-over-header", "public", (("x-llm-d-model-name-rewrite", "alpha"),)),
    Scenario("prefill-decode-sidecar", "gamma"),
    Scenario("client-routing-header-dropped", "alpha", (("x-prefiller-host-port", "6.6.6.6:1"),)),
    Scenario("unknown-model", "nope"),
    Scenario("subset-inside", "alpha", subset=("a1",)),
    Scenario("subset-outside", "alpha", subset=("b1",)),
]


@pytest.fixture
async def replicas() -> AsyncIterator[dict[str, Replica]]:
    reps = {
        "a1": Replica("a1", ["alpha"]),
        "a2": Replica("a2", ["alpha"]),
        "b1": Replica("b1", ["beta"]),
        "p1": Replica("p1", ["gamma"]),
        "d1": Replica("d1", ["gamma"]),
    }
    for replica in reps.values():
        await replica.start()
    try:
        yield reps
    finally:
        for replica in reps.values():
            await replica.stop()


def config(reps: dict[str, Replica]) -> dict[str, Any]:
    # quick to become ready, and slow to give up on a replica: on a loaded machine a late
    # probe must not take an endpoint out between the two planes' runs
    fast = {
        "scrape_interval_s": 0.05,
        "scrape_timeout_s": 5.0,
        "metrics_staleness_s": 60.0,
        "health": {"interval_s": 0.1, "timeout_s": 5.0, "failure_threshold": 100},
    }
    return {
        "gateway": {"seed": 3, "port": 0, "debug_headers": True, "max_retries": 1},
        "outlier_detection": {"enabled": False},
        "flow_control": {"enabled": True},
        "disaggregation": {"mode": "sidecar"},
        "extproc": {"host": "127.0.0.1", "port": 0, "health_port": 0, "metrics_port": 0},
        "pools": [
            {
                "name": "a",
                **fast,
                "endpoints": [{"url": reps["a1"].url}, {"url": reps["a2"].url}],
                "picker": picker("session-affinity-scorer", "queue-scorer"),
            },
            {
                "name": "b",
                **fast,
                "endpoints": [{"url": reps["b1"].url}],
                "picker": picker("queue-scorer"),
            },
            {
                "name": "pd",
                **fast,
                "endpoints": [
                    {"url": reps["p1"].url, "role": "prefill"},
                    {"url": reps["d1"].url, "role": "decode"},
                ],
                "picker": disagg_picker(PD_HANDLER),
            },
        ],
        "model_rewrites": [
            {"rules": [{"matches": [{"model": "public"}], "targets": [{"modelRewrite": "beta"}]}]}
        ],
    }


async def ready(gw: Gateway) -> None:
    wanted = {"a": ("alpha", 2), "b": ("beta", 1), "pd": ("gamma", 2)}

    def all_ready() -> bool:
        for name, (model, n) in wanted.items():
            runtime = gw.runtime(name)
            if runtime is None or runtime.pool.ready_count() != n:
                return False
            if runtime.pool.resolve_model(model) is None:
                return False
            if not all(s.metrics.scraped_at > 0 for s in runtime.pool):
                return False
        return True

    await wait_for(all_ready, what="every pool ready")


def request_body(scenario: Scenario) -> bytes:
    messages = [{"role": "user", "content": f"hello from {scenario.id}"}]
    return orjson.dumps({"model": scenario.model, "messages": messages, "max_tokens": 4})


def received(reps: dict[str, Replica]) -> tuple[str | None, Call | None, int]:
    """The replica that got the scenario's request, its call, and how many calls there were."""
    calls = [(name, call) for name, r in reps.items() for call in r.calls]
    for replica in reps.values():
        replica.calls.clear()
    if not calls:
        return None, None, 0
    name, call = calls[-1]
    return name, call, len(calls)


def outcome(
    status: int, headers: dict[str, str], reps: dict[str, Replica], error_type: str | None
) -> Outcome:
    name, call, count = received(reps)
    lowered = {k.lower(): v for k, v in headers.items()}
    scores = lowered.get("x-servegate-scores")
    return Outcome(
        status=status,
        replica=name,
        model=call.body.get("model") if call is not None else None,
        routing={h: call.headers[h] for h in ROUTING if call is not None and h in call.headers},
        answer={h: lowered[h] for h in ANSWER_HEADERS if h in lowered},
        queue_header=QUEUE_HEADER in lowered,
        scores=orjson.loads(scores) if scores is not None else None,
        calls=count,
        extra={"error_type": error_type},
    )


async def through_http(
    runner: GatewayRunner, reps: dict[str, Replica], scenario: Scenario, rid: str
) -> Outcome:
    headers = {"x-request-id": rid, **dict(scenario.headers)}
    if scenario.subset is not None:
        headers["x-gateway-destination-endpoint-subset"] = ",".join(
            reps[n].address for n in scenario.subset
        )
    async with (
        aiohttp.ClientSession() as session,
        session.post(runner.url + CHAT, data=request_body(scenario), headers=headers) as resp,
    ):
        body = await resp.json(content_type=None)
        error = body.get("error", {}).get("type") if resp.status >= 400 else None
        return outcome(resp.status, dict(resp.headers), reps, error)


async def through_extproc(
    channel: grpc.aio.Channel,
    reps: dict[str, Replica],
    scenario: Scenario,
    rid: str,
    modes: Modes = FULL_DUPLEX_MODES,
) -> Outcome:
    stream = ProxyStream(channel, modes)
    client_headers = [("x-request-id", rid), *scenario.headers]
    subset = None
    if scenario.subset is not None:
        subset = [reps[n].address for n in scenario.subset]
    answer = await stream.request(CHAT, request_body(scenario), client_headers, subset=subset)
    if answer.immediate_status:
        await stream.close()
        error = orjson.loads(answer.immediate_body)["error"]["type"]
        return outcome(answer.immediate_status, answer.immediate_headers, reps, error)
    # what Envoy's router does: the client's headers with the picker's mutation applied,
    # sent to the first destination
    removed = set(answer.removed_headers)
    forwarded = {k: v for k, v in client_headers if k not in removed}
    forwarded.update(
        {k: v for k, v in answer.set_headers.items() if not k.startswith("x-gateway-")}
    )
    forwarded["content-type"] = "application/json"
    target = answer.endpoints[0]
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{target}{CHAT}", data=answer.body, headers=forwarded) as resp,
    ):
        data = await resp.read()
        status = resp.status
    mutation, _ = await stream.respond(status, [data], served=target)
    await stream.close()
    return outcome(status, mutation, reps, None)


async def through_asgi(
    app: GatewayASGI, reps: dict[str, Replica], scenario: Scenario, rid: str
) -> Outcome:
    headers = {"x-request-id": rid, "content-type": "application/json", **dict(scenario.headers)}
    if scenario.subset is not None:
        headers["x-gateway-destination-endpoint-subset"] = ",".join(
            reps[n].address for n in scenario.subset
        )
    scope = {
        "type": "http",
        "method": "POST",
        "path": CHAT,
        "raw_path": CHAT.encode(),
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 40000),
    }
    inbox = [{"type": "http.request", "body": request_body(scenario), "more_body": False}]
    sent: list[Message] = []

    async def receive() -> Message:
        if inbox:
            return inbox.pop()
        await asyncio.Event().wait()  # the client stays until the app is done
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    assert sent[-1]["more_body"] is False
    answer = {k.decode(): v.decode() for k, v in start["headers"]}
    error = orjson.loads(body)["error"]["type"] if start["status"] >= 400 else None
    return outcome(start["status"], answer, reps, error)


async def test_every_scenario_has_the_same_outcome_in_every_plane(
    replicas: dict[str, Replica],
) -> None:
    cfg = parse_config("", "<test>", environ={}, overrides=config(replicas))
    http_outcomes: dict[str, Outcome] = {}
    extproc_outcomes: dict[str, Outcome] = {}
    asgi_outcomes: dict[str, Outcome] = {}
    async with GatewayRunner(config(replicas)) as runner:
        await ready(runner.gateway)
        for scenario in SCENARIOS:
            http_outcomes[scenario.id] = await through_http(
                runner, replicas, scenario, f"r-{scenario.id}"
            )
    async with ExtProcServer(build_gateway(cfg, None, io.BytesIO())) as server:
        await ready(server.gw)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for scenario in SCENARIOS:
                extproc_outcomes[scenario.id] = await through_extproc(
                    channel, replicas, scenario, f"r-{scenario.id}"
                )
        assert all(s.in_flight_requests == 0 for r in server.gw.runtimes for s in r.pool)
    app = GatewayASGI(cfg)
    await app.start()
    try:
        assert app.gateway is not None
        await ready(app.gateway)
        for scenario in SCENARIOS:
            asgi_outcomes[scenario.id] = await through_asgi(
                app, replicas, scenario, f"r-{scenario.id}"
            )
        assert all(s.in_flight_requests == 0 for r in app.gateway.runtimes for s in r.pool)
    finally:
        await app.stop()
    for scenario in SCENARIOS:
        assert extproc_outcomes[scenario.id] == http_outcomes[scenario.id], scenario.id
        assert asgi_outcomes[scenario.id] == http_outcomes[scenario.id], scenario.id

    # and the outcomes are the intended ones, not merely equal
    got = http_outcomes
    assert (got["first-pool"].replica, got["first-pool"].model) in {
        ("a1", "alpha"),
        ("a2", "alpha"),
    }
    assert "x-session-token" in got["first-pool"].answer
    assert got["first-pool"].queue_header and got["first-pool"].scores
    assert (got["second-pool"].replica, got["second-pool"].model) == ("b1", "beta")
    for rewritten in ("weighted-split", "rewrite-header", "rule-wins-over-header"):
        assert (got[rewritten].replica, got[rewritten].model) == ("b1", "beta"), rewritten
        assert got[rewritten].answer["x-servegate-served-model"] == "beta"
    pd = got["prefill-decode-sidecar"]
    assert (pd.replica, pd.calls) == ("d1", 1)
    assert pd.routing["x-prefiller-host-port"] == replicas["p1"].address
    assert "x-prefiller-host-port" not in got["client-routing-header-dropped"].routing
    assert got["first-pool"].routing["x-request-id"] == "r-first-pool"
    assert (got["unknown-model"].status, got["unknown-model"].replica) == (404, None)
    assert got["subset-inside"].replica == "a1"
    outside = got["subset-outside"]
    assert (outside.status, outside.replica) == (503, None)
    assert outside.answer["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"


async def test_buffered_ext_proc_has_the_same_outcomes_as_full_duplex(
    replicas: dict[str, Replica],
) -> None:
    """deploy/extproc/envoy-buffered.yaml's modes (BUFFERED request body, response body NONE) route,
    rewrite and answer every scenario as the full-duplex modes do (and so as HTTP does)."""
    cfg = parse_config("", "<test>", environ={}, overrides=config(replicas))
    outcomes: dict[str, dict[str, Outcome]] = {}
    for name, modes in (
        ("full-duplex", FULL_DUPLEX_MODES),
        ("buffered", BUFFERED_NO_RESPONSE_BODY),
    ):
        async with ExtProcServer(build_gateway(cfg, None, io.BytesIO())) as server:
            await ready(server.gw)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                outcomes[name] = {
                    s.id: await through_extproc(channel, replicas, s, f"r-{s.id}", modes)
                    for s in SCENARIOS
                }
            assert all(s.in_flight_requests == 0 for r in server.gw.runtimes for s in r.pool)
    for scenario in SCENARIOS:
        assert outcomes["buffered"][scenario.id] == outcomes["full-duplex"][scenario.id], (
            scenario.id
        )
    rewritten = outcomes["buffered"]["weighted-split"]
    assert (rewritten.replica, rewritten.model) == ("b1", "beta")
