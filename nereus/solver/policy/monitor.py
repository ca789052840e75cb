"""Monitor: drifting signals against their reference values, and when they will drift again.

Sequence length and measured efficiency trigger a replan when they move more than a
relative threshold from the value they had at the last replan. Pool changes, a refitted
cost model and predicted memory violations always trigger (the policy checks the last
itself); a refit also restarts the efficiency signal, whose past values were measured
against the old model. Each signal's drift rate (slope of its logarithm per step, least
squares over a window) predicts how many steps remain until it crosses its threshold
again: the payback horizon.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from nereus.solver.policy.types import Observation, PolicyConfig


def length_signal(observation: Observation) -> float:
    """The sequence-length signal: mean response length in tokens."""
    return observation.response_len.mean()


@dataclass
class Signal:
    """One monitored quantity: its reference value, threshold and recent history."""

    name: str
    threshold: float
    window: int
    reference: float | None = None
    history: deque[tuple[int, float]] = field(default_factory=deque)

    def observe(self, step: int, value: float) -> None:
        self.history.append((step, math.log(value)))
        while len(self.history) > self.window:
            self.history.popleft()
        if self.reference is None:
            self.reference = value

    def restart(self) -> None:
        """Forget the history and the reference: the next value becomes both."""
        self.history.clear()
        self.reference = None

    def crossing(self, value: float) -> str | None:
        """A trigger label when `value` is past the threshold from the reference."""
        assert self.reference is not None
        change = value / self.reference - 1.0
        return f"{self.name} {change:+.0%}" if abs(change) >= self.threshold else None

    def log_slope(self) -> float:
        """Least-squares slope of log(value) per step over the window (0 with under two points)."""
        if len(self.history) < 2:
            return 0.0
        steps = [s for s, _ in self.history]
        values = [v for _, v in self.history]
        mean_s, mean_v = sum(steps) / len(steps), sum(values) / len(values)
        spread = sum((s - mean_s) ** 2 for s in steps)
        if spread == 0:
            return 0.0
        return sum((s - mean_s) * (v - mean_v) for s, v in zip(steps, values, strict=True)) / spread

    def steps_to_cross(self) -> float:
        """Steps until the signal, drifting at its current rate, moves a threshold from now."""
        slope = abs(self.log_slope())
        return math.log1p(self.threshold) / slope if slope > 0 else math.inf


@dataclass
class Monitor:
    """The signals of one job, their references, and the pool-change rate."""

    config: PolicyConfig
    signals: dict[str, Signal] = field(init=False)
    pool_change_steps: list[int] = field(default_factory=list)
    last_gpus: int | None = None

    def __post_init__(self) -> None:
        window = self.config.rate_window_steps
        self.signals = {
            "seq_len": Signal("seq_len", self.config.length_threshold, window),
            "efficiency": Signal("efficiency", self.config.efficiency_threshold, window),
        }

    def observe(self, observation: Observation) -> list[str]:
        """Record the observation; return the triggers it fires (pool changes included)."""
        values = {"seq_len": length_signal(observation), "efficiency": observation.efficiency}
        fired = []
        if observation.recalibrated:
            self.signals["efficiency"].restart()
            fired.append("recalibrated")
        for name, signal in self.signals.items():
            signal.observe(observation.step, values[name])
            label = signal.crossing(values[name])
            if label:
                fired.append(label)
        if self.last_gpus is not None and observation.gpus != self.last_gpus:
            fired.append(f"gpus {self.last_gpus}->{observation.gpus}")
            self.pool_change_steps.append(observation.step)
        self.last_gpus = observation.gpus
        return fired

    def length_drift(self) -> float:
        """The factor the lengths are drifting towards: one threshold up when they grow, down
        when they shrink, 1.0 when steady."""
        signal = self.signals["seq_len"]
        slope = signal.log_slope()
        return 1.0 if slope == 0 else (1.0 + signal.threshold) ** math.copysign(1.0, slope)

    def reset_references(self, observation: Observation) -> None:
        """After a replan, the current values become the references."""
        self.signals["seq_len"].reference = length_signal(observation)
        self.signals["efficiency"].reference = observation.efficiency

    def horizon(self, observation: Observation, past_lengths: bool = False) -> float:
        """Confidence-adjusted steps until conditions are expected to change again;
        `past_lengths`: ignore the next length crossing (for a move that still pays after it)."""
        estimates = [s.steps_to_cross() for name, s in self.signals.items() if not (past_lengths and name == "seq_len")]
        if len(self.pool_change_steps) >= 2:
            gaps = [b - a for a, b in zip(self.pool_change_steps, self.pool_change_steps[1:], strict=False)]
            estimates.append(sum(gaps) / len(gaps))
        if observation.announced_step is not None:
            estimates.append(observation.announced_step - observation.step)
        expected = min([self.config.max_horizon_steps, *estimates])
        horizon = self.config.horizon_confidence * expected
        if observation.steps_remaining is not None:
            horizon = min(horizon, float(observation.steps_remaining))
        return horizon
