"""The verl and OpenRLHF releases the exports are checked against, read from their wheels.

The versions come from `nereus.interop.CHECKED_VERSIONS` (the one place they are pinned).
Each wheel is downloaded without its dependencies (`pip download --no-deps`) and unpacked;
nothing of it is imported: verl's shipped config YAML is read as data, its config dataclasses
and OpenRLHF's argument parser with `ast`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus.interop import CHECKED_VERSIONS

VERL_CONFIG = "verl/trainer/config/_generated_ppo_megatron_trainer.yaml"
#: verl's FSDP PPO trainer's generated config (`nereus export verl --backend fsdp`).
VERL_FSDP_CONFIG = "verl/trainer/config/_generated_ppo_trainer.yaml"
VERL_DATACLASSES = "verl/workers/config"
OPENRLHF_PARSER = "openrlhf/cli/train_ppo_ray.py"
_SELECT = re.compile(r"^\$\{oc\.select:[^,]+,(.*)\}$")


def unpacked_wheel(name: str, root: Path) -> Path:
    """The pinned wheel of `name`, unpacked under `root` (downloaded once per `root`); skips
    the test with the reason when the package index cannot be reached."""
    version = CHECKED_VERSIONS[name]
    target = root / f"{name}-{version}"
    if (target / ".complete").exists():
        return target
    command = [sys.executable, "-m", "pip", "download", "--no-deps", f"{name}=={version}", "-d", str(root)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    wheels = sorted(root.glob(f"{name}-{version}-*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"cannot download {name}=={version} from the package index: {done.stderr.strip()[-200:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(target)
    (target / ".complete").touch()
    return target


def _find(root: Path, relative: str) -> Path:
    """`relative` inside an unpacked wheel (purelib data folders included)."""
    matches = sorted(p for p in root.rglob(Path(relative).name) if p.as_posix().endswith(relative))
    assert matches, f"{relative} not in {root}"
    return matches[0]


#: verl's async trainers' configs, each over `ppo_megatron_trainer` (hydra `defaults`).
VERL_ASYNC_CONFIGS = {
    "one_step_off": "verl/experimental/one_step_off_policy/config/one_step_off_ppo_megatron_trainer.yaml",
    "fully_async": "verl/experimental/fully_async_policy/config/fully_async_ppo_megatron_trainer.yaml",
}


def verl_async_config(root: Path, trainer: str) -> dict[str, Any]:
    """The config of one of verl's async trainers: its own YAML merged over the Megatron PPO
    trainer's generated config, as hydra composes them (the `hydra` and `defaults` keys dropped)."""
    own: dict[str, Any] = yaml.safe_load(_find(root, VERL_ASYNC_CONFIGS[trainer]).read_text(encoding="utf-8"))
    own.pop("hydra", None)
    own.pop("defaults", None)
    return _merged(verl_config(root), own)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def verl_config(root: Path, relative: str = VERL_CONFIG) -> dict[str, Any]:
    """verl's generated trainer config (the Megatron one; `VERL_FSDP_CONFIG` for the FSDP one)."""
    data: dict[str, Any] = yaml.safe_load(_find(root, relative).read_text(encoding="utf-8"))
    return data


def _annotations(root: Path) -> tuple[dict[str, dict[str, str]], dict[str, list[str]]]:
    """Field annotations (as source text) and base names of every class in verl's config package."""
    fields: dict[str, dict[str, str]] = {}
    bases: dict[str, list[str]] = {}
    folder = _find(root, f"{VERL_DATACLASSES}/__init__.py").parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]
                fields[node.name] = {
                    item.target.id: ast.unparse(item.annotation)
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                }
    return fields, bases


def _python_type(annotation: str) -> type | None:
    for word, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if re.search(rf"\b{word}\b", annotation):
            return kind
    return None


def verl_type(root: Path, config: dict[str, Any], key: str) -> type:
    """The type verl declares for dotted `key`: its shipped value's, the default of an
    `${oc.select:...,default}` value, or, for a null, the annotation of the field in the
    dataclass the section's `_target_` names (else any verl config dataclass with that field)."""
    node: Any = config
    parents: list[dict[str, Any]] = []
    for part in key.split("."):
        assert isinstance(node, dict) and part in node, f"verl's config has no key {key!r}"
        parents.append(node)
        node = node[part]
    value = node
    if isinstance(value, str) and (match := _SELECT.match(value)):
        value = yaml.safe_load(match.group(1))
    if isinstance(value, str) and value == "???":
        value = None  # mandatory and unset: the dataclass says what it takes
    if value is not None:
        return type(value)
    fields, bases = _annotations(root)
    leaf = key.split(".")[-1]
    target = str(parents[-1].get("_target_", "")).split(".")[-1]
    pending = [target] if target else []
    while pending:
        name = pending.pop()
        if leaf in fields.get(name, {}):
            kind = _python_type(fields[name][leaf])
            assert kind is not None, (key, fields[name][leaf])
            return kind
        pending += bases.get(name, [])
    declared = {_python_type(f[leaf]) for f in fields.values() if leaf in f}
    assert len(declared) == 1 and None not in declared, f"verl declares no single type for {key!r}: {declared}"
    return declared.pop()  # type: ignore[return-value]


def openrlhf_flags(root: Path) -> dict[str, dict[str, str]]:
    """Every literal flag of OpenRLHF's PPO parser with its `type` and `action` (source text)."""
    flags: dict[str, dict[str, str]] = {}
    tree = ast.parse(_find(root, OPENRLHF_PARSER).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg in ("type", "action")}
            for name in names:
                flags[name] = keywords
    return flags


def assert_openrlhf_parses(settings: dict[str, Any], flags: dict[str, dict[str, str]], where: str = "") -> None:
    """Every flag of an OpenRLHF export is one its parser declares, a switch where the value is
    True and of the declared type otherwise (`flags`: `openrlhf_flags`)."""
    types = {"int": int, "float": float, "str": str}
    for flag, value in settings.items():
        assert flag in flags, (where, flag)
        if value is True:
            assert flags[flag].get("action") == "'store_true'", (flag, flags[flag])
        else:
            declared = types[flags[flag].get("type", "str")]
            assert isinstance(value, declared) and not isinstance(value, bool), (flag, value, declared)
