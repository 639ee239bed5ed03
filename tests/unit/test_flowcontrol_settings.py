import pytest

from servegate.config import ConfigError, parse_config
from servegate.scheduling.config import PickerConfigError, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.flowcontrol import (
    FlowControlSectionError,
    FlowControlSettings,
    from_picker_sections,
    queues_from_settings,
)
from servegate.scheduling.flowcontrol.queues import BandLimits
from servegate.scheduling.flowcontrol.units import parse_duration, parse_quantity


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        pytest.param("200ms", 0.2, id="ms"),
        pytest.param("60s", 60.0, id="s"),
        pytest.param("1m30s", 90.0, id="compound"),  # 60 + 30
        pytest.param("1.5h", 5400.0, id="fraction"),  # 1.5 x 3600
        pytest.param("0", 0.0, id="zero"),
        pytest.param(2.5, 2.5, id="number"),
    ],
)
def test_durations(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "10 s", "1d", "-1s", "ms"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        pytest.param("1Gi", 2**30, id="Gi"),
        pytest.param("500M", 500_000_000, id="M"),
        pytest.param("5k", 5000, id="k"),
        pytest.param(100, 100, id="int"),
        pytest.param("100", 100, id="plain"),
    ],
)
def test_quantities(text: str | int, value: int) -> None:
    assert parse_quantity(text) == value


def test_bad_quantity() -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity("lots")


def test_llm_d_sections_translate() -> None:
    settings, ref = from_picker_sections(
        FlowControlSettings(),
        ["flowControl"],
        {
            "maxBytes": "1Gi",
            "maxRequests": "2k",
            "defaultRequestTTL": "30s",
            "defaultPriorityBand": {"maxRequests": 100},
            "defaultNegativePriorityBand": {"maxRequests": 10, "maxBytes": "1M"},
            "priorityBands": [{"priority": 10, "maxRequests": 50}],
            "saturationDetector": {"pluginRef": "my-detector"},
        },
        None,
    )
    assert settings.enabled and ref == "my-detector"
    assert (settings.max_bytes, settings.max_requests, settings.default_request_ttl_s) == (
        2**30,
        2000,
        30.0,
    )
    queues = queues_from_settings(settings)
    assert queues.band(10).limits == BandLimits(50, 1_000_000_000)
    assert queues.band(3).limits == BandLimits(100, 1_000_000_000)
    assert queues.band(-1).limits == BandLimits(10, 1_000_000)


def test_deprecated_top_level_thresholds_make_a_utilization_detector() -> None:
    settings, ref = from_picker_sections(
        FlowControlSettings(), None, None, {"queueDepthThreshold": 8, "kvCacheUtilThreshold": 0.9}
    )
    assert ref is None
    assert settings.saturation_detector.type == "utilization-detector"
    assert settings.saturation_detector.parameters == {
        "queueDepthThreshold": 8,
        "kvCacheUtilThreshold": 0.9,
    }


@pytest.mark.parametrize(
    ("gates", "flow", "top", "fragment"),
    [
        pytest.param(["dataLayr"], None, None, "'dataLayr' is not a feature gate", id="gate"),
        pytest.param(["flowControl=maybe"], None, None, "flowControl=true", id="gate-value"),
        pytest.param(
            None, {"enableEvictions": True}, None, "flowControl.enableEvictions", id="field"
        ),
        pytest.param(None, {"maxBytes": "lots"}, None, "flowControl.maxBytes", id="quantity"),
        pytest.param(None, {"defaultRequestTTL": "1 minute"}, None, "defaultRequestTTL", id="ttl"),
        pytest.param(
            None,
            {"priorityBands": [{"priority": 1}, {"priority": 1}]},
            None,
            "listed twice",
            id="dup-band",
        ),
        pytest.param(
            None, None, {"pluginRef": "x", "queueDepthThreshold": 3}, "not both", id="both"
        ),
    ],
)
def test_section_errors_name_the_field(
    gates: list[str] | None,
    flow: dict[str, object] | None,
    top: dict[str, object] | None,
    fragment: str,
) -> None:
    with pytest.raises(FlowControlSectionError) as info:
        from_picker_sections(FlowControlSettings(), gates, flow, top)
    assert fragment in str(info.value)


def test_servegate_section_in_the_config_file() -> None:
    cfg = parse_config(
        "flow_control:\n"
        "  enabled: true\n"
        "  objectives: [{name: critical, priority: 10}, {name: batch, priority: -1}]\n"
        "  priority_bands: [{priority: 10, max_requests: 7}]\n",
        environ={},
    )
    assert cfg.flow_control.priorities() == {"critical": 10, "batch": -1}
    assert cfg.flow_control.bands() == {10: BandLimits(7, 1_000_000_000)}
    with pytest.raises(ConfigError, match=r"flow_control\.max_requets"):
        parse_config("flow_control: {max_requets: 3}\n", environ={})


def test_picker_config_checks_the_detector_reference_at_load() -> None:
    doc = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "featureGates": ["flowControl"],
        "plugins": [{"type": "queue-scorer"}, {"name": "gate", "type": "queue-scorer"}],
        "flowControl": {"saturationDetector": {"pluginRef": "missing"}},
    }
    with pytest.raises(PickerConfigError, match="pluginRef 'missing' names no plugin"):
        load_picker_config(doc, PluginContext())
    doc["flowControl"] = {"saturationDetector": {"pluginRef": "gate"}}
    with pytest.raises(PickerConfigError, match="not a saturation detector"):
        load_picker_config(doc, PluginContext())
