"""Reading and writing nereus documents (YAML or JSON), with one-line errors."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from nereus.errors import NereusError, SpecError
from nereus.spec.base import Document
from nereus.spec.registry import KINDS, document_class, semantic_problems

MAX_FILE_BYTES = 64 * 1024 * 1024


class _PositionedError(yaml.YAMLError):
    """A refusal of the strict loader, with the mark of the node it is about."""

    def __init__(self, message: str, mark: Any) -> None:
        super().__init__(message)
        self.mark = mark


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and aliases (no silent overrides)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _PositionedError(
                f"line {event.start_mark.line + 1}: YAML aliases (*name) are not "
                "supported in nereus files; write the value out",
                event.start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise _PositionedError(
                    f"line {key_node.start_mark.line + 1}: a key must be a scalar", key_node.start_mark
                ) from None
            if key in seen:
                raise _PositionedError(
                    f"line {key_node.start_mark.line + 1}: duplicate key {key!r}; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _reject_duplicate_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"duplicate key {duplicates[0]!r}; keep one")
    return dict(pairs)


class ParseError(SpecError):
    """A text that is not valid YAML or JSON, with where the parser stopped."""

    def __init__(self, problem: str, position: tuple[int, int] | None) -> None:
        super().__init__([problem])
        self.position = position
        """1-based (line, column) of the syntax error, when the parser gave one."""


def parse_data(text: str, source: str) -> Any:
    """Parse YAML or JSON text into plain Python data; errors name `source`."""
    if not text.strip():
        return None  # reported as an empty file
    is_json = source.endswith(".json")
    try:
        if is_json:
            return json.loads(text, object_pairs_hook=_reject_duplicate_json_keys)
        return yaml.load(text, Loader=_StrictLoader)  # safe: _StrictLoader is a SafeLoader subclass
    except RecursionError:
        raise SpecError([f"{source}: nested too deeply to be a nereus file"]) from None
    except (yaml.YAMLError, ValueError) as exc:
        detail = " ".join(str(exc).split())
        problem = f"{source}: not valid {'JSON' if is_json else 'YAML'}: {detail}"
        raise ParseError(problem, _syntax_position(exc, text)) from None


def _syntax_position(exc: Exception, text: str) -> tuple[int, int] | None:
    if isinstance(exc, json.JSONDecodeError):
        return (exc.lineno, exc.colno)
    if isinstance(exc, ValueError):  # a JSON duplicate key: json gives no place, YAML's composer does
        try:
            yaml.load(text, Loader=_StrictLoader)  # safe: _StrictLoader is a SafeLoader subclass
        except yaml.YAMLError as yaml_exc:
            return _yaml_position(yaml_exc)
        except RecursionError:
            return None
        return None
    return _yaml_position(exc)


def _yaml_position(exc: Exception) -> tuple[int, int] | None:
    mark = None
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
    elif isinstance(exc, _PositionedError):
        mark = exc.mark
    return (mark.line + 1, mark.column + 1) if mark else None


def one_line(text: str) -> str:
    """Escape line breaks so every reported problem stays on one line."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def format_loc(loc: tuple[int | str, ...]) -> str:
    """Render a pydantic error location as `stages[0].emus[1]`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return one_line(out) or "(document)"


def _describe(error: dict[str, Any], kind: type[Document]) -> str:
    kind_of_error = error["type"]
    value = error.get("input")
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if kind_of_error == "extra_forbidden":
        return "unknown key; remove it or fix its spelling (see `nereus schema " + kind.__name__ + "`)"
    if kind_of_error == "missing":
        return "required field is missing; add it"
    message = error["msg"].removeprefix("Value error, ")
    if kind_of_error.endswith("_type") or kind_of_error.startswith("literal"):
        return f"{message}, got {shown} ({type(value).__name__})"
    return f"{message}, got {shown}" if "got" not in message else message


def validation_problems(exc: ValidationError, kind: type[Document], source: str) -> list[str]:
    """One line per pydantic error: `FILE: FIELD: what is wrong`."""
    return [one_line(f"{source}: {format_loc(err['loc'])}: {_describe(dict(err), kind)}") for err in exc.errors()]


def validation_error(exc: ValidationError, kind: type[Document], source: str) -> SpecError:
    """The SpecError of a pydantic error, with the field path of every problem."""
    return SpecError(validation_problems(exc, kind, source), [format_loc(err["loc"]) for err in exc.errors()])


def field_marks(text: str) -> dict[str, tuple[int, int]]:
    """The 1-based (line, column) where each field path of a YAML or JSON text is written:
    a mapping entry at its key, a list item at its first character. Field paths are spelled as
    in error messages (`stages[0].emus[1]`); `(document)` is the top. Empty when the text
    does not parse (its parse error has the position)."""
    try:
        root = yaml.compose(text, Loader=_StrictLoader)
    except (yaml.YAMLError, RecursionError):
        return {}
    marks: dict[str, tuple[int, int]] = {}
    if root is None:
        return marks
    marks["(document)"] = (root.start_mark.line + 1, root.start_mark.column + 1)
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                child = f"{path}.{key_node.value}" if path else str(key_node.value)
                marks.setdefault(one_line(child), (key_node.start_mark.line + 1, key_node.start_mark.column + 1))
                stack.append((child, value_node))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                child = f"{path}[{index}]"
                marks.setdefault(one_line(child), (item.start_mark.line + 1, item.start_mark.column + 1))
                stack.append((child, item))
    return marks


def locate(field: str | None, marks: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    """Where `field` is written, else where its nearest written parent is (a missing key is
    reported at the mapping that lacks it); None without marks."""
    while field:
        if field in marks:
            return marks[field]
        cut = max(field.rfind("."), field.rfind("["))
        field = field[:cut] if cut > 0 else ""
    return marks.get("(document)")


def document_from_data(data: Any, source: str) -> Document:
    """Validate parsed data as the document its `kind:` names (schema only)."""
    if data is None or data == "":
        raise SpecError([f"{source}: empty file; a nereus file starts with `kind:` and `version:`"])
    if not isinstance(data, dict):
        raise SpecError([f"{source}: expected a mapping with `kind:` at the top, got {type(data).__name__}"])
    kind_name = data.get("kind")
    kind = document_class(kind_name) if isinstance(kind_name, str) else None
    if kind is None:
        known = ", ".join(KINDS)
        what = "missing" if "kind" not in data else f"unknown kind {kind_name!r}"
        raise SpecError([f"{source}: kind: {what}; use one of {known}"], ["kind"])
    if "version" not in data:
        raise SpecError([f"{source}: version: required field is missing; add `version: 1`"], ["version"])
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, kind, source) from None


def read_text(path: Path) -> str:
    """Read a file as UTF-8 text, or raise a SpecError that says why not."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise SpecError([f"{path}: larger than {MAX_FILE_BYTES // 2**20} MiB; not a nereus file"])
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SpecError([f"{path}: no such file"]) from None
    except IsADirectoryError:
        raise SpecError([f"{path}: is a directory; give a file"]) from None
    except OSError as exc:
        raise SpecError([f"{path}: cannot read: {exc.strerror}"]) from None
    if b"\x00" in raw:
        raise SpecError([f"{path}: binary data, not a YAML or JSON text file"])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([f"{path}: not UTF-8 text (bad byte at offset {exc.start})"]) from None


def load_document(path: str | Path, *, check: bool = True) -> Document:
    """Read any nereus document; with `check`, semantic errors raise too."""
    path = Path(path)
    document = document_from_data(parse_data(read_text(path), str(path)), str(path))
    if check:
        errors = [p.format(str(path)) for p in semantic_problems(document) if p.severity == "error"]
        if errors:
            raise SpecError(errors)
    return document


def _kind_first(data: Any) -> Any:
    if isinstance(data, dict):
        data = {key: _kind_first(value) for key, value in data.items()}
        if "kind" in data and "version" in data:
            data = {"kind": data.pop("kind"), "version": data.pop("version"), **data}
    elif isinstance(data, list):
        data = [_kind_first(value) for value in data]
    return data


def to_data(document: Document) -> dict[str, Any]:
    """Plain data with `kind` and `version` first, as written to files."""
    data: dict[str, Any] = _kind_first(document.model_dump(mode="json", exclude_none=True))
    return data


class _Dumper(yaml.SafeDumper):
    """Block style at the top level, flow style for short leaves, floats as 9.89e+14."""

    def represent(self, data: Any) -> None:
        node = self.represent_data(data)
        if isinstance(node, yaml.MappingNode):
            node.flow_style = False
        self.serialize(node)
        self.represented_objects = {}
        self.object_keeper = []
        self.alias_key = None


def _represent_float(dumper: yaml.SafeDumper, value: float) -> Any:
    if value != 0 and math.isfinite(value) and not 1e-3 <= abs(value) < 1e6:
        exponent = math.floor(math.log10(abs(value)))
        text = f"{value / 10**exponent!r}e{exponent:+03d}"
        if float(text) == value:
            return dumper.represent_scalar("tag:yaml.org,2002:float", text)
    return dumper.represent_float(value)


_Dumper.add_representer(float, _represent_float)


def to_yaml(document: Document) -> str:
    """The document as YAML text: block style at the top, short leaves in flow style."""
    return yaml.dump(to_data(document), Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=100)


def to_json(document: Document) -> str:
    """The document as indented JSON text."""
    return json.dumps(to_data(document), indent=2)


def save_document(document: Document, path: str | Path) -> None:
    """Write atomically (temp file + rename): never a half-written file."""
    path = Path(path)
    text = to_json(document) if path.suffix == ".json" else to_yaml(document)
    write_text_atomic(path, text)


def read_utf8(path: Path) -> str:
    """A text file nereus wrote (a run folder's logs, a checkpoint index), or a NereusError
    naming it when its bytes are not UTF-8 (a damaged file)."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NereusError(f"{path}: not UTF-8 text (bad byte at offset {exc.start}); the file is damaged") from None


def keep_json_lines(path: Path, keep: Callable[[Any], bool]) -> None:
    """Rewrite a JSON-lines file atomically with the records `keep` accepts; a line that does
    not parse, or that `keep` cannot read (KeyError, TypeError), is dropped: it is what a kill
    cuts short. A missing file is left missing."""
    if not path.is_file():
        return
    kept = []
    # A damaged byte makes its line unparseable, so that line is dropped like a cut one.
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            if keep(json.loads(line)):
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    write_text_atomic(path, "".join(kept))


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder (never half-written)."""
    if path.parent and not path.parent.exists():
        raise SpecError([f"{path}: folder {path.parent} does not exist; create it first"])
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:  # a folder this user may not write, a read-only or full disk
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # e.g. the disk filled: nothing is left behind, the error names `path`
        Path(tmp).unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
