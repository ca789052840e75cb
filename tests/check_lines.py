"""The form of one `nereus check` error line: `FILE: ...`, or `FILE:LINE:COL: ...` when the
checker knows where in the file the problem is. Tests match exactly these two forms."""

from __future__ import annotations

import re
from pathlib import Path


def names_file(line: str, path: str | Path, rest: str = "", indent: str = "") -> bool:
    """Whether `line` is `indent` + `path`, an optional `:LINE:COL`, `: ` and then `rest`."""
    pattern = re.escape(indent + str(path)) + r"(?::[1-9]\d*:[1-9]\d*)?: " + re.escape(rest)
    return re.match(pattern, line) is not None
