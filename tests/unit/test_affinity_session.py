"""`session-affinity-scorer`: x-session-token (echoed replica) and x-session-id (bindings)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.scheduling.affinity import (
    SessionAffinityScorer,
    decode_token,
    encode_token,
)
from servegate.scheduling.factory import PluginContext, PluginParameterError
from servegate.scheduling.framework import CycleState, Decision, ProfileResult
from servegate.scheduling.request import LLMRequest, RequestKind

A, B, C = (EndpointState(Endpoint(address=f"10.0.0.{i}:8000", url="http://x")) for i in (1, 2, 3))


def req(**headers: str) -> LLMRequest:
    return LLMRequest("r", RequestKind.CHAT, "m", "m", "m", headers=headers)


def scorer(**params: Any) -> SessionAffinityScorer:
    return SessionAffinityScorer.from_config("s", params, PluginContext())


def at(now: float) -> CycleState:
    return CycleState(now=now, rng=random.Random(0))


SESSION_ID = {"strategy": "session_id", "sessionIdConfig": {"evictionTtlSeconds": 10}}


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param({"x-session-token": encode_token(B.address)}, [0.0, 1.0, 0.0], id="token-b"),
        pytest.param({}, [0.0, 0.0, 0.0], id="no-token"),
        pytest.param({"x-session-token": "%%%"}, [0.0, 0.0, 0.0], id="not-base64"),
        pytest.param(
            {"x-session-token": encode_token("10.9.9.9:1")}, [0.0, 0.0, 0.0], id="gone-replica"
        ),
    ],
)
def test_session_token_prefers_the_encoded_replica(
    headers: dict[str, str], expected: list[float]
) -> None:
    assert list(scorer().score(at(0.0), req(**headers), [A, B, C])) == expected


def test_the_response_carries_the_token_of_the_chosen_replica() -> None:
    s = scorer()
    headers = s.response_headers(req(), Decision(endpoint=C, fallbacks=[A]))
    assert headers == {"x-session-token": encode_token(C.address)}
    assert decode_token(headers["x-session-token"]) == C.address


def test_a_custom_token_header() -> None:
    s = scorer(encodedEndpointHeaderConfig={"headerName": "X-Sticky"})
    assert list(s.score(at(0), req(**{"x-sticky": encode_token(A.address)}), [A, B])) == [1, 0]
    assert set(s.response_headers(req(), Decision(endpoint=A, fallbacks=[]))) == {"x-sticky"}


def route(
    s: SessionAffinityScorer,
    now: float,
    sid: str,
    picked: EndpointState,
    candidates: list[EndpointState],
) -> list[float]:
    r = req(**{"x-session-id": sid})
    scores = list(s.score(at(now), r, candidates))
    s.pre_request(r, Decision(endpoint=picked, fallbacks=[]), now)
    return scores


def test_session_id_binds_on_first_use_and_prefers_it_after() -> None:
    s = scorer(**SESSION_ID)
    assert route(s, 0.0, "u1", B, [A, B, C]) == [0.0, 0.0, 0.0]
    assert route(s, 1.0, "u1", B, [A, B, C]) == [0.0, 1.0, 0.0]
    assert s.bindings["u1"] == (B.address, 1.0)


def test_a_binding_survives_a_load_decision_elsewhere() -> None:
    s = scorer(**SESSION_ID)
    route(s, 0.0, "u1", B, [A, B, C])
    # B was a candidate but the load scorers chose A: the session stays on B
    route(s, 1.0, "u1", A, [A, B, C])
    assert s.bindings["u1"][0] == B.address


def test_a_binding_moves_when_its_replica_is_gone() -> None:
    s = scorer(**SESSION_ID)
    route(s, 0.0, "u1", B, [A, B, C])
    assert route(s, 1.0, "u1", C, [A, C]) == [0.0, 0.0]
    assert s.bindings["u1"][0] == C.address


def test_an_unused_binding_expires_after_its_ttl() -> None:
    s = scorer(**SESSION_ID)
    route(s, 0.0, "u1", B, [A, B, C])
    # 10 s TTL: at 10.5 s the binding no longer counts and is re-bound where it goes
    assert route(s, 10.5, "u1", A, [A, B, C]) == [0.0, 0.0, 0.0]
    assert s.bindings["u1"] == (A.address, 10.5)


def test_expired_bindings_are_swept() -> None:
    s = scorer(
        strategy="session_id", sessionIdConfig={"evictionTtlSeconds": 5, "evictionSweepSeconds": 1}
    )
    for i in range(5):
        route(s, float(i), f"u{i}", A, [A])
    route(s, 9.5, "late", A, [A])
    # u0..u4 last used at 0..4 s; at 9.5 s those older than 5 s (u0..u4 ≤ 4.5) are gone
    assert list(s.bindings) == ["late"]


def test_bindings_are_bounded() -> None:
    s = scorer(strategy="session_id", sessionIdConfig={"maxSessions": 2})
    for sid in ("a", "b", "c"):
        route(s, 0.0, sid, A, [A])
    assert list(s.bindings) == ["b", "c"]


def test_sources_are_tried_in_order() -> None:
    s = scorer(
        strategy="session_id",
        sessionIdConfig={"sources": [{"header": "x-user"}, {"header": "x-session-id"}]},
    )
    assert s.session_id(req(**{"x-session-id": "s", "x-user": "u"})) == "u"
    assert s.session_id(req(**{"x-session-id": "s"})) == "s"
    assert s.session_id(req(**{"x-user": "  "})) is None


def test_profile_name_binds_that_profiles_pick() -> None:
    s = scorer(strategy="session_id", profileName="prefill")
    r = req(**{"x-session-id": "u"})
    s.pre_request(r, Decision(endpoint=A, fallbacks=[], prefill=C), 0.0)
    assert s.bindings["u"][0] == C.address
    s2 = scorer(strategy="session_id", profileName="other")
    result = ProfileResult(ranked=[B], scores={}, totals={})
    s2.pre_request(r, Decision(endpoint=A, fallbacks=[], results={"other": result}), 0.0)
    assert s2.bindings["u"][0] == B.address


def test_session_id_strategy_adds_no_response_header() -> None:
    assert scorer(**SESSION_ID).response_headers(req(), Decision(endpoint=A, fallbacks=[])) == {}


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        pytest.param({"strategy": "cookie"}, "strategy", id="strategy"),
        pytest.param({"sessionIdConfig": {"evictionTtlSeconds": 0}}, "greater than 0", id="ttl"),
        pytest.param({"sessionIdConfig": {"sources": []}}, "at least 1", id="no-sources"),
        pytest.param(
            {"sessionIdConfig": {"sources": [{"header": "h", "attribute": "a"}]}},
            "exactly one of header and attribute",
            id="attribute",
        ),
    ],
)
def test_bad_session_parameters(params: dict[str, Any], problem: str) -> None:
    with pytest.raises(PluginParameterError) as info:
        scorer(**params)
    assert problem in str(info.value)
