"""`FakeKubeApi` must filter by label selector exactly as discovery's own selector does."""

from __future__ import annotations

import pytest

from servegate.pool.discovery.settings import LabelSelector
from servegate.testing.kubeapi import parse_label_selector, selector_matches

SELECTORS = [
    {"matchLabels": {"app": "vllm"}},
    {"matchLabels": {"llm-d.ai/inferenceServing": "true", "llm-d.ai/model": "qwen3-8b"}},
    {
        "matchExpressions": [
            {"key": "llm-d.ai/role", "operator": "In", "values": ["decode", "prefill-decode"]}
        ]
    },
    {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["canary"]}]},
    {
        "matchExpressions": [
            {"key": "gpu", "operator": "Exists"},
            {"key": "drain", "operator": "DoesNotExist"},
        ]
    },
]
LABELS = [
    {},
    {"app": "vllm"},
    {"app": "vllm", "gpu": "h200", "tier": "canary"},
    {"llm-d.ai/inferenceServing": "true", "llm-d.ai/model": "qwen3-8b", "llm-d.ai/role": "decode"},
    {"llm-d.ai/role": "prefill", "gpu": "a", "drain": "1"},
]


@pytest.mark.parametrize(
    "selector", SELECTORS, ids=lambda s: LabelSelector.model_validate(s).to_query()
)
@pytest.mark.parametrize("labels", LABELS, ids=lambda labels: ",".join(labels) or "none")
def test_fake_filters_like_the_selector_it_is_sent(
    selector: dict[str, object], labels: dict[str, str]
) -> None:
    parsed = LabelSelector.model_validate(selector)
    assert selector_matches(parse_label_selector(parsed.to_query()), labels) is parsed.matches(
        labels
    )


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        pytest.param("a=b,c!=d", [("a", "=", ("b",)), ("c", "!=", ("d",))], id="equality"),
        pytest.param("a==b", [("a", "=", ("b",))], id="double-equals"),
        pytest.param(
            "x in (1, 2),!y", [("x", "in", ("1", "2")), ("y", "!exists", ())], id="set-and-not"
        ),
        pytest.param("", [], id="empty"),
    ],
)
def test_parse_label_selector(query: str, expected: list[tuple[str, str, tuple[str, ...]]]) -> None:
    assert parse_label_selector(query) == expected


def test_garbage_selector_is_an_error() -> None:
    with pytest.raises(ValueError, match="unable to parse"):
        parse_label_selector("a in b")
