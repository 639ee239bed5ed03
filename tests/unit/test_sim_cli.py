"""`servegate sim` option handling (the blocking run itself is covered by the process cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from servegate.simulator.cli import sim_command

app = typer.Typer()
app.command()(sim_command)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--persona", "tgi"], "persona", id="unknown-persona"),
        pytest.param(
            ["--num-blocks", "2", "--max-model-len", "4096"], "cannot hold", id="tiny-cache"
        ),
        pytest.param(["--kv-events-encoding", "json"], "encoding", id="bad-encoding"),
    ],
)
def test_bad_options_exit_2_with_a_message(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output


def test_bad_yaml_key(tmp_path: Path) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text("num_block: 4\n")
    result = CliRunner().invoke(app, ["--config", str(path)])
    assert result.exit_code == 2
    assert "num_block: unknown setting" in result.output
