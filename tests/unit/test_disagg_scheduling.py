"""P/D and data-parallel profile handlers and deciders (scheduling/disagg.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import yaml

from servegate.pool.endpoint import ROLE_LABEL, EndpointState
from servegate.scheduling.config import PickerConfigError, load_picker_config
from servegate.scheduling.disagg import (
    DECODE_ONLY,
    PREFILL_DECODE,
    DataParallelProfileHandler,
    DisaggProfileHandler,
    PdProfileHandler,
    PrefixBasedPDDecider,
)
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.framework import CycleState, Decision
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import Scheduler
from servegate.testing.endpoints import endpoint_state

HEAD = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}
CTX = PluginContext()
BLOCK = 16


def pd_config(
    handler: dict[str, Any],
    decider: dict[str, Any] | None = None,
    extra_plugins: list[dict[str, Any]] | None = None,
    profiles: tuple[str, ...] = ("prefill", "decode"),
) -> dict[str, Any]:
    plugins: list[dict[str, Any]] = [
        {"type": "prefill-filter"},
        {"type": "decode-filter"},
        {"type": "prefix-cache-scorer", "parameters": {"blockSizeTokens": BLOCK}},
        {"type": "queue-scorer"},
    ]
    if decider is not None:
        plugins.append(decider)
    plugins.extend(extra_plugins or [])
    plugins.append(handler)
    refs = {
        "prefill": [{"pluginRef": "prefill-filter"}, {"pluginRef": "queue-scorer"}],
        "decode": [
            {"pluginRef": "decode-filter"},
            {"pluginRef": "prefix-cache-scorer", "weight": 3},
            {"pluginRef": "queue-scorer"},
        ],
    }
    return {
        **HEAD,
        "plugins": plugins,
        "schedulingProfiles": [
            {"name": p, "plugins": refs.get(p, [{"pluginRef": "queue-scorer"}])} for p in profiles
        ],
    }


PREFIX_DECIDER = {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 64}}
DISAGG = {
    "type": "disagg-profile-handler",
    "parameters": {"deciders": {"prefill": "prefix-based-pd-decider"}},
}


def cluster(*roles: str) -> list[EndpointState]:
    return [
        endpoint_state(f"10.0.0.{i + 1}:8000", labels={ROLE_LABEL: role} if role else {})
        for i, role in enumerate(roles)
    ]


def request(tokens: int, kind: RequestKind = RequestKind.COMPLETION) -> LLMRequest:
    req = LLMRequest(
        "r", kind, "m", "m", "m", prompt="p" * tokens * 4, prompt_tokens=tokens, stream=True
    )
    req.cache["token_ids"] = list(range(tokens))
    return req


def schedule(scheduler: Scheduler, req: LLMRequest, eps: list[EndpointState]) -> Decision:
    return scheduler.schedule(req, eps, CycleState(1.0, random.Random(0)))


def seed_prefix(scheduler: Scheduler, req: LLMRequest, address: str, blocks: int) -> None:
    scorer = scheduler.plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer)
    scorer.index.insert(address, scorer.block_keys(req)[:blocks])


# -- the decider ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "tokens", "cached_blocks", "expected"),
    [
        # 160 tokens = 10 blocks of 16; uncached = 160 − round(k/10 × 160) = 160 − 16k
        pytest.param(64, 160, 0, True, id="nothing-cached-160-uncached"),
        pytest.param(64, 160, 6, True, id="6-blocks-cached-64-uncached-at-threshold"),
        pytest.param(64, 160, 7, False, id="7-blocks-cached-48-uncached"),
        pytest.param(64, 160, 10, False, id="all-cached"),
        pytest.param(64, 48, 0, False, id="prompt-shorter-than-threshold"),
        # llm-d since #691 (March 2026): nonCachedTokens 0 turns disaggregation off
        pytest.param(0, 160, 0, False, id="threshold-0-never"),
    ],
)
def test_prefix_decider_threshold(
    threshold: int, tokens: int, cached_blocks: int, expected: bool
) -> None:
    decider = {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": threshold}}
    scheduler = load_picker_config(pd_config(DISAGG, decider), CTX)
    eps = cluster("prefill", "decode")
    req = request(tokens)
    seed_prefix(scheduler, req, eps[1].address, cached_blocks)
    decision = schedule(scheduler, req, eps)
    assert decision.endpoint is eps[1]
    assert (decision.prefill is eps[0]) is expected
    assert decision.pd_decision == (PREFILL_DECODE if expected else DECODE_ONLY)


def test_prefix_decider_without_a_prefix_scorer_counts_the_whole_prompt() -> None:
    doc = {
        **HEAD,
        "plugins": [
            {"type": "prefill-filter"},
            {"type": "decode-filter"},
            PREFIX_DECIDER,
            DISAGG,
        ],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}]},
            {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}]},
        ],
    }
    scheduler = load_picker_config(doc, CTX)
    eps = cluster("prefill", "decode")
    # 64 prompt tokens, none known cached: 64 uncached ≥ 64
    assert schedule(scheduler, request(64), eps).prefill is eps[0]
    assert schedule(scheduler, request(63), eps).prefill is None


def test_prefix_decider_reads_the_named_scorer() -> None:
    extra = [{"type": "prefix-cache-scorer", "name": "other"}]
    decider = {
        "type": "prefix-based-pd-decider",
        "parameters": {"nonCachedTokens": 64, "prefixPluginName": "other"},
    }
    scheduler = load_picker_config(pd_config(DISAGG, decider, extra), CTX)
    plugin = scheduler.plugins["prefix-based-pd-decider"]
    assert isinstance(plugin, PrefixBasedPDDecider)
    assert [s.name for s in plugin.scorers] == ["other"]


# -- the handler ------------------------------------------------------------------------


def test_long_prompt_prefill_then_decode_with_both_results() -> None:
    scheduler = load_picker_config(pd_config(DISAGG, PREFIX_DECIDER), CTX)
    eps = cluster("prefill", "prefill", "decode", "decode")
    eps[0].metrics.waiting = 3.0
    eps[3].metrics.waiting = 3.0
    decision = schedule(scheduler, request(400), eps)
    assert (decision.endpoint, decision.prefill) == (eps[2], eps[1])
    assert decision.fallbacks == [eps[3]]
    assert decision.profile == "decode"
    assert set(decision.results) == {"decode", "prefill"}
    assert decision.primary_port is None


def test_prefill_leg_goes_into_the_prefix_index_of_both() -> None:
    scheduler = load_picker_config(pd_config(DISAGG, PREFIX_DECIDER), CTX)
    eps = cluster("prefill", "decode")
    req = request(400)
    decision = schedule(scheduler, req, eps)
    scheduler.pre_request(req, decision, 1.0)
    again = request(400)
    # the decode endpoint now holds the prompt: 0 uncached tokens → decode-only
    assert schedule(scheduler, again, eps).pd_decision == DECODE_ONLY


@pytest.mark.parametrize(
    ("roles", "kind", "why"),
    [
        pytest.param(("decode", "decode"), RequestKind.COMPLETION, "no prefill endpoint", id="no-prefill-endpoint"),
        pytest.param(("prefill-decode",), RequestKind.COMPLETION, "only the decode endpoint prefills", id="same-endpoint"),
        pytest.param(("prefill", "decode"), RequestKind.EMBEDDING, "embeddings never split", id="embedding"),
    ],
)  # fmt: skip
def test_decode_only_when_no_separate_prefill(
    roles: tuple[str, ...], kind: RequestKind, why: str
) -> None:
    scheduler = load_picker_config(pd_config(DISAGG, PREFIX_DECIDER), CTX)
    eps = cluster(*roles)
    decision = schedule(scheduler, request(400, kind), eps)
    assert decision.prefill is None, why
    assert decision.pd_decision == DECODE_ONLY
    assert list(decision.results) == ["decode"]


def test_prefill_decode_endpoint_is_skipped_for_the_next_prefill_candidate() -> None:
    scheduler = load_picker_config(pd_config(DISAGG, PREFIX_DECIDER), CTX)
    eps = cluster("prefill-decode", "prefill")
    eps[1].metrics.waiting = 5.0  # the prefill profile ranks eps[0] first; it is the decode target
    decision = schedule(scheduler, request(400), eps)
    assert (decision.endpoint, decision.prefill) == (eps[0], eps[1])


def test_no_decider_means_decode_only() -> None:
    doc = pd_config({"type": "disagg-profile-handler"}, profiles=("decode",))
    decision = schedule(load_picker_config(doc, CTX), request(400), cluster("prefill", "decode"))
    assert (decision.pd_decision, decision.prefill) == (DECODE_ONLY, None)


def test_no_decode_endpoint_is_no_candidates() -> None:
    from servegate.scheduling.framework import NoCandidates

    scheduler = load_picker_config(pd_config(DISAGG, PREFIX_DECIDER), CTX)
    with pytest.raises(NoCandidates):
        schedule(scheduler, request(400), cluster("prefill"))


# -- parameters in every llm-d spelling ---------------------------------------------------


def _handler(doc: dict[str, Any]) -> DisaggProfileHandler:
    handler = load_picker_config(doc, CTX).handler
    assert isinstance(handler, DisaggProfileHandler)
    return handler


ALWAYS = {"type": "always-disagg-pd-decider"}


@pytest.mark.parametrize(
    ("handler", "decider", "expected"),
    [
        pytest.param(
            {"type": "disagg-profile-handler", "parameters": {
                "profiles": {"decode": "d", "prefill": "p"}, "deciders": {"prefill": "always-disagg-pd-decider"}}},
            ALWAYS, ("d", "p", "always-disagg-pd-decider", None), id="nested",
        ),
        pytest.param(
            {"type": "disagg-profile-handler", "parameters": {
                "decodeProfile": "d", "prefillProfile": "p", "prefillDeciderPluginName": "always-disagg-pd-decider",
                "primaryPort": 8000}},
            ALWAYS, ("d", "p", "always-disagg-pd-decider", 8000), id="flat-prefillDeciderPluginName",
        ),
        pytest.param(
            {"type": "disagg-profile-handler", "parameters": {
                "decodeProfile": "d", "prefillProfile": "p", "deciderPluginName": "always-disagg-pd-decider",
                "prefixPluginType": "prefix-cache-scorer", "prefixPluginName": "prefix-cache-scorer"}},
            ALWAYS, ("d", "p", "always-disagg-pd-decider", None), id="flat-deciderPluginName",
        ),
        pytest.param(
            {"type": "pd-profile-handler", "parameters": {
                "decodeProfile": "d", "prefillProfile": "p", "deciderPluginName": "always-disagg-pd-decider",
                "primaryPort": 9000}},
            ALWAYS, ("d", "p", "always-disagg-pd-decider", 9000), id="pd-profile-handler",
        ),
    ],
)  # fmt: skip
def test_handler_parameter_spellings(
    handler: dict[str, Any], decider: dict[str, Any], expected: tuple[Any, ...]
) -> None:
    doc = pd_config(handler, decider, profiles=("p", "d"))
    doc["schedulingProfiles"] = [
        {"name": "p", "plugins": [{"pluginRef": "prefill-filter"}]},
        {"name": "d", "plugins": [{"pluginRef": "decode-filter"}]},
    ]
    h = _handler(doc)
    assert h.decider is not None
    assert (h.decode_profile, h.prefill_profile, h.decider.name, h.primary_port) == expected
    decision = schedule(load_picker_config(doc, CTX), request(8), cluster("prefill", "decode"))
    assert decision.pd_decision == PREFILL_DECODE
    assert decision.primary_port == expected[3]


@pytest.mark.parametrize(
    ("threshold", "chars", "cached_blocks", "expected"),
    [
        # prompt = "p" × chars; uncached characters = (1 − k/blocks) × chars
        pytest.param(None, 40, 0, True, id="default-threshold-0-always"),
        pytest.param(256, 255, 0, False, id="shorter-than-threshold"),
        pytest.param(256, 640, 0, True, id="640-uncached"),
        # 640 chars = 160 tokens = 10 blocks; 7 cached → 0.3 × 640 = 192 < 256
        pytest.param(256, 640, 7, False, id="192-uncached"),
    ],
)
def test_pd_profile_handler_threshold_rule(
    threshold: int | None, chars: int, cached_blocks: int, expected: bool
) -> None:
    params: dict[str, Any] = {"hashBlockSize": 64, "prefixPluginName": "prefix-cache-scorer"}
    if threshold is not None:
        params["threshold"] = threshold
    scheduler = load_picker_config(
        pd_config({"type": "pd-profile-handler", "parameters": params}), CTX
    )
    assert isinstance(scheduler.handler, PdProfileHandler)
    eps = cluster("prefill", "decode")
    req = request(chars // 4)
    seed_prefix(scheduler, req, eps[1].address, cached_blocks)
    assert (schedule(scheduler, req, eps).prefill is eps[0]) is expected


@pytest.mark.parametrize(
    ("doc", "fragments"),
    [
        pytest.param(
            pd_config({"type": "disagg-profile-handler", "parameters": {
                "decodeProfile": "decode", "deciders": {"prefill": "prefix-based-pd-decider"}}}, PREFIX_DECIDER),
            ["cannot mix the deprecated flat parameters"], id="mixed-spellings",
        ),
        pytest.param(
            pd_config({"type": "disagg-profile-handler", "parameters": {
                "prefillDeciderPluginName": "a", "deciderPluginName": "b"}}),
            ["name the same decider; keep one"], id="two-decider-names",
        ),
        pytest.param(
            pd_config({"type": "disagg-profile-handler", "parameters": {"deciders": {"encode": "x"}}}),
            ["encode decider 'x' names no declared plugin"], id="encode-decider",
        ),
        pytest.param(
            pd_config({"type": "disagg-profile-handler", "parameters": {
                "encodeProfile": "encode", "deciders": {"prefill": "x"}}}),
            ["cannot mix the deprecated flat parameters (encodeProfile"], id="encode-profile",
        ),
        pytest.param(
            pd_config({"type": "disagg-profile-handler", "parameters": {"deciders": {"prefill": "nope"}}}),
            ["prefill decider 'nope' names no declared plugin"], id="unknown-decider",
        ),
        pytest.param(
            pd_config({"type": "disagg-profile-handler", "parameters": {"deciders": {"prefill": "queue-scorer"}}}),
            ["'queue-scorer' is a 'queue-scorer', not a decider"], id="decider-of-wrong-type",
        ),
        pytest.param(
            pd_config(DISAGG, PREFIX_DECIDER, profiles=("prefill", "other")),
            ["runs the decode profile 'decode' first", "profiles are: prefill, other"], id="no-decode-profile",
        ),
        pytest.param(
            pd_config(DISAGG, PREFIX_DECIDER, profiles=("decode",)),
            ["has a prefill decider but no prefill profile 'prefill'"], id="no-prefill-profile",
        ),
        pytest.param(
            pd_config(DISAGG, PREFIX_DECIDER, profiles=("prefill", "decode", "spare")),
            ["never runs profile(s) spare"], id="extra-profile",
        ),
        pytest.param(
            pd_config({"type": "pd-profile-handler", "parameters": {
                "threshold": 10, "deciderPluginName": "prefix-based-pd-decider"}}, PREFIX_DECIDER),
            ["either deciderPluginName or the older threshold rule"], id="pd-threshold-and-decider",
        ),
        pytest.param(
            pd_config(DISAGG, {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": -1}}),
            ["parameter 'nonCachedTokens'", "greater than or equal to 0"], id="negative-threshold",
        ),
        pytest.param(
            pd_config(DISAGG, {"type": "prefix-based-pd-decider", "parameters": {"prefixPluginName": "queue-scorer"}}),
            ["prefixPluginName 'queue-scorer' is a 'queue-scorer'"], id="decider-prefix-not-a-prefix-scorer",
        ),
        pytest.param(
            pd_config({"type": "disagg-profile-handler", "parameters": {"primaryPort": 70000}}),
            ["parameter 'primaryPort'", "less than or equal to 65535"], id="port-range",
        ),
        pytest.param(
            pd_config(DISAGG, PREFIX_DECIDER, [{"type": "disagg-headers-handler", "parameters": {"prefillProfile": "pf"}}]),
            ["prefillProfile 'pf' is not the prefill profile 'prefill'"], id="headers-handler-profile",
        ),
    ],
)  # fmt: skip
def test_configuration_errors(doc: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(PickerConfigError) as info:
        load_picker_config(doc, CTX)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_headers_handler_loads_under_both_names() -> None:
    for name in ("disagg-headers-handler", "prefill-header-handler"):
        extra = [{"type": name, "parameters": {"prefillProfile": "prefill"}}]
        scheduler = load_picker_config(pd_config(DISAGG, PREFIX_DECIDER, extra), CTX)
        assert scheduler.plugins[name].type == "disagg-headers-handler"


# -- data parallelism --------------------------------------------------------------------


def test_data_parallel_handler_picks_a_rank_and_names_the_primary_port() -> None:
    doc = yaml.safe_load(
        """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: data-parallel-profile-handler
  parameters: {primaryPort: 8000}
- type: queue-scorer
"""
    )
    scheduler = load_picker_config(doc, CTX)
    assert isinstance(scheduler.handler, DataParallelProfileHandler)
    ranks = [endpoint_state("10.0.0.1:8200"), endpoint_state("10.0.0.1:8201")]
    ranks[0].metrics.waiting = 4.0
    decision = schedule(scheduler, request(8), ranks)
    assert (decision.endpoint, decision.primary_port, decision.pd_decision) == (
        ranks[1],
        8000,
        None,
    )


def test_data_parallel_handler_runs_one_profile() -> None:
    doc = pd_config({"type": "data-parallel-profile-handler"})
    with pytest.raises(PickerConfigError, match="runs exactly one scheduling profile, but 2"):
        load_picker_config(doc, CTX)
