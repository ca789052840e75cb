"""Reading and writing nereus documents (YAML or JSON), with one-line errors."""

from __future__ import annotations

import importlib
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
from nereus.spec.cluster import Cluster
from nereus.spec.model import Model
from nereus.spec.plan import Plan
from nereus.spec.transition import Transition
from nereus.spec.workload import Workload

#: Every document kind this release reads, by its `kind:` value.
KINDS: dict[str, type[Document]] = {
    "Cluster": Cluster,
    "Model": Model,
    "Workload": Workload,
    "Plan": Plan,
    "Transition": Transition,
}

#: Kinds defined above the spec layer, and the module that registers each (with its
#: semantic checks); imported the first time a file of that kind is read.
LATE_KINDS = {
    "Calibration": "nereus.cost",
    "Profile": "nereus.cost.profile",
    "RunConfig": "nereus.runtime.rl.config",  # pure pydantic: reading one never imports torch
    "Schedule": "nereus.solver.pipeline.document",
    "Trace": "nereus.spec.trace",
}

MAX_FILE_BYTES = 64 * 1024 * 1024


def register_kind(kind: type[Document]) -> None:
    """Make `kind` readable by `load_document` (used by layers that add kinds)."""
    KINDS[kind.model_fields["kind"].default] = kind


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and aliases (no silent overrides)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(
                f"line {event.start_mark.line + 1}: YAML aliases (*name) are not "
                "supported in nereus files; write the value out"
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.YAMLError(f"line {key_node.start_mark.line + 1}: a key must be a scalar") from None
            if key in seen:
                raise yaml.YAMLError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}; keep one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _reject_duplicate_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"duplicate key {duplicates[0]!r}; keep one")
    return dict(pairs)


def parse_data(text: str, source: str) -> Any:
    """Parse YAML or JSON text into plain Python data; errors name `source`."""
    if not text.strip():
        return None  # reported as an empty file
    try:
        if source.endswith(".json"):
            return json.loads(text, object_pairs_hook=_reject_duplicate_json_keys)
        return yaml.load(text, Loader=_StrictLoader)  # safe: _StrictLoader is a SafeLoader subclass
    except RecursionError:
        raise SpecError([f"{source}: nested too deeply to be a nereus file"]) from None
    except (yaml.YAMLError, ValueError) as exc:
        detail = " ".join(str(exc).split())
        raise SpecError([f"{source}: not valid {'JSON' if source.endswith('.json') else 'YAML'}: {detail}"]) from None


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


def document_from_data(data: Any, source: str) -> Document:
    """Validate parsed data as the document its `kind:` names (schema only)."""
    if data is None or data == "":
        raise SpecError([f"{source}: empty file; a nereus file starts with `kind:` and `version:`"])
    if not isinstance(data, dict):
        raise SpecError([f"{source}: expected a mapping with `kind:` at the top, got {type(data).__name__}"])
    kind_name = data.get("kind")
    if isinstance(kind_name, str) and kind_name not in KINDS and kind_name in LATE_KINDS:
        importlib.import_module(LATE_KINDS[kind_name])
    if not isinstance(kind_name, str) or kind_name not in KINDS:
        known = ", ".join(dict.fromkeys([*KINDS, *LATE_KINDS]))
        what = "missing" if "kind" not in data else f"unknown kind {kind_name!r}"
        raise SpecError([f"{source}: kind: {what}; use one of {known}"])
    if "version" not in data:
        raise SpecError([f"{source}: version: required field is missing; add `version: 1`"])
    kind = KINDS[kind_name]
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise SpecError(validation_problems(exc, kind, source)) from None


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
        from nereus.spec.check import semantic_problems

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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
