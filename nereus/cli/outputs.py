"""The check every command makes of a file it is asked to write, before it does any work."""

from __future__ import annotations

from pathlib import Path

from nereus.errors import NereusError


def check_output(path: Path | None, option: str = "", suffixes: tuple[str, ...] = ()) -> None:
    """Refuse, with one line naming `option` (when given) and `path`, an output file whose name
    has none of `suffixes` (any name when empty) or whose folder does not exist. None: no file."""
    if path is None:
        return
    where = f"{option} {path}" if option else str(path)
    if suffixes and path.suffix.lower() not in suffixes:
        raise NereusError(f"{where}: expected a {' or '.join(suffixes)} file name")
    if not path.parent.is_dir():
        raise NereusError(f"{where}: folder {path.parent} does not exist; create it first")
