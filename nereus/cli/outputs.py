"""The check every command makes of a file it is asked to write, before it does any work.

A careless output path (an existing folder, a folder that is missing or is a file, a place
this user may not write, a full disk) is refused in one line naming the option and the
path. A write that fails later all the same (the disk fills meanwhile) is refused the same
way by the writer (`nereus.spec.io.write_bytes_atomic`), which never leaves a half-written
file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nereus.errors import NereusError


def check_output(path: Path | None, option: str = "", suffixes: tuple[str, ...] = ()) -> None:
    """Refuse, with one line naming `option` (when given) and `path`, an output file whose name
    has none of `suffixes` (any name when empty), that is a folder, whose folder does not
    exist, is a file or is not writable, or whose disk is full. None: no file."""
    if path is None:
        return
    where = f"{option} {path}" if option else str(path)
    if suffixes and path.suffix.lower() not in suffixes:
        raise NereusError(f"{where}: expected a {' or '.join(suffixes)} file name")
    problem = output_file_problem(path)
    if problem:
        raise NereusError(f"{where}: {problem}")


def output_file_problem(path: Path) -> str | None:
    """Why `path` cannot be written as a file, or None."""
    if path.is_dir():
        return "is a folder; give a file name"
    if path.exists() and not path.is_file():
        return "is not a regular file; give a file name"
    return folder_problem(path.parent) or (
        "exists and is not writable" if path.exists() and not os.access(path, os.W_OK) else None
    )


def check_output_folder(path: Path | None, option: str, new: bool = False) -> None:
    """Refuse an output folder (`option`) that is a file, that cannot be created in its parent,
    or (`new`) that exists with something in it. None: no folder."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise NereusError(f"{option} {path}: is a file; give a folder")
    if new and path.is_dir() and any(path.iterdir()):
        raise NereusError(f"{option} {path}: already exists and is not empty; give a new or empty folder")
    nearest = next(parent for parent in (path, *path.parents) if parent.exists())
    problem = folder_problem(nearest)
    if problem:
        raise NereusError(f"{option} {path}: {problem}")


def folder_problem(folder: Path) -> str | None:
    """Why nothing can be written into `folder`, or None."""
    folder = folder if str(folder) else Path(".")
    if not folder.exists():
        return f"folder {folder} does not exist; create it first"
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"folder {folder} is not writable"
    if shutil.disk_usage(folder).free == 0:
        return f"no space left on the disk of {folder}"
    return None
