"""Issue 18 item 9: an empty string in `api_keys` or `admin_keys` disabled authentication
(a request with no key matched it), and `config check` accepted it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from servegate.config import ConfigError, parse_config


@pytest.mark.parametrize("field", ["api_keys", "admin_keys"])
@pytest.mark.parametrize("key", ["", "   ", " padded "])
def test_blank_keys_are_refused(field: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"gateway.{field}"):
        parse_config("", "<test>", environ={}, overrides={"gateway": {field: ["good", key]}})


def test_config_check_fails_with_a_fix_it_message(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text('gateway:\n  api_keys: ["sk-good", ""]\n')
    done = subprocess.run(
        [sys.executable, "-m", "servegate.cli", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "would let anyone in" in done.stderr
    assert "sk-good" not in done.stderr
