"""The run's tokenizer: one interface over a model folder's own tokenizer and the synthetic
tasks' character tokenizer.

A model folder's tokenizer is its `tokenizer.json`, read by the `tokenizers` library (no
torch, so `nereus run` checks a dataset against it before any rank exists), with the special
tokens and chat template of its `tokenizer_config.json` and the stop tokens of its
`generation_config.json`/`config.json`. A chat template is rendered by jinja2's sandbox, as
Hugging Face renders it: the template can call no Python outside the sandbox.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nereus.errors import MissingDependency, NereusError

#: A prompt is a string or a list of chat messages ({"role": ..., "content": ...}).
PromptValue = str | list[dict[str, str]]

#: Files of a model folder the tokenizer is read from.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer(Protocol):
    """What the run needs of a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Token ids are below this."""
        ...

    @property
    def pad_id(self) -> int:
        """Fills prompts on the left and responses after they stop."""
        ...

    @property
    def eos_id(self) -> int:
        """The token generation stops at."""
        ...

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every token a response ends at (`eos_id` among them)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first stop token, special tokens dropped."""
        ...

    def prompt_ids(self, prompt: PromptValue) -> list[int]:
        """A prompt's ids as the model sees them: a string with the tokenizer's own special
        tokens (begin of sequence), chat messages through the chat template with the
        assistant's turn opened. ValueError when the prompt cannot be encoded."""
        ...


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise NereusError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(document, dict):
        raise NereusError(f"{path}: must hold a JSON object")
    return document


def _eos_ids(folder: Path) -> list[int]:
    """Stop token ids of generation_config.json, else config.json (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        if isinstance(value, int):
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return list(value)
    return []


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The folder's default chat template: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates whose `default` is used)."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@dataclass(frozen=True)
class FolderTokenizer:
    """A model folder's tokenizer.json with its special tokens and chat template."""

    folder: Path
    backend: Any
    """The `tokenizers.Tokenizer`."""
    pad_id: int
    eos_id: int
    stop_ids: frozenset[int]
    bos_text: str | None
    eos_text: str | None
    chat_template: str | None

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        kept = [int(token) for token in itertools.takewhile(lambda token: token not in self.stop_ids, ids)]
        return str(self.backend.decode(kept, skip_special_tokens=True))

    def prompt_ids(self, prompt: PromptValue) -> list[int]:
        if isinstance(prompt, str):
            return list(self.backend.encode(prompt, add_special_tokens=True).ids)
        return self.encode(self.render_chat(prompt))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to `messages`, the assistant's turn opened."""
        if self.chat_template is None:
            raise ValueError(
                f"the tokenizer of {self.folder} has no chat template (none in {TOKENIZER_CONFIG_FILE} or "
                f"{CHAT_TEMPLATE_FILE}); give prompts as strings or add a chat template"
            )
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise MissingDependency("rendering a chat template", "jinja2", "data") from None
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            template = environment.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_text or "",
                eos_token=self.eos_text or "",
            )
        except TemplateError as error:
            raise ValueError(f"the chat template of {self.folder} fails: {error}") from None


def has_folder_tokenizer(folder: Path) -> bool:
    """Whether `folder` holds a tokenizer.json."""
    return (folder / TOKENIZER_FILE).is_file()


def load_folder_tokenizer(folder: Path) -> FolderTokenizer:
    """The tokenizer of a model folder (NereusError naming the file on any problem)."""
    try:
        from tokenizers import Tokenizer as Backend
    except ImportError:
        raise MissingDependency("a model folder's tokenizer", "tokenizers", "data") from None
    path = folder / TOKENIZER_FILE
    try:
        backend = Backend.from_file(str(path))
    except Exception as error:  # the library raises its own exception type for any bad file
        raise NereusError(f"{path}: not a tokenizer the tokenizers library reads ({error})") from None
    config = _read_json(folder / TOKENIZER_CONFIG_FILE)
    texts = {name: _token_text(config.get(f"{name}_token")) for name in ("bos", "eos", "pad")}

    def token_id(name: str) -> int | None:
        text = texts[name]
        found = None if text is None else backend.token_to_id(text)
        if text is not None and found is None:
            raise NereusError(f"{folder / TOKENIZER_CONFIG_FILE}: {name}_token: {text!r} is not in {path.name}")
        return found

    stops = [i for i in [token_id("eos"), *_eos_ids(folder)] if i is not None]
    if not stops:
        raise NereusError(
            f"{folder / TOKENIZER_CONFIG_FILE}: eos_token: not set (nor eos_token_id in generation_config.json or "
            "config.json); a run needs the token responses stop at"
        )
    pad = token_id("pad")
    return FolderTokenizer(
        folder=folder,
        backend=backend,
        pad_id=stops[0] if pad is None else pad,
        eos_id=stops[0],
        stop_ids=frozenset(stops),
        bos_text=texts["bos"],
        eos_text=texts["eos"],
        chat_template=_chat_template(folder, config),
    )
