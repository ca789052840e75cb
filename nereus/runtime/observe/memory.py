"""Peak memory of a rank: measured per step and per model-stage, and what the cost model predicts.

Measured (`PeakTracker`): on CUDA, `torch.cuda.max_memory_allocated` (the caching
allocator's high-water mark of live tensors), its peak reset at every mark. On CPU, the
process's peak resident set (`VmHWM` in /proc/self/status) less its shared pages
(`RssShmem`: the state arena, resident whole from its reservation on, and the peers'
arenas it maps to reshard), less its file pages (`RssFile`: the libraries' code) and less
the idle rank's private anonymous pages (`RssAnon`, read once the modules a step imports
are loaded; with a run's `memory_baseline: step`, again at every step's start: `rebase`), plus
the bytes of tensors in its own arena;
the peak is reset at every mark by writing 5 to /proc/self/clear_refs (Linux 4.0+). The rank loop
makes the tracker and hands it to each step (`rl_step(peaks=...)`), with a function that gives the
bytes its state occupies in shared memory (the arena's used bytes). CPU numbers are an upper bound
of the live tensors: they include what a step's own kernels, collectives and Python objects add
to the private memory while it runs.

With `memory_baseline: step` (what benchmarks/memory_parity.py runs), the step's start re-reads
the baseline (`PeakTracker.rebase`) as the private memory that holds no tensor then: the
resident private anonymous pages, after glibc has returned its free heap pages (`malloc_trim`),
less every CPU tensor reachable from Python whose storage lies in private anonymous memory
(`private_tensor_bytes`: host-memory state, and any tensor a previous step left behind). What
that leaves is process memory no GPU allocator counts: the engines' Python objects (modules,
shard layouts, reshard plans) and what the first step's kernels, collectives and dispatch make
once and keep (measured on a 26M-parameter bf16 offload rank: ~7 MB by the second step, 8-20% of
its 50-110 MB rows). A tensor reachable only from C++ at a step's start (none is, by design: no
autograd graph outlives a step) would be taken for such memory.

Host memory (offload): the state a rank keeps in host memory (training-time offload's
gradients, masters and moments, FSDP2's offloaded shards, and offloaded model-stages' sleeping
states: `Engine.host_bytes`) is counted apart, by its tensors' bytes (`PeakTracker.host_bytes`),
its highest reading of the step in `host_peak`. On CPU ranks host and device memory are the
same RAM: those bytes are taken out of the resident-set reading, so the device reading is what
a GPU would hold. Predicted (`nereus.runtime.rl.step.predicted_host`): per rank, the cost model's host
bytes per GPU of every model-stage on it (`Prediction.host_memory_bytes`), which it holds
for the whole step.

Predicted (`nereus.solver.admission.predicted_peaks`, which admission holds against a
rank's memory): per rank and model-stage, the cost model's memory terms of
the running model-stage plus the model states of every other model-stage resident on the
rank (`nereus.cost.plan_cost.evaluate_plan`'s accounting on the rank itself, not on the
busiest GPU), without the allocator workspace the cost model reserves on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_MAPS = Path("/proc/self/maps")


def _status_fields(*field_names: str) -> list[int]:
    """`field_names` of /proc/self/status in bytes, from one read of the file (a step takes
    a reading at every model-stage's start and end)."""
    found: dict[str, int] = {}
    for line in _STATUS.read_text().splitlines():
        name, _, value = line.partition(":")
        if name in field_names:
            found[name] = int(value.split()[0]) * 1024  # kB
    missing = [name for name in field_names if name not in found]
    if missing:
        raise RuntimeError(f"{_STATUS} has no {missing[0]} line")
    return [found[name] for name in field_names]


def cpu_peak_supported() -> bool:
    """Whether this process can read and reset its peak resident set (Linux)."""
    try:
        _status_fields("VmHWM")
        _CLEAR_REFS.write_text("5")
    except (OSError, RuntimeError):
        return False
    return True


def trim_heap() -> None:
    """Return glibc's free heap pages to the system (`malloc_trim(0)`), so memory freed earlier
    is not resident; nothing where the C library has no `malloc_trim` (not glibc)."""
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _private_anonymous_spans() -> list[tuple[int, int]]:
    """This process's private mappings backed by no file (the heap and anonymous mmaps: what
    `RssAnon` counts), as sorted (start, end) addresses from /proc/self/maps."""
    spans = []
    for line in _MAPS.read_text().splitlines():
        fields = line.split()
        if fields[1][3] == "p" and fields[4] == "0":  # private, inode 0
            start, end = fields[0].split("-")
            spans.append((int(start, 16), int(end, 16)))
    return sorted(spans)


def private_tensor_bytes() -> int:
    """Bytes of the storages of every CPU tensor reachable from Python (`gc.get_objects`) that
    lie in private anonymous memory, each storage once: not the state arena's or a peer's
    (shared), not a file's. Wrapper tensors (DTensor) count through their local tensors."""
    import bisect
    import gc

    import torch

    spans = _private_anonymous_spans()
    starts = [start for start, _ in spans]
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): no proxy's __class__ is consulted
            continue
        try:
            if obj.device.type != "cpu" or obj.layout != torch.strided:
                continue
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass has no storage
            continue
        at = bisect.bisect_right(starts, pointer) - 1
        if pointer and at >= 0 and pointer < spans[at][1]:
            storages[pointer] = max(storages.get(pointer, 0), storage.nbytes())
    return sum(storages.values())


@dataclass
class PeakTracker:
    """High-water marks of this rank's memory since `start_step`, overall and per open segment."""

    cuda: bool
    shared_state_bytes: Callable[[], int] = lambda: 0
    """CPU: bytes of this rank's state held in shared memory (its arena's used bytes), counted
    in place of the shared pages, which the reading leaves out."""
    baseline: int = 0
    """CPU: private anonymous resident bytes (`RssAnon`) that hold no tensor, subtracted from every
    reading: the idle rank's, then, from each step's start, those of that start (`rebase`)."""
    rebase_each_step: bool = False
    """CPU: re-read `baseline` at every step's start (`rebase`; a run's `memory_baseline: step`)."""
    host_bytes: Callable[[], int] = lambda: 0
    """Bytes of this rank's state in host memory now (its engines' `host_bytes`; the step
    sets it to the engines it runs)."""
    host_peak: int = 0
    """The highest `host_bytes` reading since `start_step`."""
    step_peak: int = 0
    segment_peaks: dict[str, int] = field(default_factory=dict)
    open: list[str] = field(default_factory=list)

    @classmethod
    def for_device(
        cls, device_type: str, shared_state_bytes: Callable[[], int] = lambda: 0, rebase_each_step: bool = False
    ) -> PeakTracker:
        """A tracker of this process on `device_type` (create it once per rank, before its engines
        exist): on CPU its idle baseline is read now, and re-read at each step's start where
        `rebase_each_step` (a run's `memory_baseline: step`)."""
        tracker = cls(
            cuda=device_type == "cuda", shared_state_bytes=shared_state_bytes, rebase_each_step=rebase_each_step
        )
        if not tracker.cuda and cpu_peak_supported():
            (tracker.baseline,) = _status_fields("RssAnon")
        return tracker

    def _read_and_reset(self) -> int:
        host = self.host_bytes()
        self.host_peak = max(self.host_peak, host)
        if self.cuda:
            import torch

            peak = int(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            return peak
        try:
            peak, shared, files = _status_fields("VmHWM", "RssShmem", "RssFile")
            _CLEAR_REFS.write_text("5")  # the peak restarts from the current resident set
        except (OSError, RuntimeError):
            return 0
        # The peak of the private anonymous pages, where tensors live: shared pages (this rank's
        # state arena, resident whole from its reservation on, and the peers' arenas it mapped
        # to reshard) are not this rank's, so the arena's used bytes count instead; file pages
        # are the libraries' code, paged in as kernels first run (no tensor, and no CUDA
        # allocator counts them). Neither falls during a step, so their current size is taken.
        # Host-memory state is in the private pages too (the same RAM): it is counted apart
        # (`host_peak`).
        return max(0, peak - shared - files - self.baseline - host) + self.shared_state_bytes()

    def _fold(self) -> None:
        peak = self._read_and_reset()
        self.step_peak = max(self.step_peak, peak)
        for name in self.open:
            self.segment_peaks[name] = max(self.segment_peaks.get(name, 0), peak)

    def rebase(self) -> None:
        """CPU: the baseline becomes the private memory that holds no tensor now (between steps):
        the private anonymous resident bytes, once glibc has returned its free heap pages, less
        the CPU tensors in private memory (`private_tensor_bytes`). Python objects, and what the
        kernels and collectives made on first use and keep, then count in no model-stage's peak,
        as on a GPU; tensors that exist now still count where they are resident (the host bytes
        apart, the arena's as its used bytes, any other in the reading)."""
        if self.cuda or not cpu_peak_supported():
            return
        trim_heap()
        (anon,) = _status_fields("RssAnon")
        self.baseline = anon - private_tensor_bytes()

    def start_step(self) -> None:
        if self.rebase_each_step:
            self.rebase()
        self._read_and_reset()
        self.step_peak, self.segment_peaks, self.open = 0, {}, []
        self.host_peak = self.host_bytes()

    def enter(self, name: str) -> None:
        self._fold()
        self.open.append(name)

    def exit(self, name: str) -> None:
        self._fold()
        self.open.remove(name)

    def end_step(self) -> int:
        self._fold()
        return self.step_peak
