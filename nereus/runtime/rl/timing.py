"""Where a step's time went: timed phases, their slowest-rank totals, and the fused moments
put on the run's timeline (`nereus.runtime.observe.timeline`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nereus.runtime.comm import collectives
from nereus.runtime.comm.world import device as rank_device
from nereus.runtime.model.fused_pipeline import OpTiming
from nereus.runtime.observe import timeline
from nereus.runtime.observe.memory import PeakTracker
from nereus.runtime.rl.stages import ModelStageRuntime, local_state_bytes
from nereus.spec.stages import ModelStageName, Phase, is_model_stage

if TYPE_CHECKING:
    from nereus.runtime.rl.fused_rollout import RolloutEvent


class StepSeconds(dict[str, float]):
    """A step's seconds by model-stage and phase, the rank's memory tracker that its
    model-stages' blocks read (None: memory untracked, e.g. tests driving steps directly), and
    the model-stages whose offloaded engines a block wakes and puts back to sleep."""

    def __init__(self, peaks: PeakTracker | None = None, stages: dict[str, ModelStageRuntime] | None = None) -> None:
        super().__init__()
        self.peaks = peaks
        self.stages = stages or {}


def tracker_of(seconds: dict[str, float]) -> PeakTracker | None:
    """The memory tracker `seconds` carries (a plain dict carries none)."""
    return seconds.peaks if isinstance(seconds, StepSeconds) else None


@contextmanager
def timed(seconds: dict[str, float], name: ModelStageName | Phase) -> Iterator[None]:
    """Add the block's wall time to `seconds[name]` and record it on the run's timeline; a
    model-stage's block (not a phase's) is also a memory segment of the tracker `seconds`
    carries (`StepSeconds`)."""
    start, wall_start = time.perf_counter(), time.time()
    is_stage = is_model_stage(name)
    # Only model-stages' peaks are reported; a phase's peak still reaches the step's peak
    # at the next reading (the high-water mark holds it), so a phase takes no reading: each
    # costs a /proc read and write on CPU.
    peaks = tracker_of(seconds) if is_stage else None
    stage = seconds.stages.get(name) if is_stage and isinstance(seconds, StepSeconds) else None
    engine = stage.engine if stage is not None else None
    if peaks is not None:
        peaks.enter(name)
    if engine is not None:  # an offloaded model-stage runs awake and sleeps after (its peak read awake)
        engine.wake()
    yield
    if peaks is not None:
        peaks.exit(name)
    if engine is not None:
        engine.sleep()
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
    timeline.record("stage" if is_stage else "phase", name, wall_start, time.time())


def gather_numbers(values: list[float]) -> torch.Tensor:
    """[world, len(values)] float64 on the CPU: every rank's `values` (collective)."""
    # On the rank's device: NCCL gathers only GPU tensors.
    if dist.get_world_size() == 1:
        return torch.tensor([values], dtype=torch.float64)
    mine = torch.tensor(values, dtype=torch.float64, device=rank_device())
    return torch.stack(collectives.all_gathered(mine)).cpu()


def slowest_rank(seconds: dict[str, float], names: list[str]) -> dict[str, float]:
    """Every name's time on the slowest rank (ranks that skip a phase report 0)."""
    table = gather_numbers([seconds.get(name, 0.0) for name in names])
    return dict(zip(names, table.max(dim=0).values.tolist(), strict=True))


@dataclass(frozen=True)
class StepTotals:
    """What a step's ranks measured, gathered from all of them."""

    seconds: dict[str, float]
    """Every name's time on the slowest rank."""
    state_bytes: list[int]
    """Bytes of engine state each rank holds."""
    memory_peak: list[int]
    """Each rank's peak memory during the step (`nereus.runtime.observe.memory`; 0 untracked)."""
    memory_peak_by_stage: dict[str, list[int]]
    """Each model-stage's peak on every rank while it ran (0 on ranks it skips)."""
    host_peak: list[int]
    """Each rank's highest host-memory state bytes during the step (offload; 0 untracked)."""


def step_totals(seconds: dict[str, float], names: list[str], stages: dict[str, ModelStageRuntime]) -> StepTotals:
    """`slowest_rank` of `seconds`, the bytes of engine state each rank holds (of `stages`)
    and the peak memory of the step and of each model-stage, from one all-gather: each
    collective costs a few ms on gloo."""
    peaks = tracker_of(seconds)
    step_peak = peaks.end_step() if peaks is not None else 0
    stage_peaks = [float(peaks.segment_peaks.get(n, 0)) if peaks is not None else 0.0 for n in names]
    times = [seconds.get(name, 0.0) for name in names]
    host_peak = float(peaks.host_peak) if peaks is not None else 0.0
    table = gather_numbers([*times, *stage_peaks, float(local_state_bytes(stages)), host_peak, float(step_peak)])
    count = len(names)
    slowest = table[:, :count].max(dim=0).values.tolist()
    by_stage: dict[str, list[int]] = {
        n: [int(v) for v in table[:, count + i].tolist()] for i, n in enumerate(names) if is_model_stage(n)
    }
    return StepTotals(
        dict(zip(names, slowest, strict=True)),
        [int(held) for held in table[:, -3].tolist()],
        [int(peak) for peak in table[:, -1].tolist()],
        by_stage,
        [int(host) for host in table[:, -2].tolist()],
    )


def record_fused(events: list[RolloutEvent], op_timings: list[OpTiming]) -> None:
    """Put the fused rollout's and the fused pipeline's moments on the run's timeline (their
    clocks are perf_counter readings of this rank: shifted onto the timeline's wall clock)."""
    offset = time.time() - time.perf_counter()
    opened: dict[tuple[str, str | None], float] = {}
    for event in events:
        what, edge = event.kind.rsplit("_", 1)
        if edge == "start":
            opened[(what, event.model_stage)] = event.time_s
        elif edge == "end" and (what, event.model_stage) in opened:
            start = opened.pop((what, event.model_stage))
            name = what if event.model_stage is None else f"{event.model_stage} ({what})"
            timeline.record("fused", name, start + offset, event.time_s + offset, samples=len(event.samples))
        else:  # a moment, e.g. a sample finished
            moment = event.time_s + offset
            timeline.record("fused", event.kind, moment, moment, samples=list(event.samples))
    for op in op_timings:
        timeline.record(
            "fused",
            f"{op.model} {op.kind}{op.microbatch}",
            op.ready + offset,
            op.end + offset,
            stage=op.stage,
            update=op.update,
            wait_s=op.ready - op.start,
        )
