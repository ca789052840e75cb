"""User-facing errors shared by every layer.

A `NereusError` is a mistake in what the user asked for (a bad file, an impossible
request). The CLI prints its message on one line and exits non-zero; it never shows
a traceback for one.
"""

from __future__ import annotations


class NereusError(Exception):
    """A user error with a one-line message that says what to change."""


class SpecError(NereusError):
    """A file that cannot be read as a valid nereus document.

    `problems` holds every problem found, each already formatted as
    "FILE: FIELD.PATH: what is wrong; what to do".
    """

    def __init__(self, problems: list[str]) -> None:
        assert problems, "SpecError needs at least one problem"
        self.problems = problems
        super().__init__(problems[0])
