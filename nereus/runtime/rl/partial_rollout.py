"""Partial rollout in an async run (`partial_rollout: true`; issue 49, docs/async.md "Partial
rollout"): a generation interrupted by a weight sync continues under the new weights.

The rule is a function of the schedule, never of timing, so a run is the same whatever the
load. With k = `max_staleness`, L = `max_new_tokens` and tick t the generation pool's part of
step t (it holds version t, the weights after t updates):

- batch b is admitted (its prompts drawn) at tick s_b = max(0, b - k) and must be whole by the
  end of tick e_b = max(0, b - 1), before training step b takes it (k = 0 takes turns:
  e_b = b); its window has n_b = e_b - s_b + 1 ticks (k from batch k + 1 on);
- at each tick of its window every unfinished sample of batch b generates at most
  c_b = ceil(L / n_b) tokens, all in one engine with every other batch in flight, then pauses:
  it keeps its tokens, the behaviour log-prob of each and the version that sampled each, and
  continues at the next tick from prompt + tokens under the new weights (the own engine from
  the same sampling stream at the same count; vLLM re-seeded where it continues,
  `vllm_engine.continuation_seed`);
- at the end of the tick every batch that is whole is handed over, in the stream's order.

n_b c_b >= L, so every batch is whole by its deadline (asserted). A sample's version is its
oldest token's, s_b, so training step b trains it b - s_b <= k versions behind: the queue's
bound holds. At k <= 1 every window is one tick (c_b = L): nothing spans a sync and the
rule is the loop without partial rollout. At k >= 2 a tick decodes the k batches in flight
for at most ceil(L / k) tokens each instead of one batch to its longest response: the long
tail of a batch no longer holds the generation pool back from the sync.

`PartialRollout` keeps the samples in flight (admitted, not handed over) and saves them into a
checkpoint (`save`, `load`: JSON plus one safetensors file, the queue's sample format, nothing
unpickled), so a SIGKILL and `--resume` continue them where the checkpoint's tick left them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nereus.errors import NereusError
from nereus.runtime.rl.async_queue import VersionedSample, encode_samples, read_pair, write_pair
from nereus.spec.io import one_line

#: The samples in flight inside a checkpoint folder (and, per tick, in the hand-off folder).
STATE_FILE = "partial.json"
TENSORS_FILE = "partial.safetensors"
FORMAT = 1


def window(batch: int, max_staleness: int) -> tuple[int, int]:
    """(s_b, e_b): the first and last tick that generate batch `batch` (the module docstring;
    k = 0 takes turns: tick b generates batch b while training waits for it)."""
    return max(0, batch - max_staleness), batch if max_staleness == 0 else max(0, batch - 1)


def tick_cap(batch: int, max_staleness: int, max_new_tokens: int) -> int:
    """c_b: the most tokens a sample of batch `batch` generates in one tick of its window."""
    first, last = window(batch, max_staleness)
    return -(-max_new_tokens // (last - first + 1))


@dataclass
class InFlight:
    """One sample of a partial rollout: what it generated so far, under which versions."""

    index: int
    """Its place in the run's sample stream."""
    batch: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    """The behaviour log-prob of each token, under the version that sampled it."""
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token."""
    finished: bool = False
    greedy: list[int] | None = None
    """ReMax's greedy response (generated whole when the batch is admitted)."""

    def sample(self) -> VersionedSample:
        """As the queue's sample (its version: its oldest token's)."""
        tensors = {
            "prompt": torch.tensor(self.prompt, dtype=torch.long),
            "response": torch.tensor(self.tokens, dtype=torch.long),
            "log_probs": torch.tensor(self.log_probs, dtype=torch.float32),
            "versions": torch.tensor(self.versions, dtype=torch.long),
        }
        if self.greedy is not None:
            tensors["greedy"] = torch.tensor(self.greedy, dtype=torch.long)
        version = min(self.versions) if self.versions else 0
        return VersionedSample(self.index, version, tensors, {"batch": self.batch, "finished": self.finished})


@dataclass(frozen=True)
class Piece:
    """A sample's work in one tick: continue `sample` by at most `cap` tokens."""

    sample: InFlight
    cap: int


class PartialRollout:
    """The generation pool's samples in flight under partial rollout (the module docstring).
    Every rank of the pool holds the same one (same calls, same arguments)."""

    def __init__(self, max_staleness: int, batch_size: int, max_new_tokens: int, num_batches: int) -> None:
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        self.num_batches = num_batches
        """Batches the run trains (none past them is admitted)."""
        self.batches: dict[int, list[InFlight]] = {}
        """Admitted batches not handed over yet, in the stream's order."""
        self.catch_up_from: int | None = None
        """The first batch of a run gone on past its last step (`--resume --steps N`) whose window
        opened before the resume: the resume's first tick admits it and the ones after it late."""
        self.late: set[int] = set()
        """Batches admitted after their window opened: generated whole in their first tick."""

    def admitted_at(self, tick: int) -> list[int]:
        """The batches tick `tick` admits: those whose window opens there."""
        first = 0 if tick == 0 else tick + self.max_staleness
        last = min(tick + self.max_staleness, self.num_batches - 1)
        if self.catch_up_from is not None:  # the windows of these opened before the run stopped
            first, self.catch_up_from = self.catch_up_from, None
            self.late = {batch for batch in range(first, last + 1) if window(batch, self.max_staleness)[0] < tick}
        return [batch for batch in range(first, last + 1) if window(batch, self.max_staleness)[0] <= tick]

    def admit(self, batch: int, prompts: list[list[int]], greedy: list[list[int]] | None = None) -> None:
        """Batch `batch`'s samples, nothing generated yet."""
        assert batch not in self.batches and len(prompts) == self.batch_size, (batch, len(prompts))
        self.batches[batch] = [
            InFlight(batch * self.batch_size + row, batch, list(prompt), greedy=None if greedy is None else greedy[row])
            for row, prompt in enumerate(prompts)
        ]

    def work(self) -> list[Piece]:
        """This tick's work, in the stream's order: every unfinished sample with its cap."""
        pieces = []
        for batch, samples in self.batches.items():
            cap = (
                self.max_new_tokens if batch in self.late else tick_cap(batch, self.max_staleness, self.max_new_tokens)
            )
            for sample in samples:
                if not sample.finished:
                    pieces.append(Piece(sample, min(cap, self.max_new_tokens - len(sample.tokens))))
        return pieces

    def record(
        self,
        pieces: list[Piece],
        tokens: list[list[int]],
        log_probs: list[list[float]],
        version: int,
        stop_tokens: tuple[int, ...],
    ) -> None:
        """The tick's new tokens of every piece, sampled at `version`, and their log-probs."""
        for piece, new, values in zip(pieces, tokens, log_probs, strict=True):
            sample = piece.sample
            assert 0 < len(new) <= piece.cap and len(values) == len(new), (sample.index, len(new), piece.cap)
            sample.tokens += new
            sample.log_probs += values
            sample.versions += [version] * len(new)
            sample.finished = len(sample.tokens) >= self.max_new_tokens or new[-1] in stop_tokens

    def hand_over(self, tick: int) -> list[tuple[int, list[VersionedSample]]]:
        """The whole batches after tick `tick`, from the oldest on, each with its samples
        (removed); every batch whose window ends at `tick` is among them."""
        out = []
        for batch in sorted(self.batches):
            samples = self.batches[batch]
            self.late.discard(batch)
            if not all(sample.finished for sample in samples):
                break
            out.append((batch, [sample.sample() for sample in samples]))
            del self.batches[batch]
        for batch in self.batches:
            assert window(batch, self.max_staleness)[1] > tick, f"batch {batch} is not whole by its tick {tick}"
        return out

    # ---- checkpoints ----

    def save(self, folder: Path, tick: int) -> None:
        """The samples in flight after tick `tick` into `folder` (`STATE_FILE`, `TENSORS_FILE`)."""
        samples = [sample.sample() for batch in self.batches.values() for sample in batch]
        entries, tensors = encode_samples(samples)
        data = {"format": FORMAT, **self._settings(tick), "samples": entries}
        write_pair(folder, STATE_FILE, data, TENSORS_FILE, tensors)

    def load(self, folder: Path, tick: int) -> None:
        """The samples in flight `save` wrote after tick `tick`; NereusError (one line naming
        the file and the field) when the files are missing, damaged or from another run's settings."""
        missing = "the checkpoint holds no partial rollout (resume with the plan's workload unchanged)"
        data, tensors = read_pair(folder, STATE_FILE, TENSORS_FILE, "partial rollout", missing)
        try:
            self.batches = self._from_state(data, tensors, tick)
        except (ValueError, KeyError, TypeError) as error:
            raise NereusError(f"{folder / STATE_FILE}: {one_line(str(error))}") from None

    def _settings(self, tick: int) -> dict[str, int]:
        """What a checkpoint after tick `tick` records of this rollout, and a resume must match."""
        return {
            "tick": tick,
            "max_staleness": self.max_staleness,
            "batch_size": self.batch_size,
            "max_new_tokens": self.max_new_tokens,
        }

    def _from_state(self, data: Any, tensors: dict[str, torch.Tensor], tick: int) -> dict[int, list[InFlight]]:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"format: expected {FORMAT}")
        for name, value in self._settings(tick).items():
            if data.get(name) != value:
                raise ValueError(
                    f"{name}: {data.get(name)!r}, this run has {value} (resume with the workload unchanged)"
                )
        batches: dict[int, list[InFlight]] = {}
        for position, entry in enumerate(data["samples"]):
            where = f"samples[{position}]"
            index, info = entry["index"], entry["info"]
            batch = info["batch"]
            named = {name: tensors[f"{index}/{name}"] for name in entry["tensors"]}
            sample = InFlight(
                index,
                batch,
                named["prompt"].tolist(),
                named["response"].tolist(),
                named["log_probs"].tolist(),
                named["versions"].tolist(),
                bool(info["finished"]),
                named["greedy"].tolist() if "greedy" in named else None,
            )
            row = index - batch * self.batch_size
            lengths = {len(sample.tokens), len(sample.log_probs), len(sample.versions)}
            if not 0 <= row < self.batch_size or len(lengths) != 1:
                raise ValueError(f"{where}: sample {index} of batch {batch} does not fit the batch or its tokens")
            if sample.versions and min(sample.versions) < window(batch, self.max_staleness)[0]:
                raise ValueError(f"{where}: a token of version {min(sample.versions)} is older than its batch's window")
            batches.setdefault(batch, []).append(sample)
        for batch, samples in batches.items():
            if [s.index for s in samples] != list(range(batch * self.batch_size, (batch + 1) * self.batch_size)):
                raise ValueError(f"samples: batch {batch} is not whole, in order")
        return dict(sorted(batches.items()))


def version_spans(samples: list[VersionedSample]) -> dict[int, int]:
    """Histogram of a batch: versions its samples' tokens span (1: one version) -> samples."""
    versions = [sample.tensors.get("versions") for sample in samples]
    spans = Counter(1 if v is None or v.numel() == 0 else int(v.max() - v.min()) + 1 for v in versions)
    return dict(sorted(spans.items()))


def longest_by_version(samples: list[VersionedSample]) -> dict[int, int]:
    """The most tokens any sample of a batch generated under each version: a tick's decode
    steps on the batch (without partial rollout, its longest response at its one version)."""
    longest: dict[int, int] = {}
    for sample in samples:
        versions = sample.tensors.get("versions")
        if versions is None:
            continue
        found, counts = versions.unique(return_counts=True)
        for version, count in zip(found.tolist(), counts.tolist(), strict=True):
            longest[version] = max(longest.get(version, 0), count)
    return dict(sorted(longest.items()))
