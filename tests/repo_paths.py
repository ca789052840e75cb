"""Where the tests find the repository's files, wherever a test module sits below tests/."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
EXAMPLES = ROOT / "examples"
BENCHMARKS = ROOT / "benchmarks"
DATA = TESTS / "data"
