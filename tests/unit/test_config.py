from pathlib import Path

import pytest

from servegate.config import ConfigError, env_overrides, load_config, parse_config
from servegate.datalayer.scraper import ScrapeSettings
from servegate.pool.endpoint import Role


def test_defaults_without_a_file() -> None:
    cfg = load_config(None, environ={})
    assert cfg.gateway.port == 8080
    assert cfg.pool.endpoints == ()
    assert cfg.picker is None


def test_endpoint_fields_and_labels(tmp_path: Path) -> None:
    path = tmp_path / "sg.yaml"
    path.write_text(
        """
pool:
  endpoints:
  - url: http://10.0.0.1:8000/
    labels: {llm-d.ai/engine-type: sglang, llm-d.ai/role: prefill, llm-d.ai/model: m}
  - url: http://10.0.0.2:8000
    engine: vllm
    role: decode
    model: tiny
"""
    )
    cfg = load_config(path, environ={})
    first = cfg.pool.endpoints[0].to_endpoint("p")
    assert (first.address, first.url, first.engine, first.role, first.model) == (
        "10.0.0.1:8000",
        "http://10.0.0.1:8000",
        "sglang",
        Role.PREFILL,
        "m",
    )
    second = cfg.pool.endpoints[1].to_endpoint("p")
    assert (second.engine, second.role, second.model) == ("vllm", Role.DECODE, "tiny")


def test_a_pools_flat_scrape_fields_are_the_scrapers_settings() -> None:
    """The data layer reads the pool's settings as they are: no copy to drift from."""
    cfg = parse_config(
        "pools:\n- {name: a, scrape_interval_s: 0.5}\n- {name: b, scrape_timeout_s: 0.2}\n",
        environ={},
    )
    a, b = (entry.base() for entry in cfg.pool_entries())
    assert isinstance(a, ScrapeSettings)
    assert (a.effective_timeout, b.effective_timeout) == (2.5, 0.2)  # 5 x 0.5; as written
    assert (
        parse_config("", environ={"SERVEGATE_POOL__SCRAPE_TIMEOUT_S": "3"}).pool.effective_timeout
        == 3.0
    )


def test_env_overrides_nest_and_parse_scalars() -> None:
    env = {
        "SERVEGATE_GATEWAY__PORT": "9000",
        "SERVEGATE_GATEWAY__DEBUG_HEADERS": "true",
        "SERVEGATE_POOL__HEALTH__INTERVAL_S": "0.5",
        "OTHER": "x",
        "SERVEGATE_NOSECTION": "ignored",
    }
    assert env_overrides(env) == {
        "gateway": {"port": 9000, "debug_headers": True},
        "pool": {"health": {"interval_s": 0.5}},
    }
    cfg = parse_config("gateway: {port: 1}", environ=env)
    assert cfg.gateway.port == 9000
    assert cfg.pool.health.interval_s == 0.5


def test_cli_overrides_win_over_env_and_file() -> None:
    cfg = parse_config(
        "gateway: {port: 1}",
        environ={"SERVEGATE_GATEWAY__PORT": "2"},
        overrides={"gateway": {"port": 3}},
    )
    assert cfg.gateway.port == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "gateway:\n  prot: 1\n", ["gateway.prot (f.yaml:2:3)", "unknown field"], id="typo"
        ),
        pytest.param(
            "gateway:\n  port: 70000\n",
            ["gateway.port (f.yaml:2:3)", "less than or equal"],
            id="range",
        ),
        pytest.param(
            "pool:\n  endpoints:\n  - url: localhost:80\n",
            ["pool.endpoints.0.url (f.yaml:3:5)", "http://host:port"],
            id="bad-url",
        ),
        pytest.param(
            "pool:\n  endpoints:\n  - url: http://a:1\n    role: middle\n",
            ["pool.endpoints.0.role (f.yaml:4:5)", "prefill"],
            id="bad-role",
        ),
        pytest.param("- a\n- b\n", ["top level must be a mapping"], id="not-a-mapping"),
        pytest.param("gateway: [\n", ["not valid YAML"], id="bad-yaml"),
        pytest.param(
            "pool:\n  scrape_interval_s: 0.01\n",
            ["greater than or equal to 0.05"],
            id="scrape-floor",
        ),
    ],
)
def test_errors_name_field_and_position(text: str, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "f.yaml", environ={})
    for fragment in expected:
        assert fragment in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_picker_path_is_read_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "picker.yaml").write_text("kind: EndpointPickerConfig\n")
    cfg = parse_config("picker: picker.yaml", environ={})
    assert cfg.picker_document(tmp_path) == "kind: EndpointPickerConfig\n"
    with pytest.raises(ConfigError, match="picker: cannot read"):
        cfg.picker_document(tmp_path / "elsewhere")
