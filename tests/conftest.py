"""Test tiers: every test carries one of the tier markers registered in pyproject.toml.

Loading this file puts tests/ on sys.path (pytest's default import mode), so the helper
modules there (cli_helpers, plan_helpers, repo_paths) import the same way from every layer
folder. A test with no tier marker is a collection error: the fast loop
(`-m "not multiprocess and not slow"`) must not include or drop a test by accident.
"""

from __future__ import annotations

import pytest

TIERS = ("logic", "one_rank", "multiprocess", "cli")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(tier) for tier in TIERS)]
    if untiered:
        raise pytest.UsageError(
            f"{len(untiered)} test(s) carry no tier marker ({', '.join(TIERS)}), first: {untiered[0]}; "
            "set `pytestmark = pytest.mark.<tier>` in the module"
        )
