"""The llm-d router's plugin kinds and sections (issue 17), each on fixtures written here.

Producers and their consumers, parsers and `requestHandler`, the data layer,
feature gates, flow-control policies and fields, the admitter, the new filters,
scorers and handlers, E/PD, and the startup warnings that name what servegate
does differently.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import yaml

from servegate.pool.endpoint import ROLE_LABEL, EndpointState
from servegate.scheduling.admitters import ProbabilisticAdmitter
from servegate.scheduling.config import PickerConfigError, load_picker_config
from servegate.scheduling.disagg import DECODE_ONLY, PREFILL_DECODE
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.flowcontrol.settings import FlowControlSettings, from_picker_sections
from servegate.scheduling.framework import CycleState, Decision, NoCandidates
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.scheduling.prefix.lookup import PrefixProducer
from servegate.scheduling.prefix.precise import PrecisePrefixCacheScorer, precise_indexes
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import Scheduler
from servegate.scheduling.scorers import range_score
from servegate.testing.endpoints import endpoint_state

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
CTX = PluginContext()


def load(text: str) -> Scheduler:
    return load_picker_config(HEAD + text, CTX)


def request(
    tokens: int = 64, headers: dict[str, str] | None = None, messages: Any = None
) -> LLMRequest:
    req = LLMRequest(
        "r",
        RequestKind.CHAT if messages is not None else RequestKind.COMPLETION,
        "m",
        "m",
        "m",
        prompt="p" * tokens * 4,
        prompt_tokens=tokens,
        headers=headers or {},
        messages=messages,
    )
    req.cache["token_ids"] = list(range(tokens))
    return req


def cycle(now: float = 1.0) -> CycleState:
    return CycleState(now, random.Random(0))


def eps(n: int, **labels: str) -> list[EndpointState]:
    return [endpoint_state(f"10.0.0.{i + 1}:8000", labels=labels or None) for i in range(n)]


def decide(scheduler: Scheduler, req: LLMRequest, states: list[EndpointState]) -> Decision:
    return scheduler.schedule(req, states, cycle())


# -- producers and consumers ----------------------------------------------------------------

PRODUCER = """\
plugins:
- type: approx-prefix-cache-producer
  parameters: {blockSizeTokens: 16, maxPrefixTokensToMatch: 64}
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: approx-prefix-cache-producer}
- type: no-hit-lru-scorer
  parameters: {prefixMatchInfoProducerName: approx-prefix-cache-producer}
- type: max-score-picker
"""


def test_a_consumer_scores_with_its_producers_index() -> None:
    scheduler = load(PRODUCER)
    producer = scheduler.plugins["approx-prefix-cache-producer"]
    scorer = scheduler.plugins["prefix-cache-scorer"]
    assert isinstance(producer, PrefixProducer) and isinstance(scorer, PrefixCacheScorer)
    assert scorer.producer is producer
    states = eps(3)
    req = request(160)  # 10 blocks of 16, capped at 64 tokens = 4 blocks
    assert len(producer.source.block_keys(req)) == 4
    first = decide(scheduler, req, states)
    scheduler.pre_request(req, first, 1.0)
    # the producer recorded the decision once; the consumer kept no index of its own
    assert len(producer.source.index) == 4
    assert len(scorer.index) == 0
    again = request(160)
    result = decide(scheduler, again, states).results["default"]
    assert result.scores[first.endpoint.address]["prefix-cache-scorer"] == 1.0
    others = [s for s in states if s is not first.endpoint]
    assert all(result.scores[s.address]["prefix-cache-scorer"] == 0.0 for s in others)


def test_a_scorer_without_parameters_reads_the_producer_under_its_type_name() -> None:
    scheduler = load(
        "plugins:\n- type: approx-prefix-cache-producer\n- type: prefix-cache-scorer\n"
    )
    scorer = scheduler.plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer)
    assert scorer.producer is scheduler.plugins["approx-prefix-cache-producer"]


def test_a_scorer_with_index_parameters_keeps_its_own_index() -> None:
    scheduler = load(
        "plugins:\n- type: approx-prefix-cache-producer\n"
        "- type: prefix-cache-scorer\n  parameters: {lruCapacityPerServer: 256}\n"
    )
    scorer = scheduler.plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer) and scorer.producer is None


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param(
            "plugins:\n- type: prefix-cache-scorer\n"
            "  parameters: {prefixMatchInfoProducerName: nope}\n",
            "prefixMatchInfoProducerName 'nope' names no declared plugin",
            id="unknown-producer",
        ),
        pytest.param(
            "plugins:\n- type: queue-scorer\n- type: prefix-cache-scorer\n"
            "  parameters: {prefixMatchInfoProducerName: queue-scorer}\n",
            "is a 'queue-scorer', not a prefix producer",
            id="not-a-producer",
        ),
        pytest.param(
            "plugins:\n- type: approx-prefix-cache-producer\n- type: prefix-cache-scorer\n"
            "  parameters: {prefixMatchInfoProducerName: approx-prefix-cache-producer,"
            " blockSizeTokens: 8}\n",
            "the index parameters belong to the producer; remove blockSizeTokens",
            id="index-on-consumer",
        ),
        pytest.param(
            "plugins:\n- type: approx-prefix-cache-producer\n"
            "  parameters: {maxPrefixTokensToMach: 5}\n",
            "unknown parameter 'maxPrefixTokensToMach'",
            id="typo",
        ),
        pytest.param(
            "plugins:\n- type: approx-prefix-cache-producer\n- type: max-score-picker\n"
            "schedulingProfiles:\n- name: default\n  plugins:\n"
            "  - {pluginRef: approx-prefix-cache-producer, weight: 2}\n",
            "is a producer; a weight applies to scorers only",
            id="producer-weighted-in-profile",
        ),
    ],
)
def test_producer_mistakes(text: str, fragment: str) -> None:
    with pytest.raises(PickerConfigError) as info:
        load(text)
    assert fragment in str(info.value)


def test_a_producer_listed_in_a_profile_is_ignored_with_a_warning() -> None:
    scheduler = load(
        "plugins:\n- type: tokenizer\n  parameters: {modelName: m}\n- type: queue-scorer\n"
        "schedulingProfiles:\n- name: default\n  plugins:\n  - {pluginRef: tokenizer}\n"
        "  - {pluginRef: queue-scorer}\n"
    )
    assert [w.scorer.name for w in scheduler.profiles["default"].scorers] == ["queue-scorer"]
    assert any("'tokenizer' is a producer" in w for w in scheduler.warnings)


def test_the_precise_producer_is_fed_by_kv_events_and_read_by_consumers() -> None:
    scheduler = load(
        "plugins:\n- type: precise-prefix-cache-producer\n"
        "  parameters: {tokenProcessorConfig: {blockSizeTokens: 16}}\n"
        "- type: prefix-cache-scorer\n"
        "  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}\n"
        "- type: prefix-cache-affinity-filter\n"
        "  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}\n"
    )
    indexes = precise_indexes(scheduler.plugins)
    assert list(indexes) == ["precise-prefix-cache-producer"]
    producer = scheduler.plugins["precise-prefix-cache-producer"]
    assert isinstance(producer, PrefixProducer)
    assert indexes["precise-prefix-cache-producer"] is producer.source.index
    assert producer.source.default_block_size == 16


def test_precise_parameter_layouts() -> None:
    old = load(
        "plugins:\n- type: precise-prefix-cache-scorer\n  parameters:\n    indexerConfig:\n"
        "      tokenProcessorConfig: {blockSize: 32, hashSeed: '42'}\n"
        "      prefixStoreConfig: {blockSize: 16}\n"
        "      kvBlockIndexConfig: {maxPrefixBlocksToMatch: 3, metricsLoggingInterval: 6000000000}\n"
    ).plugins["precise-prefix-cache-scorer"]
    assert isinstance(old, PrecisePrefixCacheScorer)
    assert old.default_block_size == 32
    assert old.max_blocks == 3
    keys = old.block_keys(request(320), 32)
    assert len(keys) == 3
    for bad, fragment in (
        ("tokenProcessorConfig: {blockSize: 16, blockSizeTokens: 16}", "same setting"),
        ("indexerConfig: {kvBlockIndexConfig: {metricsLoggingInterval: -1}}", "must be > 0"),
        ("indexerConfig: {kvBlockIndexConfig: {metricsLoggingInterval: 1 minute}}", "duration"),
    ):
        with pytest.raises(PickerConfigError, match=fragment):
            load(f"plugins:\n- type: precise-prefix-cache-scorer\n  parameters: {{{bad}}}\n")


def test_gie_hash_block_size_is_characters_per_block() -> None:
    scorer = load(
        "plugins:\n- type: prefix-cache-scorer\n  parameters: {hashBlockSize: 10}\n"
    ).plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer)
    req = request(25)  # 100 characters
    del req.cache["token_ids"]
    assert len(scorer.block_keys(req)) == 10
    with pytest.raises(PickerConfigError, match="same setting"):
        load(
            "plugins:\n- type: prefix-cache-scorer\n  parameters: {hashBlockSize: 10, blockSize: 4}\n"
        )


def test_session_id_producer_feeds_session_affinity() -> None:
    scheduler = load(
        "plugins:\n- type: session-id-producer\n  parameters: {cookieName: sid}\n"
        "- type: session-affinity-filter\n  parameters:\n    strategy: session_id\n"
        "    sessionIdConfig: {sources: [{producer: session-id-producer}]}\n"
    )
    states = eps(3)
    req = request(headers={"cookie": "a=1; sid=abc"})
    first = decide(scheduler, req, states)
    scheduler.pre_request(req, first, 1.0)
    for _ in range(5):
        again = request(headers={"cookie": "sid=abc"})
        assert decide(scheduler, again, states).targets == [first.endpoint]
    with pytest.raises(PickerConfigError, match="session-id-producer"):
        load(
            "plugins:\n- type: session-affinity-filter\n  parameters:\n"
            "    sessionIdConfig: {sources: [{attribute: agent-identity}]}\n"
        )


# -- sections: requestHandler, dataLayer, feature gates --------------------------------------


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param(
            "plugins:\n- type: queue-scorer\nrequestHandler:\n  parsers: [{pluginRef: p}]\n",
            "requestHandler.parsers[0]: pluginRef 'p' names no declared plugin",
            id="unknown-parser",
        ),
        pytest.param(
            "plugins:\n- type: queue-scorer\nparser: {pluginRef: queue-scorer}\n",
            "parser[0]: pluginRef 'queue-scorer' is a 'queue-scorer', not a parser plugin",
            id="not-a-parser",
        ),
        pytest.param(
            "plugins:\n- type: core-metrics-extractor\n"
            "dataLayer: {sources: [{pluginRef: core-metrics-extractor}]}\n",
            "is a 'core-metrics-extractor', not a data source",
            id="extractor-as-source",
        ),
        pytest.param(
            "plugins:\n- type: metrics-data-source\n"
            "data: {sources: [{pluginRef: metrics-data-source, extractors: [{pluginRef: x}]}]}\n",
            "data.sources[0].extractors[0]: pluginRef 'x' names no declared plugin",
            id="unknown-extractor",
        ),
        pytest.param(
            "plugins:\n- type: queue-scorer\ndataLayer: {sources: [], colour: red}\n",
            "dataLayer.colour: unknown field",
            id="section-typo",
        ),
        pytest.param(
            "plugins:\n- type: queue-scorer\nfeatureGates: [prepareDataPlugin]\n",
            "'prepareDataPlugin' is not a feature gate; known gates: flowControl",
            id="gate-typo",
        ),
        pytest.param(
            "apiVersion: llm-d.ai/v2\n",
            "apiVersion: 'llm-d.ai/v2' is not supported",
            id="api-version-typo",
        ),
    ],
)
def test_section_mistakes(text: str, fragment: str) -> None:
    with pytest.raises(PickerConfigError) as info:
        load(text) if not text.startswith("apiVersion") else load_picker_config(
            text + "kind: EndpointPickerConfig\n", CTX
        )
    assert fragment in str(info.value)


def test_sections_load_and_say_what_differs() -> None:
    scheduler = load(
        "featureGates: [dataLayer, prepareDataPlugins, haPopulateNonLeaderDatastore=false]\n"
        "plugins:\n- type: openai-parser\n- type: vllmgrpc-parser\n"
        "- type: metrics-data-source\n  parameters: {scheme: https, path: /stats}\n"
        "- type: core-metrics-extractor\n- type: queue-scorer\n"
        "requestHandler: {parsers: [{pluginRef: openai-parser}, {pluginRef: vllmgrpc-parser}]}\n"
        "dataLayer:\n  sources:\n  - pluginRef: metrics-data-source\n"
        "    extractors: [{pluginRef: core-metrics-extractor}]\n"
    )
    text = "\n".join(scheduler.warnings)
    assert "'vllmgrpc-parser': servegate's gateway serves HTTP" in text
    assert "scheme 'https'" in text and "path '/stats'" in text
    assert "haPopulateNonLeaderDatastore=false" in text
    assert "openai-parser" not in text.replace("as openai-parser does", "")
    assert "dataLayer=" not in text and "prepareDataPlugins=" not in text
    assert scheduler.describe()["warnings"] == list(scheduler.warnings)


def test_stock_data_layer_and_parser_load_without_warnings() -> None:
    scheduler = load(
        "plugins:\n- type: openai-parser\n- type: metrics-data-source\n"
        "- type: core-metrics-extractor\n- type: queue-scorer\n"
        "requestHandler: {parsers: [{pluginRef: openai-parser}]}\n"
        "dataLayer: {sources: [{pluginRef: metrics-data-source,"
        " extractors: [{pluginRef: core-metrics-extractor}]}]}\n"
    )
    assert scheduler.warnings == ()


def test_older_api_versions_load_with_a_warning() -> None:
    scheduler = load_picker_config(
        "apiVersion: config.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins: [{type: queue-scorer}]\n",
        CTX,
    )
    assert any("older spelling" in w for w in scheduler.warnings)


# -- flow control ------------------------------------------------------------------------------


def test_flow_control_policy_references() -> None:
    scheduler = load(
        "featureGates: [flowControl]\nplugins:\n- type: round-robin-fairness-policy\n"
        "- type: fcfs-ordering-policy\n- type: edf-ordering-policy\n- type: queue-scorer\n"
        "flowControl:\n  enableEviction: true\n  priorityBands:\n"
        "  - {priority: 1, fairnessPolicyRef: round-robin-fairness-policy,"
        " orderingPolicyRef: fcfs-ordering-policy}\n"
        "  - {priority: 2, orderingPolicyRef: edf-ordering-policy}\n"
    )
    text = "\n".join(scheduler.warnings)
    assert "earliest-deadline-first is not implemented" in text
    assert "enableEviction" in text
    assert "round-robin-fairness-policy" not in text and "fcfs" not in text.lower()
    for band, fragment in (
        ("{priority: 1, orderingPolicyRef: nope}", "orderingPolicyRef: pluginRef 'nope' names no"),
        (
            "{priority: 1, fairnessPolicyRef: fcfs-ordering-policy}",
            "is a 'fcfs-ordering-policy', not a fairness policy",
        ),
    ):
        with pytest.raises(PickerConfigError, match=fragment):
            load(
                f"plugins:\n- type: fcfs-ordering-policy\nflowControl:\n  priorityBands: [{band}]\n"
            )


def test_a_band_takes_its_own_queue_ttl() -> None:
    settings, _ = from_picker_sections(
        FlowControlSettings(),
        ["flowControl"],
        {
            "defaultRequestTTL": "60s",
            "priorityBands": [{"priority": -1, "defaultRequestTTL": "9000s"}, {"priority": 0}],
        },
        None,
    )
    assert settings.default_request_ttl_s == 60.0
    assert settings.band_ttls() == {-1: 9000.0}


def test_an_undeclared_utilization_detector_is_created_with_defaults() -> None:
    scheduler = load(
        "featureGates: [flowControl]\nplugins:\n- type: queue-scorer\n"
        "saturationDetector: {pluginRef: utilization-detector}\n"
    )
    assert scheduler.plugins["utilization-detector"].type == "utilization-detector"
    with pytest.raises(PickerConfigError, match="'concurrency-detector' names no plugin"):
        load(
            "plugins:\n- type: queue-scorer\nsaturationDetector: {pluginRef: concurrency-detector}\n"
        )


@pytest.mark.parametrize(
    ("waiting", "kv", "priority", "expected"),
    [
        pytest.param(0.0, 0.0, -1, 0.0, id="idle"),
        # saturation max(1/5, 0.2/0.8) = 0.25 → 300 · 0.25^5 = 0.293
        pytest.param(1.0, 0.2, -1, 300 * 0.25**5, id="quarter"),
        pytest.param(5.0, 0.0, -1, 1.0, id="saturated"),
    ],
)
def test_probabilistic_admitter(waiting: float, kv: float, priority: int, expected: float) -> None:
    admitter = ProbabilisticAdmitter.from_config("pa", {}, CTX)
    states = [endpoint_state(f"10.0.0.{i}:8000", waiting=waiting, kv_usage=kv) for i in (1, 2)]
    assert admitter.shed_probability(admitter.saturation(states)) == pytest.approx(expected)
    rng = random.Random(0)
    refused = sum(admitter.refusal(priority, states, rng) is not None for _ in range(2000))
    assert abs(refused / 2000 - expected) < 0.05
    assert admitter.refusal(0, states, rng) is None  # priority >= 0 is always admitted


def test_probabilistic_admitter_counts_unscraped_endpoints_as_full() -> None:
    admitter = ProbabilisticAdmitter.from_config("pa", {}, CTX)
    assert admitter.saturation([endpoint_state(scraped_at=0.0)]) == 1.0


# -- filters, scorers, handlers ----------------------------------------------------------------


def test_by_label() -> None:
    states = [
        endpoint_state("10.0.0.1:8000", labels={"role": "decode"}),
        endpoint_state("10.0.0.2:8000", labels={"role": "prefill"}),
        endpoint_state("10.0.0.3:8000"),
    ]
    strict = load(
        "plugins:\n- type: by-label\n  parameters: {label: role, validValues: [decode]}\n"
    )
    assert decide(strict, request(), states).targets == [states[0]]
    loose = load(
        "plugins:\n- type: by-label\n"
        "  parameters: {label: role, validValues: [decode], allowsNoLabel: true}\n"
    )
    assert set(decide(loose, request(), states).targets) == {states[0], states[2]}
    with pytest.raises(PickerConfigError, match="validValues must not be empty"):
        load("plugins:\n- type: by-label\n  parameters: {label: role}\n")


def test_encode_filter_keeps_encoders_only() -> None:
    roles = ["encode", "encode-prefill", "encode-prefill-decode", "prefill", "decode", ""]
    states = [
        endpoint_state(f"10.0.0.{i}:8000", labels={ROLE_LABEL: r} if r else None)
        for i, r in enumerate(roles, 1)
    ]
    scheduler = load("plugins:\n- type: encode-filter\n")
    assert set(decide(scheduler, request(), states).targets) == set(states[:3])


def test_utilization_filter() -> None:
    states = [
        endpoint_state("10.0.0.1:8000", running=41),
        endpoint_state("10.0.0.2:8000", kv_usage=0.9),
        endpoint_state("10.0.0.3:8000", running=10, kv_usage=0.5, in_flight_requests=3),
    ]
    conditions = (
        "[{metric: running-requests, maxValue: 40}, {metric: kv-cache-utilization, maxValue: 0.8}]"
    )
    scheduler = load(
        f"plugins:\n- type: utilization-filter\n  parameters: {{conditions: {conditions}}}\n"
    )
    assert decide(scheduler, request(), states).targets == [states[2]]
    tight = "[{metric: active-requests, maxValue: 2}, {metric: waiting-queue, maxValue: 0}]"
    strict = load(f"plugins:\n- type: utilization-filter\n  parameters: {{conditions: {tight}}}\n")
    assert set(decide(strict, request(), states).targets) == {states[0], states[1]}
    nothing = (
        "[{metric: running-requests, maxValue: 1}, {metric: kv-cache-utilization, maxValue: 0.1}]"
    )
    with pytest.raises(NoCandidates):
        decide(
            load(
                f"plugins:\n- type: utilization-filter\n  parameters: {{conditions: {nothing}}}\n"
            ),
            request(),
            states,
        )
    fallback = load(
        "plugins:\n- type: utilization-filter\n"
        f"  parameters: {{conditions: {nothing}, fallbackOnEmpty: true}}\n"
    )
    assert len(decide(fallback, request(), states).targets) == 3
    with pytest.raises(PickerConfigError, match="at most 1"):
        load(
            "plugins:\n- type: utilization-filter\n"
            "  parameters: {conditions: [{metric: kv-cache-utilization, maxValue: 80}]}\n"
        )


def test_session_affinity_filter_pins_the_session() -> None:
    scheduler = load("plugins:\n- type: session-affinity-filter\n- type: queue-scorer\n")
    states = eps(3)
    first = decide(scheduler, request(), states)
    (token,) = (
        scheduler.plugins["session-affinity-filter"]
        .response_headers(  # type: ignore[attr-defined]
            request(), first
        )
        .values()
    )
    pinned = decide(scheduler, request(headers={"x-session-token": token}), states)
    assert pinned.targets == [first.endpoint]
    gone = [s for s in states if s is not first.endpoint]
    assert len(decide(scheduler, request(headers={"x-session-token": token}), gone).targets) == 2


@pytest.mark.parametrize(
    ("length", "low", "high", "expected"),
    [
        pytest.param(1000, 0, 2048, 0.3 + 0.7 * (0.7 / 1.2048 + 0.3 * 1048 / 2048), id="fits"),
        pytest.param(1000, 0, 32768, 0.3 + 0.7 * (0.7 / 4.2768 + 0.3 * 31768 / 32768), id="wide"),
        pytest.param(1000, 4096, 8192, 0.3 / 4.096, id="below"),
        pytest.param(9000, 0, 8192, 0.3 / 1.808, id="above"),
        pytest.param(5, 5, 5, 1.0, id="exact"),
    ],
)
def test_context_length_score(length: int, low: int, high: int, expected: float) -> None:
    assert range_score(length, low, high) == pytest.approx(expected)


def test_context_length_aware_scores_and_filters() -> None:
    label = "llm-d.ai/context-length-range"
    states = [
        endpoint_state("10.0.0.1:8000", labels={label: "0-2048"}),
        endpoint_state("10.0.0.2:8000", labels={label: "4096-8192"}),
        endpoint_state("10.0.0.3:8000"),
        endpoint_state("10.0.0.4:8000", labels={label: "big"}),
    ]
    scorer = load("plugins:\n- type: context-length-aware\n")
    result = decide(scorer, request(1000), states)
    scores = [result.results["default"].scores[s.address]["context-length-aware"] for s in states]
    assert scores[0] > 0.3 > scores[1] > 0.0
    assert scores[2:] == [0.5, 0.0]
    assert result.endpoint is states[0]
    filtering = load(
        "plugins:\n- type: context-length-aware\n  parameters: {enableFiltering: true}\n"
    )
    assert set(decide(filtering, request(1000), states).targets) == {states[0], states[2]}


def test_header_label_affinity_scorer() -> None:
    states = [
        endpoint_state(f"10.0.0.{i}:8000", labels={"zone": z}) for i, z in ((1, "a"), (2, "b"))
    ]
    scheduler = load(
        "plugins:\n- type: header-label-affinity-scorer\n"
        "  parameters: {headerName: X-Zone, labelKey: zone}\n"
    )
    for zone, winner in (("a", 0), ("b", 1)):
        assert (
            decide(scheduler, request(headers={"x-zone": zone}), states).endpoint is states[winner]
        )


HEADER_PROFILES = """\
plugins:
- type: prefill-filter
- type: decode-filter
- type: header-profile-handler
  parameters: {headerName: X-Stage}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}]
- name: decode
  plugins: [{pluginRef: decode-filter}]
"""


def test_header_profile_handler() -> None:
    scheduler = load(HEADER_PROFILES)
    states = [
        endpoint_state("10.0.0.1:8000", labels={ROLE_LABEL: "prefill"}),
        endpoint_state("10.0.0.2:8000", labels={ROLE_LABEL: "decode"}),
    ]
    assert decide(scheduler, request(headers={"x-stage": "prefill"}), states).targets == [states[0]]
    assert decide(scheduler, request(headers={"x-stage": "decode"}), states).profile == "decode"
    assert decide(scheduler, request(), states).targets == [states[1]]  # defaultProfile
    with pytest.raises(NoCandidates):
        decide(scheduler, request(headers={"x-stage": "encode"}), states)


# -- P/D and E/PD ----------------------------------------------------------------------------------

EPD = """\
plugins:
- type: encode-filter
- type: prefill-filter
- type: decode-filter
- type: always-disagg-multimodal-decider
- type: always-disagg-pd-decider
- type: disagg-profile-handler
  parameters:
    deciders: {encode: always-disagg-multimodal-decider, prefill: always-disagg-pd-decider}
schedulingProfiles:
- name: encode
  plugins: [{pluginRef: encode-filter}]
- name: prefill
  plugins: [{pluginRef: prefill-filter}]
- name: decode
  plugins: [{pluginRef: decode-filter}]
"""
IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        ],
    }
]


def test_epd_runs_the_encode_stage_for_multimodal_requests_only() -> None:
    scheduler = load(EPD)
    states = [
        endpoint_state("10.0.0.1:8000", labels={ROLE_LABEL: "encode"}),
        endpoint_state("10.0.0.2:8000", labels={ROLE_LABEL: "prefill"}),
        endpoint_state("10.0.0.3:8000", labels={ROLE_LABEL: "decode"}),
    ]
    multimodal = decide(scheduler, request(messages=IMAGE), states)
    assert multimodal.encoders == [states[0]]
    assert (multimodal.prefill, multimodal.endpoint) == (states[1], states[2])
    assert multimodal.pd_decision == PREFILL_DECODE
    text = decide(scheduler, request(messages=[{"role": "user", "content": "hi"}]), states)
    assert text.encoders == [] and text.prefill is states[1]


def test_prefix_decider_prompt_tokens_gate() -> None:
    scheduler = load(
        "plugins:\n- type: prefill-filter\n- type: decode-filter\n"
        "- type: prefix-based-pd-decider\n  parameters: {nonCachedTokens: 8, promptTokens: 100}\n"
        "- type: disagg-profile-handler\n"
        "  parameters: {deciders: {prefill: prefix-based-pd-decider}}\n"
        "schedulingProfiles:\n- name: prefill\n  plugins: [{pluginRef: prefill-filter}]\n"
        "- name: decode\n  plugins: [{pluginRef: decode-filter}]\n"
    )
    states = [
        endpoint_state("10.0.0.1:8000", labels={ROLE_LABEL: "prefill"}),
        endpoint_state("10.0.0.2:8000", labels={ROLE_LABEL: "decode"}),
    ]
    assert decide(scheduler, request(99), states).pd_decision == DECODE_ONLY
    assert decide(scheduler, request(100), states).pd_decision == PREFILL_DECODE


def test_a_prefill_profile_without_decider_loads_with_a_warning() -> None:
    scheduler = load(
        "plugins:\n- type: prefill-filter\n- type: decode-filter\n- type: disagg-profile-handler\n"
        "schedulingProfiles:\n- name: prefill\n  plugins: [{pluginRef: prefill-filter}]\n"
        "- name: decode\n  plugins: [{pluginRef: decode-filter}]\n"
    )
    assert any("every request is decode-only" in w for w in scheduler.warnings)


def test_stock_llmd_pd_config_file_round_trips_as_yaml() -> None:
    doc = yaml.safe_load(HEAD + EPD)
    assert load_picker_config(doc, CTX).handler.type == "disagg-profile-handler"


def test_the_sidecar_gets_the_encoders() -> None:
    from servegate.gateway.disagg import sidecar_headers

    decode = endpoint_state("10.0.0.3:8000")
    encoders = [endpoint_state("10.0.0.1:8000"), endpoint_state("[fd00::1]:8000")]
    headers = sidecar_headers(Decision(decode, [], encoders=encoders))
    assert headers == {"x-encoder-hosts-ports": "10.0.0.1:8000,[fd00::1]:8000"}


# -- p2p-source-producer ------------------------------------------------------------------------

P2P = """\
plugins:
- type: approx-prefix-cache-producer
  parameters: {blockSizeTokens: 16, autoTune: false}
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: approx-prefix-cache-producer}
- type: queue-scorer
- type: p2p-source-producer
  parameters: {prefixMatchInfoProducerName: approx-prefix-cache-producer, minCachedTokenDelta: %d}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 1}
  - {pluginRef: queue-scorer, weight: 10}
  - {pluginRef: max-score-picker}
"""


def test_p2p_source_names_the_peer_that_holds_the_prompt() -> None:
    scheduler = load(P2P % 16)
    producer = scheduler.plugins["approx-prefix-cache-producer"]
    assert isinstance(producer, PrefixProducer)
    holder, idle, busy = (
        endpoint_state("10.0.0.1:8000", waiting=10),
        endpoint_state("10.0.0.2:8000", waiting=0),
        endpoint_state("10.0.0.3:8000", waiting=5),
    )
    states = [holder, idle, busy]
    req = request(160)
    producer.source.index.insert(holder.address, producer.source.block_keys(req))
    decision = decide(scheduler, req, states)
    assert decision.endpoint is idle  # the queue outvotes the prefix
    scheduler.pre_request(req, decision, 1.0)
    assert decision.upstream_headers == {"x-kv-cache-source-host-port": holder.address}
    # the decision was recorded after the hint was computed: idle now holds the prompt
    again = request(160)
    second = decide(scheduler, again, states)
    scheduler.pre_request(again, second, 1.0)
    assert second.endpoint is idle and second.upstream_headers == {}


def test_p2p_source_needs_the_minimum_token_delta() -> None:
    scheduler = load(P2P % 161)
    producer = scheduler.plugins["approx-prefix-cache-producer"]
    assert isinstance(producer, PrefixProducer)
    states = [endpoint_state("10.0.0.1:8000", waiting=10), endpoint_state("10.0.0.2:8000")]
    req = request(160)
    producer.source.index.insert(states[0].address, producer.source.block_keys(req))
    decision = decide(scheduler, req, states)
    scheduler.pre_request(req, decision, 1.0)
    assert decision.endpoint is states[1] and decision.upstream_headers == {}


async def test_the_gateway_sends_the_p2p_source_to_the_replica() -> None:
    import aiohttp
    from tests.unit.test_disagg_gateway import MODEL, Upstream, config, ready

    from servegate.testing.gateway import GatewayRunner

    first, second = await Upstream().start(), await Upstream().start()
    picker = yaml.safe_load(
        HEAD + "plugins:\n- type: approx-prefix-cache-producer\n"
        "  parameters: {blockSizeTokens: 16, autoTune: false}\n"
        "- type: prefix-cache-scorer\n- type: header-label-affinity-scorer\n"
        "  parameters: {headerName: x-zone, labelKey: zone}\n- type: p2p-source-producer\n"
        "- type: max-score-picker\nschedulingProfiles:\n- name: default\n  plugins:\n"
        "  - {pluginRef: prefix-cache-scorer, weight: 1}\n"
        "  - {pluginRef: header-label-affinity-scorer, weight: 10}\n"
        "  - {pluginRef: max-score-picker}\n"
    )
    endpoints = [
        {"url": first.url, "labels": {"zone": "a"}},
        {"url": second.url, "labels": {"zone": "b"}},
    ]
    body = {"model": MODEL, "prompt": "a long shared document " * 40, "max_tokens": 2}
    try:
        async with GatewayRunner(config(endpoints, picker)) as gw, aiohttp.ClientSession() as http:
            await ready(gw, 2)
            for zone in ("a", "b"):
                async with http.post(
                    gw.url + "/v1/completions", json=body, headers={"x-zone": zone}
                ) as resp:
                    assert resp.status == 200
        (call_a,) = first.calls
        (call_b,) = second.calls
        assert "x-kv-cache-source-host-port" not in call_a.headers
        assert call_b.headers["x-kv-cache-source-host-port"] == first.address
    finally:
        await first.stop()
        await second.stop()


def test_config_check_lists_the_warnings(tmp_path: Any) -> None:
    import orjson
    from typer.testing import CliRunner

    from servegate.cli import app

    (tmp_path / "picker.yaml").write_text(
        HEAD + "plugins:\n- type: dcgm-data-source\n- type: queue-scorer\n"
        "dataLayer: {sources: [{pluginRef: dcgm-data-source}]}\n"
    )
    (tmp_path / "servegate.yaml").write_text(
        "pool:\n  endpoints: [{url: 'http://127.0.0.1:9'}]\npicker: picker.yaml\n"
    )
    result = CliRunner().invoke(app, ["config", "check", str(tmp_path / "servegate.yaml")])
    assert result.exit_code == 0, result.output
    out = orjson.loads(result.stdout[result.stdout.index("{") :])
    (warning,) = out["resolved_profiles"]["warnings"]
    assert "'dcgm-data-source'" in warning and "DCGM" in warning


WARNED = {
    "burst-prefix-cache-producer": "",
    "tokenizer": "",
    "token-producer": "",
    "mm-embeddings-cache-producer": "",
    "mm-embeddings-cache-scorer": "",
    "anthropic-parser": "",
    "vllmhttp-parser": "",
    "sglanghttp-parser": "",
    "passthrough-parser": "",
    "vllmgrpc-parser": "",
    "vertexai-parser": "",
    "k8s-notification-source": "",
    "dcgm-data-source": "",
    "dcgm-extractor": "",
    "topology-extractor": "",
    "file-discovery": "{path: /x}",
    "global-strict-fairness-policy": "",
    "program-aware-fairness": "",
    "edf-ordering-policy": "",
    "slo-deadline-ordering-policy": "",
    "static-usage-limit-policy": "",
    "soft-reflective-ceiling-policy": "",
    "priority-holdback-policy": "",
    "sheddable-eviction-filter": "",
    "priority-then-time-eviction-order-policy": "",
    "endpoint-attribute-filter": (
        "{attribute: a, algorithm: {type: threshold, threshold: {operator: Equal, value: 1}}}"
    ),
    "endpoint-attribute-scorer": "{attributeKey: a, algorithm: {}}",
    "topology-affinity-filter": "",
    "topology-affinity-scorer": "",
    "agent-identity": "",
    "request-attribute-reporter": "",
    "disaggregatedset-rollout-screener": "",
    "multicluster-queue-scorer": "",
    "multicluster-kv-cache-utilization-scorer": "",
    "multicluster-session-affinity-filter": "",
    "multicluster-metrics-data-source": "",
    "multicluster-metrics-extractor": "",
    "multicluster-file-discovery": "{path: /x}",
}
IMPLEMENTED = (
    "approx-prefix-cache-producer",
    "precise-prefix-cache-producer",
    "inflight-load-producer",
    "openai-parser",
    "metrics-data-source",
    "core-metrics-extractor",
    "models-data-source",
    "models-data-extractor",
    "endpoint-notification-source",
    "round-robin-fairness-policy",
    "fcfs-ordering-policy",
    "probabilistic-admitter",
    "encode-filter",
    "context-length-aware",
    "session-affinity-filter",
)


@pytest.mark.parametrize("plugin_type", sorted(WARNED))
def test_an_accepted_plugin_warns_once_naming_itself(plugin_type: str) -> None:
    params = WARNED[plugin_type]
    text = f"plugins:\n- type: {plugin_type}\n" + (f"  parameters: {params}\n" if params else "")
    scheduler = load(text + "- type: queue-scorer\n")
    mine = [w for w in scheduler.warnings if f"'{plugin_type}'" in w]
    assert len(mine) == 1, scheduler.warnings


@pytest.mark.parametrize("plugin_type", IMPLEMENTED)
def test_an_implemented_plugin_loads_without_warnings(plugin_type: str) -> None:
    scheduler = load(f"plugins:\n- type: {plugin_type}\n- type: queue-scorer\n")
    assert scheduler.warnings == ()


# -- vLLM's single-API-server data parallelism ---------------------------------------------------

DP_METRICS = "".join(
    f'vllm:{name}{{engine="{rank}",model_name="m"}} {value}\n'
    for rank, waiting, running in ((0, 3.0, 4.0), (1, 0.0, 2.0), (2, 5.0, 0.0))
    for name, value in (("num_requests_waiting", waiting), ("num_requests_running", running))
)


def test_vllm_metrics_give_the_load_of_each_rank() -> None:
    from servegate.datalayer.metrics_parser import MetricsParser
    from servegate.engines.vllm import SPEC

    metrics = MetricsParser(SPEC).parse(DP_METRICS, 1.0).metrics
    assert metrics.rank_load == {0: 7.0, 1: 2.0, 2: 5.0}
    assert (metrics.waiting, metrics.running) == (8.0, 6.0)
    one = 'vllm:num_requests_waiting{engine="0",model_name="m"} 1\n'
    assert MetricsParser(SPEC).parse(one, 1.0).metrics.rank_load is None


def test_rank_header_route_names_the_least_loaded_rank() -> None:
    from servegate.gateway.disagg import rank_header_route

    state = endpoint_state("10.0.0.1:8000")
    assert rank_header_route(state, {"a": "b"}) == ("http://10.0.0.1:8000", {"a": "b"})
    state.metrics.rank_load = {0: 7.0, 1: 2.0, 2: 2.0}
    assert rank_header_route(state, {})[1] == {"X-data-parallel-rank": "1"}


def test_rank_header_and_primary_port_do_not_mix() -> None:
    with pytest.raises(PickerConfigError, match="two different deployments"):
        load(
            "plugins:\n- type: data-parallel-profile-handler\n"
            "  parameters: {rankHeader: true, primaryPort: 8000}\n"
        )
    handler = load(
        "plugins:\n- type: data-parallel-profile-handler\n  parameters: {rankHeader: true}\n"
    )
    decision = decide(handler, request(), eps(2))
    assert decision.rank_header and decision.primary_port is None


async def test_the_gateway_pins_the_rank_behind_one_api_server() -> None:
    import aiohttp
    from aiohttp import web
    from tests.unit.test_disagg_gateway import MODEL, Upstream, config, ready, wait_until

    from servegate.testing.gateway import GatewayRunner

    class DPUpstream(Upstream):
        async def _metrics(self, request: web.Request) -> web.Response:
            return web.Response(text=DP_METRICS.replace('model_name="m"', f'model_name="{MODEL}"'))

    server = await DPUpstream().start()
    picker = yaml.safe_load(
        HEAD + "plugins:\n- type: data-parallel-profile-handler\n  parameters: {rankHeader: true}\n"
        "- type: queue-scorer\n"
    )
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    try:
        async with GatewayRunner(config([{"url": server.url}], picker)) as gw:
            await ready(gw, 1)
            await wait_until(
                lambda: all(s.metrics.rank_load for s in gw.gateway.pool), "ranks scraped"
            )
            async with aiohttp.ClientSession() as http:
                forged = {"X-data-parallel-rank": "2"}
                async with http.post(gw.url + "/v1/completions", json=body, headers=forged) as r:
                    assert r.status == 200
        (call,) = server.calls
        assert call.headers["x-data-parallel-rank"] == "1"
        assert "x-data-parallel-host-port" not in call.headers
    finally:
        await server.stop()


def test_the_pd_decider_counts_cpu_offloaded_blocks_in_full() -> None:
    """llm-d's decider counts cached blocks unweighted: three blocks offloaded to CPU
    save 12 of 16 prompt tokens, not 0.8 × 12."""
    from servegate.scheduling.prefix.events import BlockStored, EventBatch

    scheduler = load(
        "plugins:\n- type: prefill-filter\n- type: decode-filter\n"
        "- type: precise-prefix-cache-producer\n"
        "  parameters: {tokenProcessorConfig: {blockSizeTokens: 4}}\n"
        "- type: prefix-based-pd-decider\n"
        "  parameters: {nonCachedTokens: 5, prefixMatchInfoProducerName: "
        "precise-prefix-cache-producer}\n"
        "- type: disagg-profile-handler\n"
        "  parameters: {deciders: {prefill: prefix-based-pd-decider}}\n"
        "schedulingProfiles:\n- name: prefill\n  plugins: [{pluginRef: prefill-filter}]\n"
        "- name: decode\n  plugins: [{pluginRef: decode-filter}]\n"
    )
    prefill = endpoint_state("10.0.0.1:8000", labels={ROLE_LABEL: "prefill"})
    decode = endpoint_state("10.0.0.2:8000", labels={ROLE_LABEL: "decode"})
    producer = scheduler.plugins["precise-prefix-cache-producer"]
    assert isinstance(producer, PrefixProducer)
    tokens = list(range(100, 116))
    event = BlockStored([1, 2, 3], None, tokens[:12], 4, None, None, "CPU")
    producer.source.index.apply(decode.address, EventBatch(0.0, [event]))
    req = request(16)
    req.cache["token_ids"] = tokens
    # weighted: 16 − round(0.8 · 3/4 · 16) = 6 ≥ 5 would disaggregate; unweighted 4 < 5
    assert decide(scheduler, req, [prefill, decode]).pd_decision == DECODE_ONLY
    cold = request(16)
    cold.cache["token_ids"] = list(range(500, 516))
    assert decide(scheduler, cold, [prefill, decode]).pd_decision == PREFILL_DECODE


def test_p2p_source_counts_only_the_peers_cpu_tier_with_a_precise_index() -> None:
    from servegate.scheduling.prefix.events import BlockStored, EventBatch

    scheduler = load(
        "plugins:\n- type: precise-prefix-cache-producer\n"
        "  parameters: {tokenProcessorConfig: {blockSizeTokens: 4}}\n"
        "- type: queue-scorer\n- type: p2p-source-producer\n"
        "  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}\n"
        "- type: max-score-picker\nschedulingProfiles:\n- name: default\n  plugins:\n"
        "  - {pluginRef: queue-scorer}\n  - {pluginRef: max-score-picker}\n"
    )
    producer = scheduler.plugins["precise-prefix-cache-producer"]
    assert isinstance(producer, PrefixProducer)
    gpu_only = endpoint_state("10.0.0.1:8000", waiting=9)
    cpu_peer = endpoint_state("10.0.0.2:8000", waiting=8)
    computing = endpoint_state("10.0.0.3:8000", waiting=0)
    tokens = list(range(100, 116))
    for state, medium in ((gpu_only, "GPU"), (cpu_peer, "CPU")):
        event = BlockStored([1, 2, 3], None, tokens[:12], 4, None, None, medium)
        producer.source.index.apply(state.address, EventBatch(0.0, [event]))
    req = request(16)
    req.cache["token_ids"] = tokens
    decision = decide(scheduler, req, [gpu_only, cpu_peer, computing])
    scheduler.pre_request(req, decision, 1.0)
    assert decision.endpoint is computing
    assert decision.upstream_headers == {"x-kv-cache-source-host-port": cpu_peer.address}
