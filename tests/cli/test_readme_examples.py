"""The documentation's pasted terminal sessions still match what the commands print (CLI end-to-end tier).

Checked files: README.md, every docs/*.md and benchmarks/README.md (a new docs/ page is picked up
by itself). A ```text block right after a `<!-- readme:check -->` line is a session: `$ ` lines
are shell commands, the lines up to the next command are what it prints (stdout, then stderr),
and `$ echo $?` prints the previous command's exit status. A code block right after
`<!-- readme:check file=NAME -->` is written to NAME for the sessions after it. The marked blocks
of one file run in file order in one scratch folder of their own (a later block may read files
an earlier one wrote) that links the repository's `examples/` and `tests/` and this
interpreter's environment as `.venv`, with its `nereus` first on PATH.
Timings are masked; trailing spaces are ignored. Unmarked blocks (training runs, benchmarks,
anything that depends on this machine's speed or optional tools) are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from repo_paths import ROOT

pytestmark = pytest.mark.cli

MARK = "<!-- readme:check -->"
FILE_MARK = re.compile(r"<!-- readme:check file=([\w.-]+) -->")
#: Output that depends on the machine's speed, masked on both sides before comparing.
VOLATILE = (
    (re.compile(r"in \d+(\.\d+)? ms"), "in <t> ms"),
    (re.compile(r"\d+(\.\d+)? s of (\d+) s"), r"<t> s of \2 s"),
)


def documentation_files() -> list[Path]:
    """Every file whose marked sessions are checked, as paths relative to the repository."""
    files = [Path("README.md"), *sorted(p.relative_to(ROOT) for p in (ROOT / "docs").glob("*.md"))]
    return [*files, Path("benchmarks/README.md")]


@dataclass(frozen=True)
class Command:
    line: int
    """Line of the command in its file, for the failure message."""
    shell: str
    expected: tuple[str, ...]


@dataclass(frozen=True)
class File:
    name: str
    text: str


def marked_blocks(text: str, name: str = "README.md") -> list[list[Command] | File]:
    """Every marked block of file `name` in order: a session (its commands with their expected output) or a file."""
    lines = text.splitlines()
    blocks: list[list[Command] | File] = []
    for index, line in enumerate(lines):
        file_mark = FILE_MARK.fullmatch(line.strip())
        if line.strip() != MARK and not file_mark:
            continue
        opening = lines[index + 1]
        end = lines.index("```", index + 2)
        if file_mark:
            assert opening.startswith("```"), f"{name}:{index + 2}: a code block must follow {line.strip()}"
            blocks.append(File(file_mark.group(1), "\n".join(lines[index + 2 : end]) + "\n"))
            continue
        assert opening == "```text", f"{name}:{index + 2}: {MARK} must be followed by a ```text block"
        blocks.append(_commands(lines[index + 2 : end], first_line=index + 3, name=name))
    return blocks


def _commands(block: list[str], first_line: int, name: str) -> list[Command]:
    commands: list[Command] = []
    shell, start, expected = "", 0, []
    continued = False
    for offset, line in enumerate(block):
        if continued:  # a command split over lines with a trailing backslash
            shell, continued = shell + " " + line.strip().removesuffix("\\"), line.endswith("\\")
        elif line.startswith("$ "):
            if shell:
                commands.append(Command(start, shell, tuple(expected)))
            shell, start, expected = line[2:].removesuffix("\\"), first_line + offset, []
            continued = line.endswith("\\")
        else:
            assert shell, f"{name}:{first_line + offset}: output before any `$ ` command"
            expected.append(line)
    if shell:
        commands.append(Command(start, shell, tuple(expected)))
    return commands


def normalised(lines: list[str] | tuple[str, ...]) -> list[str]:
    out = []
    for line in lines:
        for pattern, replacement in VOLATILE:
            line = pattern.sub(replacement, line)
        out.append(line.rstrip())
    while out and not out[-1]:
        out.pop()
    return out


def _scratch(folder: Path) -> Path:
    for name in ("examples", "tests"):
        (folder / name).symlink_to(ROOT / name)
    (folder / ".venv").symlink_to(sys.prefix)
    return folder


def _checked_files() -> list[Path]:
    return [path for path in documentation_files() if marked_blocks(_read(path), str(path))]


def _read(path: Path) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def test_the_readme_and_the_docs_keep_their_checked_sessions() -> None:
    readme = marked_blocks(_read(Path("README.md")))
    assert sum(isinstance(b, list) for b in readme) >= 5, "the README lost its checked sessions"
    checked = {str(path) for path in _checked_files()}
    assert {"docs/cli.md", "docs/runtime.md"} <= checked, f"checked files: {sorted(checked)}"


@pytest.mark.slow
@pytest.mark.parametrize("path", _checked_files(), ids=str)
def test_readme_sessions_print_what_the_readme_shows(path: Path, tmp_path: Path) -> None:
    scratch = _scratch(tmp_path)
    blocks = marked_blocks(_read(path), str(path))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "COLUMNS": "120",
        "NO_COLOR": "1",
        "TERM": "dumb",
    }
    mismatches = []
    status = 0
    for command in _commands_writing_files(blocks, scratch):
        if command.shell == "echo $?":
            printed = [str(status)]
        else:
            done = subprocess.run(
                ["bash", "-c", command.shell], cwd=scratch, env=env, capture_output=True, text=True, timeout=300
            )
            status, printed = done.returncode, (done.stdout + done.stderr).splitlines()
        shown, got = normalised(command.expected), normalised(printed)
        if got != shown:
            mismatches.append(
                f"{path}:{command.line}: $ {command.shell}\n--- {path}\n"
                + "\n".join(shown)
                + "\n--- printed\n"
                + "\n".join(got)
            )
    assert not mismatches, "\n\n".join(mismatches)


def _commands_writing_files(blocks: list[list[Command] | File], scratch: Path) -> Iterator[Command]:
    """The sessions' commands in order; a file block is written when it is reached."""
    for block in blocks:
        if isinstance(block, File):
            (scratch / block.name).write_text(block.text, encoding="utf-8")
        else:
            yield from block


def test_the_session_parser_reads_commands_outputs_and_continuations() -> None:
    text = "\n".join(
        [
            "intro",
            MARK,
            "```text",
            "$ nereus a --x 1 \\",
            "    --y 2",
            "out 1",
            "out 2",
            "$ echo $?",
            "0",
            "```",
            "```text",
            "$ unmarked",
            "```",
            "<!-- readme:check file=demo.py -->",
            "```python",
            "print(1)",
            "```",
        ]
    )
    session, file = marked_blocks(text)
    assert file == File("demo.py", "print(1)\n") and isinstance(session, list)
    assert [c.shell for c in session] == ["nereus a --x 1  --y 2", "echo $?"]
    assert session[0].expected == ("out 1", "out 2") and session[0].line == 4
    assert normalised(["searched 3 placements in 10.5 ms   ", ""]) == ["searched 3 placements in <t> ms"]


def test_a_malformed_block_is_reported_with_its_file_and_line() -> None:
    text = "\n".join(["intro", MARK, "```bash", "$ nereus --help", "```"])
    with pytest.raises(AssertionError, match=r"^docs/x\.md:3: "):
        marked_blocks(text, "docs/x.md")
    with pytest.raises(AssertionError, match=r"^docs/y\.md:3: output before any"):
        marked_blocks("\n".join([MARK, "```text", "stray", "```"]), "docs/y.md")


def test_every_docs_page_is_checked_without_being_listed() -> None:
    pages = {str(path) for path in documentation_files()}
    assert {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")} <= pages
    assert {"README.md", "benchmarks/README.md"} <= pages
