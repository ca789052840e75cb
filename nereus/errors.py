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

    def __init__(self, problems: list[str], fields: list[str | None] | None = None) -> None:
        assert problems, "SpecError needs at least one problem"
        assert fields is None or len(fields) == len(problems), "one field path per problem"
        self.problems = problems
        #: The field path each problem is about (`stages[0].tp`), where known: `nereus check`
        #: turns it into a line and column of the file.
        self.fields: list[str | None] = fields if fields is not None else [None] * len(problems)
        super().__init__(problems[0])
