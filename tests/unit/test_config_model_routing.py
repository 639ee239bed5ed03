import pytest

from servegate.config import ConfigError, parse_config

TWO_POOLS = """
picker: {plugins: [{type: random-picker}], schedulingProfiles: [{name: default, plugins: [{pluginRef: random-picker}]}]}
flow_control: {enabled: true}
pools:
- name: a
  endpoints: [{url: "http://127.0.0.1:1", model: m1}]
- name: b
  models: [{id: m2}]
  flow_control: {enabled: false}
  picker: other.yaml
"""


def test_pools_inherit_the_top_level_picker_and_flow_control() -> None:
    cfg = parse_config(TWO_POOLS, environ={})
    a, b = cfg.pool_entries()
    assert (a.name, a.flow_control is not None and a.flow_control.enabled) == ("a", True)
    assert isinstance(a.picker, dict)
    assert (b.name, b.flow_control is not None and b.flow_control.enabled, b.picker) == (
        "b",
        False,
        "other.yaml",
    )


def test_pool_is_the_first_of_pools() -> None:
    cfg = parse_config(TWO_POOLS, environ={})
    assert cfg.pool.name == "a"
    assert cfg.pool.endpoints[0].model == "m1"


def test_one_pool_config_is_one_entry() -> None:
    cfg = parse_config("pool: {name: solo, models: [{id: m}]}", environ={})
    (entry,) = cfg.pool_entries()
    assert (entry.name, entry.models[0].id, entry.picker) == ("solo", "m", None)


def test_shorthand_and_crd_shapes_mean_the_same() -> None:
    short = parse_config(
        """
pools: [{name: p, models: [{id: v1}, {id: v2}]}]
model_rewrites:
- name: canary
  poolRef: p
  rules:
  - matches: [{model: m}]
    targets: [{modelRewrite: v1, weight: 90}, {modelRewrite: v2, weight: 10}]
""",
        environ={},
    )
    crd = parse_config(
        """
pools: [{name: p, models: [{id: v1}, {id: v2}]}]
model_rewrites:
- apiVersion: inference.networking.x-k8s.io/v1alpha2
  kind: InferenceModelRewrite
  metadata: {name: canary}
  spec:
    poolRef: {group: inference.networking.k8s.io, name: p}
    rules:
    - matches: [{model: {type: Exact, value: m}}]
      targets: [{modelRewrite: v1, weight: 90}, {modelRewrite: v2, weight: 10}]
""",
        environ={},
    )
    assert short.model_rewrites == crd.model_rewrites


def _rewrite(rules: str, extra: str = "") -> str:
    return f"pools: [{{name: p}}]\nmodel_rewrites:\n- rules: {rules}\n{extra}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pools: [{name: x}, {name: x}]", "names must be unique; ['x']"),
        ("pool: {name: y}\npools: [{name: x}]", "`pool` and `pools` are both set"),
        (
            _rewrite("[{matches: [{model: m}], targets: [{modelRewrite: a, weight: 0}]}]"),
            "must add up to more than 0",
        ),
        (
            _rewrite("[{matches: [{model: m}], targets: [{modelRewrite: a, weight: -1}]}]"),
            "greater than or equal to 0",
        ),
        (_rewrite("[{matches: [{model: m}], targets: []}]"), "at least 1 item"),
        (
            _rewrite("[{matches: [{model: m}], targets: [{modelRewrite: a}, {modelRewrite: a}]}]"),
            "listed twice",
        ),
        (
            _rewrite(
                "[{matches: [{model: m}], targets: [{modelRewrite: a}]},"
                " {matches: [{model: m}], targets: [{modelRewrite: b}]}]"
            ),
            "'m' is already matched",
        ),
        (
            _rewrite(
                "[{matches: [], targets: [{modelRewrite: a}]}, {targets: [{modelRewrite: b}]}]"
            ),
            "at most one rule may have empty `matches`",
        ),
        (
            _rewrite(
                "[{matches: [{model: m}], targets: [{modelRewrite: a}]}]", "  poolRef: nope\n"
            ),
            "poolRef 'nope' names no pool",
        ),
        (
            _rewrite(
                "[{matches: [{model: {type: RegularExpression, value: 'm.*'}}], "
                "targets: [{modelRewrite: a}]}]"
            ),
            "'RegularExpression' is not supported",
        ),
        (
            _rewrite("[{matches: [{model: m}], targets: [{model_rewrite: a}]}]"),
            "unknown field",
        ),
        (
            _rewrite(
                "[{matches: [{model: m}], targets: [{modelRewrite: a}]}]", "  sticky: {hdr: x}\n"
            ),
            "unknown field",
        ),
        ("model_rewrites: [{kind: HTTPRoute, spec: {rules: []}}]", "only InferenceModelRewrite"),
    ],
    ids=[
        "duplicate-pool-names",
        "pool-and-pools",
        "zero-weights",
        "negative-weight",
        "no-targets",
        "target-twice",
        "model-matched-twice",
        "two-catch-alls",
        "unknown-poolref",
        "regex-match",
        "misspelt-target-key",
        "misspelt-sticky-key",
        "wrong-kind",
    ],
)
def test_bad_model_routing_config_is_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, environ={})
    assert message in str(info.value)
