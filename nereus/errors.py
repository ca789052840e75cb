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


class MissingDependency(NereusError):
    """An optional package that a feature needs is not installed.

    `feature` says what asked for it in the library's words ("the exact pipeline model");
    `package` is the package to install and `extra` the nereus extra that brings it.
    """

    def __init__(self, feature: str, package: str, extra: str) -> None:
        self.feature = feature
        self.package = package
        self.extra = extra
        super().__init__(
            f"{feature} needs {package}, which is not installed; install the `{extra}` extra "
            f"(pip install 'nereus[{extra}]')"
        )


class ArgumentError(NereusError):
    """A user error whose message names arguments of the call: one out of range, one that
    does not fit the rest of the request, or one to pass next (to resume a run).

    The message names each argument in backquotes by its library name (`num_ranks`); a front
    end that calls the argument something else (a command-line flag) renders its own name
    with `render`.
    """

    def __init__(self, message: str, *arguments: str) -> None:
        assert all(f"`{name}`" in message for name in arguments), (message, arguments)
        self.arguments = arguments
        super().__init__(message)

    def render(self, names: dict[str, str]) -> str:
        """The message with every argument given a name in `names` called by that name."""
        text = str(self)
        for argument in self.arguments:
            if argument in names:
                text = text.replace(f"`{argument}`", names[argument])
        return text
