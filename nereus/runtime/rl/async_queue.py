"""The bounded staleness queue between an async run's generation loop and its training loop
(issue 49; docs/async.md, "The runtime side").

Versions: the trainer's policy version v is the number of updates applied, so training step t
trains at version t and its weight sync hands version t + 1 to the generation pool. A sample
records the version of the weights that generated it (the oldest one, were a partial rollout
continued under newer weights). Training takes whole batches of `batch_size` samples, first in
first out, one batch per version, so a sample put behind n queued samples is trained at version
v + n // batch_size, whatever happens in between: the queue knows each sample's training version
when it is put. It accepts a sample only when that version is at most `max_staleness` k after the
sample's, so no trained batch holds a sample older than k versions (asserted again at `take`);
a refused sample stays refused (its generator must regenerate it under newer weights), which is
why a generator asks for `room` under its version before it generates. Generation therefore runs
at most k batches ahead of training, and k = 0 makes the two take turns.

Samples are numbered in the run's stream (the i-th sample of the run: its prompt and its draw);
the queue accepts them in that order only and hands them out in that order, so none is lost or
repeated, and a checkpoint of the queue (`save`, `load`: JSON plus one safetensors file, nothing
unpickled) tells a resumed generator where to continue (`next_index`).

Each training rank of an async run keeps one in its one thread, fed from the generation pool's
hand-off folder (`nereus.runtime.run.async_loop`).
"""

from __future__ import annotations

import json
import os
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nereus.errors import NereusError
from nereus.spec.io import one_line

#: The queue's files inside a checkpoint folder.
STATE_FILE = "queue.json"
TENSORS_FILE = "queue.safetensors"
FORMAT = 1


@dataclass(frozen=True)
class VersionedSample:
    """One generated sample and the policy version that generated it."""

    index: int
    """Its place in the run's sample stream (0, 1, 2, ...)."""
    version: int
    """The policy version of the weights that generated it (the oldest, under partial rollout)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Its per-sample tensors (tokens, the behaviour log-probs, `versions`: the version that
    sampled each response token, ...), saved with the queue."""
    info: dict[str, Any] = field(default_factory=dict)
    """Its JSON-able facts (the prompt's id, the reward, ...), saved with the queue."""


class StalenessQueue:
    """Samples waiting for training; at most `max_staleness` versions between a sample's version
    and the version that trains it (the module docstring has the rules)."""

    def __init__(self, max_staleness: int, batch_size: int, version: int = 0, next_index: int = 0) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self._version = version
        self._next_index = next_index
        self._samples: deque[VersionedSample] = deque()

    @property
    def version(self) -> int:
        """The version the next `take` trains at (the updates applied so far)."""
        return self._version

    @property
    def next_index(self) -> int:
        """The stream index the next accepted sample must have (where a resumed generator continues)."""
        return self._next_index

    def __len__(self) -> int:
        return len(self._samples)

    def room(self, version: int) -> int:
        """How many samples generated at `version` the queue would accept now, in a row."""
        assert version <= self._version, f"generation at version {version} is ahead of training ({self._version})"
        # Position p is trained at v + p // batch_size; it must be at most version + k.
        limit = (version + self.max_staleness + 1 - self._version) * self.batch_size
        return max(0, limit - len(self._samples))

    def put(self, sample: VersionedSample) -> bool:
        """Queue `sample`, the stream's next; False (and nothing queued) where it would be
        trained more than `max_staleness` versions after its own: regenerate it under newer weights."""
        assert sample.index == self._next_index, f"sample {sample.index} put where {self._next_index} is next"
        assert oldest_token(sample) in (None, sample.version), (sample.index, sample.version, oldest_token(sample))
        if self.room(sample.version) == 0:
            return False
        self._samples.append(sample)
        self._next_index += 1
        return True

    def ready(self) -> bool:
        """Whether a whole batch is queued."""
        return len(self._samples) >= self.batch_size

    def take(self, version: int) -> list[VersionedSample]:
        """The batch that training at `version` (the queue's `version`) trains on; the queue then
        expects `version + 1`. A batch must be queued (`ready`)."""
        assert version == self._version, f"training at version {version} takes where {self._version} is next"
        assert len(self._samples) >= self.batch_size, "take before a whole batch is queued"
        batch = [self._samples.popleft() for _ in range(self.batch_size)]
        for sample in batch:  # the hard invariant
            assert version - self.max_staleness <= sample.version <= version, (sample.index, sample.version, version)
        self._version += 1
        return batch

    def staleness(self, batch: list[VersionedSample], version: int) -> dict[int, int]:
        """Histogram of a batch trained at `version`: staleness (versions behind) -> sample count."""
        return dict(sorted(Counter(version - sample.version for sample in batch).items()))

    # ---- checkpoints ----

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The queue as a JSON-able dict and its samples' tensors (keyed `index/name`)."""
        samples, tensors = encode_samples(list(self._samples))
        data = {
            "format": FORMAT,
            "max_staleness": self.max_staleness,
            "batch_size": self.batch_size,
            "version": self._version,
            "next_index": self._next_index,
            "samples": samples,
        }
        return data, tensors

    @classmethod
    def from_state(cls, data: dict[str, Any], tensors: dict[str, torch.Tensor]) -> StalenessQueue:
        """The queue `state` returned; ValueError naming the first field that does not fit."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"format: expected {FORMAT}")
        for name in ("max_staleness", "batch_size", "version", "next_index"):
            if not isinstance(data.get(name), int) or isinstance(data.get(name), bool):
                raise ValueError(f"{name}: expected an integer, got {data.get(name)!r}")
        queue = cls(data["max_staleness"], data["batch_size"], data["version"])
        entries = data.get("samples")
        if not isinstance(entries, list):
            raise ValueError("samples: expected a list")
        first = data["next_index"] - len(entries)
        queue._next_index = first
        for position, entry in enumerate(entries):
            where = f"samples[{position}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("index"), int):
                raise ValueError(f"{where}: expected an object with an integer index")
            if not isinstance(entry.get("version"), int) or not isinstance(entry.get("tensors"), list):
                raise ValueError(f"{where}: expected an integer version and a list of tensor names")
            if not isinstance(entry.get("info", {}), dict):
                raise ValueError(f"{where}.info: expected an object")
            if entry["index"] != first + position:
                raise ValueError(
                    f"{where}.index: expected {first + position} (the stream's order), got {entry['index']}"
                )
            if not entry["version"] <= data["version"]:
                raise ValueError(f"{where}.version: {entry['version']} is ahead of training's {data['version']}")
            missing = [name for name in entry["tensors"] if f"{entry['index']}/{name}" not in tensors]
            if missing:
                raise ValueError(f"{where}: tensor {missing[0]!r} missing from the tensors file")
            sample = decode_sample(entry, tensors)
            if oldest_token(sample) not in (None, sample.version):
                raise ValueError(f"{where}.version: {sample.version}, but its oldest token's is {oldest_token(sample)}")
            if not queue.put(sample):
                raise ValueError(f"{where}: version {entry['version']} is more than max_staleness behind its training")
        return queue

    def save(self, folder: Path) -> None:
        """Write the queue into `folder` (`STATE_FILE`, `TENSORS_FILE`), each file replaced atomically."""
        data, tensors = self.state()
        write_pair(folder, STATE_FILE, data, TENSORS_FILE, tensors)

    @classmethod
    def load(cls, folder: Path) -> StalenessQueue:
        """The queue `save` wrote into `folder`; NereusError (one line naming the file) otherwise."""
        data, tensors = read_pair(folder, STATE_FILE, TENSORS_FILE, "async queue", "the checkpoint has no async queue")
        try:
            return cls.from_state(data, tensors)
        except ValueError as error:
            raise NereusError(f"{folder / STATE_FILE}: {error}") from None


def oldest_token(sample: VersionedSample) -> int | None:
    """The oldest version among the sample's tokens (its `versions` tensor, one per response
    token: a partial rollout's sample spans several), which is the sample's version; None
    where it records none."""
    versions = sample.tensors.get("versions")
    return None if versions is None or versions.numel() == 0 else int(versions.min())


def encode_samples(samples: list[VersionedSample]) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """Samples as JSON-able entries and their tensors keyed `index/name` (the queue's file format)."""
    entries = [{"index": s.index, "version": s.version, "tensors": sorted(s.tensors), "info": s.info} for s in samples]
    tensors = {f"{s.index}/{name}": t.detach().cpu().contiguous() for s in samples for name, t in s.tensors.items()}
    return entries, tensors


def decode_sample(entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> VersionedSample:
    """The sample of an entry `encode_samples` wrote, its tensors taken from `tensors`."""
    named = {name: tensors[f"{entry['index']}/{name}"] for name in entry["tensors"]}
    return VersionedSample(entry["index"], entry["version"], named, entry.get("info", {}))


def write_pair(folder: Path, json_name: str, data: Any, tensors_name: str, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` as a safetensors file, then `data` as JSON, each replaced atomically: the JSON
    file's presence says both are whole."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for name, write in (
        (tensors_name, lambda path: save_file(tensors, str(path))),
        (json_name, lambda path: path.write_text(json.dumps(data, indent=1) + "\n")),
    ):
        temporary = folder / f".{name}.tmp"
        write(temporary)
        os.replace(temporary, folder / name)


def read_pair(
    folder: Path, json_name: str, tensors_name: str, what: str, missing: str
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The JSON data and tensors `write_pair` wrote (nothing unpickled); NereusError in one line
    naming the missing file (with `missing`, what its absence means) or the unreadable `what`."""
    from safetensors.torch import load_file

    try:
        return json.loads((folder / json_name).read_text()), load_file(str(folder / tensors_name))
    except FileNotFoundError as error:
        raise NereusError(f"{error.filename}: missing; {missing}") from None
    except Exception as error:  # JSON and safetensors report bad files in their own error types
        raise NereusError(f"{folder}: unreadable {what} ({one_line(str(error))})") from None


# ---- the rollout's hand-off from the generation pool to the training pool ----


def batch_names(batch: int) -> tuple[str, str]:
    """The JSON and safetensors file names of generated batch `batch` in the hand-off folder."""
    return f"batch-{batch:06d}.json", f"batch-{batch:06d}.safetensors"


def write_batch(folder: Path, batch: int, samples: list[VersionedSample]) -> None:
    """Hand generated batch `batch` to the training pool: its two files in `folder`, the JSON
    one last (`read_batch` sees the batch whole or not at all)."""
    entries, tensors = encode_samples(samples)
    json_name, tensors_name = batch_names(batch)
    write_pair(folder, json_name, {"format": FORMAT, "batch": batch, "samples": entries}, tensors_name, tensors)


def read_batch(folder: Path, batch: int) -> list[VersionedSample] | None:
    """Batch `batch` as `write_batch` handed it over (None while its JSON file is not there).
    The files are the run's own, written by its generation pool; nothing in them is unpickled."""
    from safetensors.torch import load_file

    json_name, tensors_name = batch_names(batch)
    if not (folder / json_name).is_file():
        return None
    data = json.loads((folder / json_name).read_text())
    tensors = load_file(str(folder / tensors_name))
    assert data.get("format") == FORMAT and data.get("batch") == batch, (folder / json_name, data.get("batch"))
    return [decode_sample(entry, tensors) for entry in data["samples"]]


def remove_batch(folder: Path, batch: int) -> None:
    """Delete batch `batch`'s hand-off files (trained, or left by a killed run)."""
    for name in batch_names(batch):
        (folder / name).unlink(missing_ok=True)
