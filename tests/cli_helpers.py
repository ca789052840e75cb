"""What the in-process CLI tests share: one runner, `invoke`, and the one-line error check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from nereus.cli.app import app

runner = CliRunner()


def invoke(*args: str | Path) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(result: Any) -> str:
    """The single `error: ...` line of a failed command (exit 1, no traceback)."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return str(lines[0])
