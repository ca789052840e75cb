"""Nothing nereus reads is unpickled or evaluated: every use of a loader that can run code
carries a `# safe: <why>` comment on its line (messages between one run's own ranks, a YAML
loader that is a SafeLoader subclass), and nothing else is allowed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import nereus

pytestmark = pytest.mark.logic

PACKAGE = Path(nereus.__file__).parent
#: Calls that can run code from their input.
UNSAFE = re.compile(
    r"\bpickle\.loads?\(|\bcloudpickle\.|\bdill\.|\bmarshal\.loads?\(|\bshelve\.open\("
    r"|\btorch\.load\((?![^)]*weights_only\s*=\s*True)|\byaml\.(?:unsafe_)?load\((?![^)]*Loader\s*=\s*yaml\.SafeLoader)"
    r"|\byaml\.load_all\(|(?<![.\w])eval\(|(?<![.\w])exec\(|\bnp\.load\((?![^)]*allow_pickle\s*=\s*False)"
)
SAFE = re.compile(r"#\s*safe:\s*\S")


def unsafe_lines(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if UNSAFE.search(line) and not SAFE.search(line):
                found.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    return found


def test_no_loader_that_runs_code_without_a_reason() -> None:
    assert unsafe_lines(PACKAGE) == []


def test_the_check_finds_each_kind_of_unsafe_call(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    lines = [
        "state = pickle.loads(data)",
        "state = pickle.load(handle)",
        "weights = torch.load(path)",
        "config = yaml.load(text, Loader=yaml.Loader)",
        "value = eval(text)",
        "exec(code)",
        "array = np.load(path)",
        "state = pickle.loads(data)  # safe: from this run's own ranks",
        "weights = torch.load(path, weights_only=True)",
        "config = yaml.safe_load(text)",
        "array = np.load(path, allow_pickle=False)",
        "result = model.eval()",
    ]
    (package / "module.py").write_text("\n".join(lines) + "\n")
    assert [line.split(": ", 1)[1] for line in unsafe_lines(package)] == lines[:7]
