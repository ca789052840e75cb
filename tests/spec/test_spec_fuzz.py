"""Fuzzing the file reader: whatever the bytes, `check_file` answers with one-line errors.

Invariants: `check_file` never raises and returns quickly; every error or warning is a
single line that starts with the file's path (then `:LINE:COL` where the checker knows the
place); `load_document` raises only `SpecError`.

Inputs the fuzzers once crashed on are pinned as regression tests at the bottom of this file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from check_lines import names_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo_paths import EXAMPLES

from nereus.errors import SpecError
from nereus.spec.check import CheckResult, check_file
from nereus.spec.io import KINDS, load_document

pytestmark = pytest.mark.logic

EXAMPLES = EXAMPLES
EXAMPLE_TEXTS = {p.name: p.read_text(encoding="utf-8") for p in sorted(EXAMPLES.glob("*.yaml"))}
EXAMPLE_DATA = {name: yaml.safe_load(text) for name, text in EXAMPLE_TEXTS.items()}

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SECONDS_PER_FILE = 30.0  # a hang guard, not a speed target: a check takes milliseconds


# --- helpers ------------------------------------------------------------------------------


def _check(path: Path, raw: bytes) -> CheckResult:
    path.write_bytes(raw)
    start = time.perf_counter()
    result = check_file(path)
    assert time.perf_counter() - start < SECONDS_PER_FILE
    assert isinstance(result, CheckResult)
    assert result.file == str(path)
    assert result.ok == (not result.errors)
    assert result.kind is None or result.kind in KINDS
    for line in result.errors + result.warnings:
        assert isinstance(line, str)
        assert names_file(line, path), line
        assert "\n" not in line and "\r" not in line, line
    return result


def _fuzz_file(tmp_path_factory: pytest.TempPathFactory, suffix: str) -> Path:
    return tmp_path_factory.mktemp("fuzz") / f"doc{suffix}"


def _load_only_raises_spec_error(path: Path) -> None:
    try:
        load_document(path)
    except SpecError as exc:
        assert exc.problems
        for line in exc.problems:
            assert line.startswith(f"{path}: "), line  # load_document's errors carry no position
            assert "\n" not in line and "\r" not in line, line


# --- strategies ---------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-3, max_value=300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["Plan", "Model", "Cluster", "Workload", "ppo", "grpo", "all", "actor/generation", "tiny"]),
)
plain_data = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.text(max_size=10), children, max_size=5),
    ),
    max_leaves=25,
)

field_names = st.sampled_from(
    sorted({key for data in EXAMPLE_DATA.values() for key in data} | {"stages", "pools", "emus", "tp", "pp"})
)
junk_text = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        [
            "",
            "-1",
            "0",
            "1.5",
            "true",
            "null",
            "[",
            "]",
            "{",
            "}",
            "'",
            '"',
            ":",
            "- ",
            "&a",
            "*a",
            "!!str",
            "~",
            "1e400",
            ".nan",
            "0x10",
            "2024-01-01",
            "[1, 2]",
            "{a: 1}",
            "\t",
        ]
    ),
)


def _skeleton() -> st.SearchStrategy[dict[str, Any]]:
    """A document header (known or odd kind, odd version) plus random fields."""
    return st.builds(
        lambda kind, version, fields: {"kind": kind, "version": version, **fields},
        st.one_of(st.sampled_from(sorted(KINDS)), scalars),
        st.one_of(st.just(1), scalars),
        st.dictionaries(st.one_of(field_names, st.text(max_size=8)), plain_data, max_size=6),
    )


@st.composite
def mutated_example(draw: st.DrawFn) -> str:
    """An example file with one line deleted, or one value swapped for junk."""
    text = EXAMPLE_TEXTS[draw(st.sampled_from(sorted(EXAMPLE_TEXTS)))]
    lines = text.splitlines(keepends=True)
    i = draw(st.integers(0, len(lines) - 1))
    if draw(st.booleans()):
        return "".join(lines[:i] + lines[i + 1 :])
    line = lines[i]
    junk = draw(junk_text)
    if ": " in line:
        # Swap one `key: value` pair's value (block or flow style) for junk.
        starts = [j for j in range(len(line)) if line.startswith(": ", j)]
        start = draw(st.sampled_from(starts)) + 2
        end_candidates = [j for j in range(start, len(line)) if line[j] in ",}\n"] or [len(line)]
        end = end_candidates[0]
        line = line[:start] + junk + line[end:]
    else:
        line = junk + "\n"
    return "".join([*lines[:i], line, *lines[i + 1 :]])


@st.composite
def mutated_example_data(draw: st.DrawFn) -> dict[str, Any]:
    """An example document with one nested value replaced or one key deleted."""
    data = json.loads(json.dumps(EXAMPLE_DATA[draw(st.sampled_from(sorted(EXAMPLE_DATA)))]))
    node: Any = data
    for _ in range(draw(st.integers(0, 4))):
        children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        children = [(k, v) for k, v in children if isinstance(v, (dict, list)) and v]
        if not children:
            break
        node = draw(st.sampled_from(children))[1]
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    key = draw(st.sampled_from(keys))
    if isinstance(node, dict) and draw(st.booleans()):
        del node[key]
    else:
        node[key] = draw(plain_data)
    return data


# --- the fuzzers ---------------------------------------------------------------------------


@FUZZ
@given(text=st.text(max_size=300))
def test_random_text_yaml(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    raw = text.encode()
    _check(_fuzz_file(tmp_path_factory, ".yaml"), raw)


@FUZZ
@given(text=st.text(alphabet=st.sampled_from(list("kind:Plan version1{}[]\"',-#&*!|>\n\t ")), max_size=200))
def test_yamlish_text(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    raw = text.encode()
    _check(_fuzz_file(tmp_path_factory, ".yaml"), raw)


@FUZZ
@given(text=st.text(max_size=300))
def test_random_text_json(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    raw = text.encode()
    _check(_fuzz_file(tmp_path_factory, ".json"), raw)


@FUZZ
@given(data=st.one_of(plain_data, _skeleton()), as_json=st.booleans())
def test_dumped_structures(tmp_path_factory: pytest.TempPathFactory, data: Any, as_json: bool) -> None:
    suffix = ".json" if as_json else ".yaml"
    text = json.dumps(data) if as_json else yaml.safe_dump(data, allow_unicode=True)
    raw = text.encode()
    _check(_fuzz_file(tmp_path_factory, suffix), raw)


@FUZZ
@given(text=mutated_example())
def test_mutated_example_text(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    raw = text.encode()
    _check(_fuzz_file(tmp_path_factory, ".yaml"), raw)


@FUZZ
@given(data=mutated_example_data(), as_json=st.booleans())
def test_mutated_example_data(tmp_path_factory: pytest.TempPathFactory, data: dict[str, Any], as_json: bool) -> None:
    suffix = ".json" if as_json else ".yaml"
    text = json.dumps(data) if as_json else yaml.safe_dump(data, allow_unicode=True)
    raw = text.encode()
    _check(_fuzz_file(tmp_path_factory, suffix), raw)


@FUZZ
@given(raw=st.binary(max_size=400), suffix=st.sampled_from([".yaml", ".json"]))
def test_random_bytes(tmp_path_factory: pytest.TempPathFactory, raw: bytes, suffix: str) -> None:
    _check(_fuzz_file(tmp_path_factory, suffix), raw)


@FUZZ
@given(
    raw=st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200).map(lambda t: t.encode()),
        mutated_example().map(str.encode),
        mutated_example_data().map(lambda d: yaml.safe_dump(d).encode()),
        _skeleton().map(lambda d: yaml.safe_dump(d, allow_unicode=True).encode()),
    )
)
def test_load_document_only_raises_spec_error(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = _fuzz_file(tmp_path_factory, ".yaml")
    path.write_bytes(raw)
    _load_only_raises_spec_error(path)


def test_unmutated_examples_stay_valid(tmp_path: Path) -> None:
    """The fuzzers' seeds are themselves valid (else the mutations prove little)."""
    for name, text in EXAMPLE_TEXTS.items():
        result = _check(tmp_path / name, text.encode())
        assert result.ok, result.errors


def test_missing_file_and_directory(tmp_path: Path) -> None:
    result = check_file(tmp_path / "nope.yaml")
    assert not result.ok and "no such file" in result.errors[0]
    result = check_file(tmp_path)
    assert not result.ok and "is a directory" in result.errors[0]
    with pytest.raises(SpecError):
        load_document(tmp_path / "nope.yaml")


def test_deep_nesting_is_an_error_not_a_crash(tmp_path: Path) -> None:
    for suffix, text in ((".yaml", "[" * 5000 + "]" * 5000), (".json", "[" * 100_000 + "]" * 100_000)):
        path = tmp_path / f"deep{suffix}"
        result = _check(path, text.encode())
        assert result.errors == [f"{path}: nested too deeply to be a nereus file"], result.errors


# --- inputs the fuzzers once crashed on (regressions) -----------------------------------

UNHASHABLE_KIND = "kind: [Plan]\nversion: 1\n"
SET_KEY = "kind: Model\nversion: 1\n? !!set {a: null}\n: 1\n"
KEY_WITH_NEWLINE = 'kind: Model\nversion: 1\n"rope\\ntheta": 1\n'


@pytest.mark.parametrize("text", [UNHASHABLE_KIND, "kind: {a: 1}\nversion: 1\n"], ids=["list", "mapping"])
def test_kind_holding_a_collection_is_an_unknown_kind(tmp_path: Path, text: str) -> None:
    path = tmp_path / "doc.yaml"
    result = _check(path, text.encode())
    assert not result.ok
    assert len(result.errors) == 1
    assert names_file(result.errors[0], path, "kind: unknown kind"), result.errors
    with pytest.raises(SpecError):
        load_document(path)


def test_set_mapping_key_is_a_yaml_error(tmp_path: Path) -> None:
    path = tmp_path / "doc.yaml"
    result = _check(path, SET_KEY.encode())
    assert not result.ok
    assert len(result.errors) == 1
    assert names_file(result.errors[0], path, "not valid YAML"), result.errors
    with pytest.raises(SpecError):
        load_document(path)


@pytest.mark.parametrize("text", [KEY_WITH_NEWLINE, KEY_WITH_NEWLINE.replace("\\n", "\\r\\n")], ids=["lf", "crlf"])
def test_unknown_key_with_a_line_break_stays_on_one_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "doc.yaml"
    result = _check(path, text.encode())  # _check asserts every line is a single line
    assert not result.ok
    [unknown] = [line for line in result.errors if "unknown key" in line]
    assert names_file(unknown, path, "rope\\"), unknown
    with pytest.raises(SpecError) as info:
        load_document(path)
    for line in info.value.problems:
        assert "\n" not in line and "\r" not in line, line


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", ".NaN", "+.Inf"])
def test_float_field_refuses_infinity_and_nan(tmp_path: Path, value: str) -> None:
    text = EXAMPLE_TEXTS["cluster-h100-2x8.yaml"]
    assert "bf16_flops: 9.89e+14" in text
    path = tmp_path / "cluster.yaml"
    result = _check(path, text.replace("bf16_flops: 9.89e+14", f"bf16_flops: {value}").encode())
    assert not result.ok
    assert any(names_file(line, path, "gpu.bf16_flops: ") and "finite" in line for line in result.errors), result
    with pytest.raises(SpecError):
        load_document(path)


@pytest.mark.parametrize("text", ["\t", " \t\n", "\n\t\n  \n", "\t\t\r\n"], ids=["tab", "space-tab", "lines", "crlf"])
def test_whitespace_only_file_with_a_tab_is_empty(tmp_path: Path, text: str) -> None:
    path = tmp_path / "doc.yaml"
    result = _check(path, text.encode())
    assert not result.ok
    assert len(result.errors) == 1
    assert "empty file" in result.errors[0], result.errors
    with pytest.raises(SpecError):
        load_document(path)
