"""`pool.latency:`: the predictor's learning-rate cap from the config file."""

from __future__ import annotations

import pytest

from servegate.config import ConfigError, PoolSettings, parse_config
from servegate.datalayer.outlier import OutlierDetectionSettings
from servegate.gateway.metrics import GatewayMetrics
from servegate.gateway.pools import build_pool_state
from servegate.scheduling.latency.predictor import LEARN_PER_S


@pytest.mark.parametrize(
    ("text", "cap"),
    [
        ("pool: {}", LEARN_PER_S),
        ("pool: {latency: {learn_per_s: 250}}", 250.0),
        ("pool: {latency: {learn_per_s: null}}", 0.0),  # every stream
        ("pool: {latency: {learn_per_s: 0}}", 0.0),
    ],
)
def test_the_pools_predictor_gets_the_configured_cap(text: str, cap: float) -> None:
    settings = parse_config(text).pool
    assert isinstance(settings, PoolSettings)
    state = build_pool_state(settings, OutlierDetectionSettings(), GatewayMetrics())
    assert state.latency.learn_per_s == cap


@pytest.mark.parametrize(
    "text", ["pool: {latency: {learn_per_s: -1}}", "pool: {latency: {learn_every: 2}}"]
)
def test_a_bad_cap_is_a_config_error_naming_it(text: str) -> None:
    with pytest.raises(ConfigError, match="latency"):
        parse_config(text)
