"""Helpers (cli_helpers, plan_helpers, peers) stay importable from tests in subfolders."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
