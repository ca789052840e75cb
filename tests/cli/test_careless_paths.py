"""Careless paths, over every command and every option that takes one.

The options are read from the typer app itself (every Path parameter, and every name that
may be a preset or a YAML file), so a new one is covered as soon as it exists: the test
fails until PATHS says what it is (input file or folder, output file or folder, preset or
file) and BASE gives its command a valid invocation to put the careless value into.

Each careless value (missing, a folder for a file, a file for a folder, a parent that is a
file, a folder this user may not write, a disk that fills while writing) must end with
exit 1 and one `error:` line naming the value, no traceback or internal error, and no file
left behind. `run` and `profile` stop where their work would begin (their launch is replaced
by a sentinel): only what they check before it is exercised; their full-disk case is the
run's own (tests/runtime/test_run_faults.py).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer.main

from nereus.cli.app import app
from tests.cli_helpers import invoke
from tests.run_helpers import PLAN_2RANK, write_config

pytestmark = pytest.mark.cli

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = ROOT / "examples"
DATA = ROOT / "tests" / "data"

# What each path-taking parameter is (command, parameter name) -> kind.
IN_FILE, IN_FOLDER, OUT_FILE, OUT_FOLDER, PRESET_OR_FILE = "in-file", "in-folder", "out-file", "out-folder", "preset"
PATHS: dict[tuple[str, str], str] = {
    ("check", "files"): IN_FILE,
    ("simulate", "trace_file"): IN_FILE,
    ("simulate", "plan_file"): IN_FILE,
    ("simulate", "plot"): OUT_FILE,
    ("simulate", "log_file"): OUT_FILE,
    ("run", "config_file"): IN_FILE,
    ("run", "plan_file"): IN_FILE,
    ("run", "out"): OUT_FOLDER,
    ("run", "resume"): IN_FOLDER,
    ("run", "trace"): IN_FILE,
    ("profile", "output"): OUT_FILE,
    ("profile", "model"): PRESET_OR_FILE,
    ("profile", "plan"): IN_FILE,
    ("fit", "run_dirs"): IN_FOLDER,
    ("fit", "output"): OUT_FILE,
    ("fit", "profile_file"): IN_FILE,
    ("fit", "start"): IN_FILE,
    ("fit", "plans"): IN_FILE,
    ("report", "folder"): IN_FOLDER,
    ("report", "png"): OUT_FILE,
    ("report", "perfetto"): OUT_FILE,
    ("plan", "cluster"): PRESET_OR_FILE,
    ("plan", "profile"): IN_FILE,
    ("plan", "model"): PRESET_OR_FILE,
    ("plan", "workload"): PRESET_OR_FILE,
    ("plan", "calibration"): IN_FILE,
    ("plan", "output"): OUT_FILE,
    ("plan explain", "plan_file"): IN_FILE,
    ("plan explain", "calibration"): IN_FILE,
    ("dag build", "plan_a"): IN_FILE,
    ("dag build", "plan_b"): IN_FILE,
    ("dag build", "output"): OUT_FILE,
    ("dag build", "calibration"): IN_FILE,
    ("dag show", "transition_file"): IN_FILE,
    ("dag show", "output"): OUT_FILE,
    ("dag show", "gantt"): OUT_FILE,
    ("export verl", "plan"): IN_FILE,
    ("export verl", "output"): OUT_FILE,
    ("export openrlhf", "plan"): IN_FILE,
    ("export openrlhf", "output"): OUT_FILE,
    ("export hf", "run_dir"): IN_FOLDER,
    ("export hf", "output"): OUT_FOLDER,
    ("schedule fuse", "plan"): IN_FILE,
    ("schedule fuse", "calibration"): IN_FILE,
    ("schedule fuse", "output"): OUT_FILE,
    ("schedule fuse", "gantt"): OUT_FILE,
    ("schedule fuse", "perfetto"): OUT_FILE,
    ("schedule migrate", "plan"): IN_FILE,
    ("schedule migrate", "calibration"): IN_FILE,
    ("trace generate", "out"): OUT_FILE,
    ("trace show", "file"): IN_FILE,
}

#: A valid invocation of each command (parameter name -> value; "{run}" is a finished run
#: folder, "{config}" a RunConfig, "{new}" a new output). A careless value replaces
#: its parameter's, or is added; BASE_FOR gives another base where the parameter needs one.
BASE: dict[str, dict[str, Any]] = {
    "check": {"files": [str(EXAMPLES / "plan-tiny-ppo-4rank.yaml")]},
    "simulate": {"trace_file": str(DATA / "trace-spot-2rank.yaml"), "plan_file": str(PLAN_2RANK)},
    "run": {"config_file": "{config}"},
    "profile": {"model": ["tiny"], "output": "{new}.yaml"},
    "fit": {"run_dirs": ["{run}"], "output": "{new}.yaml"},
    "report": {"folder": "{run}"},
    "plan": {"model": "tiny", "workload": "tiny-ppo", "gpus": "2", "cluster": "h100"},
    "plan explain": {"plan_file": str(PLAN_2RANK)},
    "dag build": {
        "plan_a": str(EXAMPLES / "plan-tiny-ppo-4rank.yaml"),
        "plan_b": str(EXAMPLES / "plan-tiny-ppo-4rank-relaid.yaml"),
    },
    "dag show": {"transition_file": str(EXAMPLES / "transition-tiny-ppo-4rank.yaml")},
    "export verl": {"plan": str(PLAN_2RANK)},
    "export openrlhf": {"plan": str(PLAN_2RANK)},
    "export hf": {"run_dir": "{run}", "output": "{new}"},
    "schedule fuse": {
        "stages": "2,2",
        "microbatches": "2,2",
        "fwd": "1,1",
        "bwd": "2,2",
        "time_limit": "0.05",
        "seeds": "1",
    },
    "schedule migrate": {"plan": str(PLAN_2RANK), "num_batches": "2"},
    "trace generate": {"kind": "spot", "steps": "30", "out": "{new}"},
    "trace show": {"file": str(DATA / "trace-spot-2rank.yaml")},
}
BASE_FOR: dict[tuple[str, str], dict[str, Any]] = {
    ("run", "resume"): {},
    # --plan goes with a trainer log (--from verl); the plans are read before the log.
    ("fit", "plans"): {"source": "verl", "run_dirs": [str(DATA / "trace-spot-2rank.yaml")], "output": "{new}.yaml"},
    ("profile", "plan"): {"output": "{new}.yaml"},
    ("plan", "profile"): {"model": "tiny", "workload": "tiny-ppo"},
    ("plan", "cluster"): {"model": "tiny", "workload": "tiny-ppo", "gpus": "2"},
    ("schedule fuse", "plan"): {"time_limit": "0.05", "seeds": "1"},
    ("schedule fuse", "calibration"): {"plan": str(PLAN_2RANK), "time_limit": "0.05", "seeds": "1"},
}
#: Output names each output kind is given when the test wants it written (by suffix).
SUFFIXES = {
    ("simulate", "plot"): ".png",
    ("simulate", "log_file"): ".json",
    ("report", "png"): ".png",
    ("report", "perfetto"): ".json",
    ("dag show", "gantt"): ".png",
    ("schedule fuse", "gantt"): ".png",
    ("schedule fuse", "perfetto"): ".json",
}
#: Commands that stop before their work here (launch replaced): a full disk is never met.
STOPPED = {"run", "profile"}
#: Outputs a full disk cannot be met on in this test, and why.
NO_FULL_DISK = {
    ("export hf", "output"): "needs a run started from a Hugging Face folder (tests/cli/test_hf_run_export.py)",
    ("dag show", "gantt"): "needs matplotlib's PNG writer; the same atomic writer as -o",
}


def commands() -> Iterator[tuple[str, Any]]:
    def walk(command: Any, prefix: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
        yield " ".join(prefix), command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, (*prefix, name))

    yield from walk(typer.main.get_command(app), ())


def takes_a_path(param: Any) -> bool:
    """A Path parameter, or a name that may be a preset or a YAML file."""
    kind = str(param.bare_type())
    return kind in ("Path", "list[Path]") or ("str" in kind and "YAML" in (param.help or ""))


def path_params() -> list[tuple[str, str]]:
    return [(name, p.name) for name, command in commands() for p in command.params if takes_a_path(p)]


def test_every_path_taking_option_is_classified() -> None:
    """A new path-taking option (or command) is covered only once PATHS and BASE name it."""
    found = set(path_params())
    assert found, "no path-taking options found: the enumeration is broken"
    assert found == set(PATHS), f"unclassified: {sorted(found - set(PATHS))}; gone: {sorted(set(PATHS) - found)}"
    assert {command for command, _ in found} <= set(BASE)


@dataclass(frozen=True)
class Case:
    command: str
    param: str
    how: str


CARELESS = {
    IN_FILE: ("missing", "folder", "under-a-file"),
    IN_FOLDER: ("missing", "file"),
    PRESET_OR_FILE: ("missing-path", "no-preset", "folder"),
    OUT_FILE: ("folder", "missing-parent", "under-a-file", "unwritable", "full-disk"),
    OUT_FOLDER: ("file", "folder", "under-a-file", "unwritable"),
}
NEEDS_RUN = {"fit", "report", "export hf"}


def cases() -> list[Any]:
    chosen = []
    for command, param in sorted(PATHS):
        for how in CARELESS[PATHS[command, param]]:
            if how == "full-disk" and (command in STOPPED or (command, param) in NO_FULL_DISK):
                continue
            needs_run = command in NEEDS_RUN or (command, param) == ("run", "resume")
            marks = [pytest.mark.multiprocess] if needs_run else []
            chosen.append(pytest.param(Case(command, param, how), id=f"{command}-{param}-{how}", marks=marks))
    return chosen


class Accepted(BaseException):
    """`run` or `profile` accepted its input and reached the work (a BaseException: nothing catches it)."""


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("run")
    config = write_config(folder, num_steps=3, checkpoint_every=3)  # fit drops 2 warm-up steps
    result = invoke("run", config, "--out", folder / "out")
    assert result.exit_code == 0, result.output
    return folder / "out"


def careless_value(case: Case, folder: Path, kind: str) -> str:
    """Make the careless thing in `folder`; the value to pass."""
    suffix = SUFFIXES.get((case.command, case.param), ".json" if case.command == "simulate" else ".yaml")
    (folder / "a-file.txt").write_text("not a folder\n")
    (folder / "a-folder").mkdir()
    (folder / "a-folder" / "inside.txt").write_text("a folder with something in it\n")
    values = {
        "missing": "nowhere/missing.yaml",
        "missing-path": "models/NoSuchModel",
        "no-preset": "no-such-preset",
        "folder": "a-folder",
        "file": "a-file.txt",
        "under-a-file": f"a-file.txt/x{suffix}",
        "missing-parent": f"nowhere/x{suffix}",
        "unwritable": f"out{suffix}" if kind == OUT_FILE else "new-folder",
        "full-disk": f"out{suffix}",
    }
    return values[case.how]


def argv(command: str, params: dict[str, Any]) -> list[str]:
    """`command` with `params` (by name) as the command line: arguments in order, then options."""
    found = dict(commands())[command]
    words = command.split()
    options = []
    for param in found.params:
        if param.name not in params:
            continue
        value = params[param.name]
        values = value if isinstance(value, list) else [value]
        if param.param_type_name == "argument":
            words += [str(v) for v in values]
        else:
            for v in values:
                options += [param.opts[0], str(v)]
    return words + options


@pytest.mark.parametrize("case", cases())
def test_a_careless_path_is_one_line_and_leaves_nothing(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    kind = PATHS[case.command, case.param]
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    run = str(request.getfixturevalue("finished_run")) if case.command in NEEDS_RUN else ""
    config = write_config(tmp_path) if case.command == "run" else ""
    value = careless_value(case, folder, kind)
    base = BASE_FOR.get((case.command, case.param), BASE[case.command])
    fills = {
        "{run}": run,
        "{config}": str(config),
        "{new}": str(tmp_path / "new-output"),
        "{new}.yaml": str(tmp_path / "new-output.yaml"),
    }
    params = {
        name: [fills.get(v, v) for v in given] if isinstance(given, list) else fills.get(given, given)
        for name, given in base.items()
    }
    params[case.param] = value

    def accepted(*args: Any, **kwargs: Any) -> Any:
        raise Accepted

    monkeypatch.setattr("nereus.runtime.run.launch.launch", accepted)
    monkeypatch.setattr("nereus.runtime.observe.profiling.run_profile", accepted)
    if case.how == "unwritable":
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode & os.W_OK else real_access(p, mode))
    if case.how == "full-disk":

        def full(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", full)
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    words = argv(case.command, params)
    shown = f"nereus {' '.join(words)}"
    try:
        result = invoke(*words)
    except Accepted:
        pytest.fail(f"{shown}: accepted a careless {case.param} ({case.how})")
    if result.exception is not None and isinstance(result.exception, Accepted):
        pytest.fail(f"{shown}: accepted a careless {case.param} ({case.how})")
    shown += f" -> exit {result.exit_code}\n{result.output}"
    assert result.exit_code == 1, shown
    assert "Traceback" not in result.output and "internal error" not in result.output, shown
    if case.command == "check":  # a validator: its report on stdout names each file it could not read
        assert f"{value}: invalid" in result.stdout, shown
    else:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), shown
        assert value in lines[0], shown
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before, f"{shown}\nleft files behind"
    assert not (tmp_path / "new-output").exists() and not (tmp_path / "new-output.yaml").exists(), shown


def test_a_model_that_is_neither_a_file_nor_a_preset_says_both() -> None:
    result = invoke("plan", "--model", "models/NoSuchModel", "--workload", "grpo")
    line = result.stderr.strip()
    assert result.exit_code == 1 and line.startswith(
        "error: --model models/NoSuchModel: no such file or folder, and not"
    ), result.output
    assert "a model preset (presets: " in line and "llama-3.1-8b" in line, line


def test_an_output_that_is_an_existing_folder_is_one_line_not_an_internal_error(tmp_path: Path) -> None:
    """The issue's case: `-o` naming an existing folder ended in IsADirectoryError (exit 3)."""
    result = invoke("plan", "--model", "tiny", "--workload", "tiny-ppo", "--gpus", "2", "-o", tmp_path)
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == f"error: -o {tmp_path}: is a folder; give a file name", result.output
    assert list(tmp_path.iterdir()) == []


def test_a_disk_that_fills_while_writing_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "trace.yaml"

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    result = invoke("trace", "generate", "spot", "--steps", "30", "-o", out)
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == f"error: {out}: No space left on device; free some space or write elsewhere", (
        result.output
    )
    assert list(tmp_path.iterdir()) == []
