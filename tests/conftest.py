"""Suite-wide settings.

Hypothesis's per-example deadline measures wall time, which on a shared 2-core machine
says more about the neighbours than about the code: properties are checked, speed is not.

`--upstream-client lean|aiohttp` runs the suite with that request-path client as the
default of `gateway.upstream_client`, and `--http-server lean|aiohttp` with that server of
the inference routes as the default of `gateway.http_server` (configs that name one keep
theirs; gateways started as subprocesses read their own config files and are not affected).
"""

from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("servegate", deadline=None)
settings.load_profile("servegate")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--upstream-client",
        choices=("lean", "aiohttp"),
        default=None,
        help="the default gateway.upstream_client for in-process gateways",
    )
    parser.addoption(
        "--http-server",
        choices=("lean", "aiohttp"),
        default=None,
        help="the default gateway.http_server for in-process gateways",
    )


ROOT = Path(__file__).resolve().parent.parent


def stale_native_modules(root: Path = ROOT) -> list[str]:
    """The sources in native.txt edited after `make install` compiled them: Python would
    import the old extension module beside each, and the suite would test old code."""
    listing = (root / "native.txt").read_text().splitlines()
    stale = []
    for line in listing:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        source = root / "src" / line
        for built in source.parent.glob(f"{source.stem}.cpython-*.so"):
            if source.stat().st_mtime > built.stat().st_mtime:
                stale.append(line)
    return stale


def pytest_configure(config: pytest.Config) -> None:
    stale = stale_native_modules()
    if stale:
        pytest.exit(
            f"compiled modules older than their sources: {', '.join(stale)}; "
            "run `make install` to rebuild them (or `make pure` to run the plain Python)",
            returncode=4,
        )
    defaults = {
        "upstream_client": config.getoption("--upstream-client"),
        "http_server": config.getoption("--http-server"),
    }
    if all(value is None for value in defaults.values()):
        return
    from servegate.config import GatewaySettings, ServegateConfig

    for name, value in defaults.items():
        if value is not None:
            GatewaySettings.model_fields[name].default = value
    GatewaySettings.model_rebuild(force=True)
    ServegateConfig.model_fields["gateway"].default = GatewaySettings()
    ServegateConfig.model_rebuild(force=True)


def pytest_report_header(config: pytest.Config) -> str:
    from servegate.config import ServegateConfig

    gateway = ServegateConfig().gateway
    return (
        f"gateway.upstream_client default: {gateway.upstream_client}, "
        f"gateway.http_server default: {gateway.http_server}"
    )
