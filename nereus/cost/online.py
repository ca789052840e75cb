"""Online calibration: least squares with exponential forgetting, one RL step at a time.

The runtime controller calls `OnlineCalibrator.update` after every step with what the step
measured; the calibrator returns the efficiencies that best explain the recent steps. It
fits the same parameters as `nereus fit` (inverse efficiencies and fixed overheads) on the
same rows (each model-stage's time and the step's, as fractions of the step's wall time),
linearised around the current estimate. Old steps fade by `forgetting` per step, so a
drift in efficiency (thermal throttling, a noisy neighbour, longer sequences changing the
regime) is tracked within about 1 / (1 - forgetting) steps.

The cost model is piecewise affine in the fitted parameters (times proportional to inverse
efficiencies and overheads, combined by sums and maxima), so a linearisation stays exact
until the estimate crosses a kink. The calibrator keeps the last few (one per sized plan)
and reuses one while the step's prediction at the new estimate still equals the cached
affine form: one cost model evaluation per step instead of one per parameter plus one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from nereus.cost.calibration import Calibration
from nereus.cost.fit import (
    FITTED,
    LOWER,
    STEP_KEY,
    bounded_lstsq,
    linearise,
    measured_plan,
    parameters,
    predict,
    with_parameters,
)
from nereus.spec.base import StrictModel
from nereus.spec.cluster import Cluster
from nereus.spec.plan import Plan


@dataclass(frozen=True)
class OnlineConfig:
    """How fast the estimate moves."""

    forgetting: float = 0.9
    """Weight of the previous step's information relative to this one's, in (0, 1]; 1 never forgets."""
    prior_weight: float = 1e-3
    """Confidence in the starting calibration, as a fraction of one step's information."""

    def __post_init__(self) -> None:
        if not 0 < self.forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be positive, got {self.prior_weight}")


#: Linearisations kept (one per sized plan: the plans a run alternates between, or a size's recurrences).
NUM_LINEARISATIONS_KEPT = 16
#: Relative mismatch between a fresh prediction and the cached affine form past which the
#: cost model is relinearised (far above rounding, far below any kink's effect).
AFFINE_TOLERANCE = 1e-9


@dataclass
class Linearisation:
    """The cost model's affine form around one estimate, for one sized plan."""

    plan: Plan
    """The plan at the sizes a step ran (`measured_plan`)."""
    offsets: dict[str, float]
    """Per predicted key: prediction minus gradient . parameters, at the linearisation point."""
    gradients: dict[str, np.ndarray] = field(repr=False)
    """Per predicted key: derivative in each fitted parameter (order of FITTED)."""

    def holds(self, theta: np.ndarray, predicted: Mapping[str, float]) -> bool:
        """Whether `predicted` (at parameters `theta`, for this plan) lies on this affine form."""
        if predicted.keys() != self.offsets.keys():
            return False
        for key, seconds in predicted.items():
            affine = self.offsets[key] + float(self.gradients[key] @ theta)
            if abs(affine - seconds) > AFFINE_TOLERANCE * max(abs(seconds), abs(affine)) + 1e-15:
                return False
        return True


class LinearisationState(StrictModel):
    """A kept linearisation as data (inside a run checkpoint)."""

    plan: Plan
    """The sized plan it was taken for."""
    offsets: dict[str, float]
    """Per predicted key: prediction minus gradient . parameters."""
    gradients: dict[str, list[float]]
    """Per predicted key: derivative in each fitted parameter (order of FITTED)."""


class CalibratorState(StrictModel):
    """Everything an OnlineCalibrator carries between steps, as data: a resumed run's
    calibrator continues exactly where the saved one stopped."""

    forgetting: float
    """OnlineConfig.forgetting."""
    prior_weight: float
    """OnlineConfig.prior_weight."""
    cluster: Cluster | None
    """The cluster steps are sized on (None: each plan's own)."""
    calibration: Calibration
    """The current estimate."""
    prior: list[float]
    """The starting calibration's fitted parameters."""
    prior_information: list[list[float]]
    """The prior's information matrix (set at the first step)."""
    information: list[list[float]]
    """The normal matrix of the forgetting least squares."""
    vector: list[float]
    """Its right-hand side."""
    num_updates: int
    """Steps folded in."""
    linearisations: list[LinearisationState]
    """Kept affine forms, most recent last."""
    num_linearisations: int
    """Linearisations computed so far."""


def _matrix(rows: list[list[float]], size: int, name: str) -> np.ndarray:
    matrix = np.array(rows, dtype=float).reshape(-1, size) if rows else np.zeros((0, size))
    if matrix.shape != (size, size):
        raise ValueError(f"{name}: must be a {size}x{size} matrix, got shape {matrix.shape}")
    return matrix


def _vector(values: list[float], size: int, name: str) -> np.ndarray:
    if len(values) != size:
        raise ValueError(f"{name}: must hold {size} numbers (one per fitted parameter), got {len(values)}")
    return np.array(values, dtype=float)


class OnlineCalibrator:
    """Exponentially weighted least squares over the cost model's fitted parameters.

    Kept in information form (normal matrix and vector). Forgetting shrinks the old
    information towards the prior's instead of towards zero, so directions no step excites
    (an inter-node link on one node) keep their prior value rather than winding up.
    """

    def __init__(self, start: Calibration, config: OnlineConfig | None = None, cluster: Cluster | None = None) -> None:
        self.config = config or OnlineConfig()
        self.cluster = cluster
        self.calibration = start
        self.prior = parameters(start)
        # Set at the first step, from how strongly that step's predictions depend on each parameter.
        self.prior_information = np.zeros((len(FITTED), len(FITTED)))
        self.information = self.prior_information.copy()
        self.vector = np.zeros(len(FITTED))
        self.lower = np.array([LOWER[name] for name in FITTED])
        self.num_updates = 0
        self.linearisations: list[Linearisation] = []  # most recent last
        self.num_linearisations = 0

    def update(
        self,
        plan: Plan,
        step_seconds: float,
        stage_seconds: Mapping[str, float],
        prompt_len: int,
        response_len_max: int,
        predicted: Mapping[str, float] | None = None,
        engineless: Collection[str] | None = None,
    ) -> Calibration:
        """Fold one step's measurements in; returns the updated calibration.

        `stage_seconds` maps model-stage names (and `weight_sync`) to seconds, as a step's
        metrics report them; names the plan does not price are ignored. `predicted`: the cost
        model's full prediction of this step at the current calibration, if the caller has
        it (saves an evaluation). `engineless`: for a step of nereus's runtime, the model-stages
        that ran no engine (see `measured_plan`); None: another trainer's step.
        """
        if step_seconds <= 0:
            raise ValueError(f"step_seconds must be positive, got {step_seconds}")
        sized = measured_plan(plan, prompt_len, response_len_max, self.cluster, engineless)
        theta_now = parameters(self.calibration)
        base, gradients = self._linearised(sized, theta_now, predicted)
        rows = [(key, seconds) for key, seconds in stage_seconds.items() if key in base and key != STEP_KEY]
        rows.append((STEP_KEY, step_seconds))
        if self.num_updates == 0:
            self._set_prior([gradients[key] / step_seconds for key, _ in rows])
        keep = self.config.forgetting
        self.information = keep * self.information + (1 - keep) * self.prior_information
        self.vector = keep * self.vector + (1 - keep) * self.prior_information @ self.prior
        for key, seconds in rows:
            x = gradients[key] / step_seconds
            # Linearised at theta_now: measured = predicted(theta_now) + x . (theta - theta_now).
            target = (seconds - base[key]) / step_seconds + x @ theta_now
            self.information += np.outer(x, x)
            self.vector += x * target
        # The bounded minimiser of theta' R theta - 2 b' theta, as least squares through R = L L'.
        factor = np.linalg.cholesky(self.information)
        target = np.linalg.solve(factor, self.vector)
        free = np.ones(len(FITTED), dtype=bool)
        theta = bounded_lstsq(factor.T, target, self.lower, free)
        self.calibration = with_parameters(self.calibration, theta)
        self.num_updates += 1
        return self.calibration

    def _linearised(
        self, sized: Plan, theta: np.ndarray, predicted: Mapping[str, float] | None
    ) -> tuple[Mapping[str, float], dict[str, np.ndarray]]:
        """Predictions and gradients at the current estimate: the cached affine form's while
        the fresh prediction still lies on it, else a new finite-difference linearisation."""
        base = dict(predicted) if predicted is not None else predict(sized, self.calibration)
        for cached in self.linearisations:
            if cached.plan == sized:
                if cached.holds(theta, base):
                    return base, cached.gradients
                self.linearisations.remove(cached)
                break
        base, gradients = linearise(sized, self.calibration, base)
        offsets = {key: seconds - float(gradients[key] @ theta) for key, seconds in base.items()}
        kept = self.linearisations[-(NUM_LINEARISATIONS_KEPT - 1) :]
        self.linearisations = [*kept, Linearisation(sized, offsets, gradients)]
        self.num_linearisations += 1
        return base, gradients

    def _set_prior(self, rows: list[np.ndarray]) -> None:
        """Prior information: `prior_weight` times one step's, per parameter (a tiny floor
        keeps parameters no prediction depends on at their starting value)."""
        strength = self.config.prior_weight * np.sum(np.square(rows), axis=0)
        self.prior_information = np.diag(np.maximum(strength, 1e-12 * max(float(strength.max()), 1.0)))
        self.information = self.prior_information.copy()
        self.vector = self.prior_information @ self.prior

    def state(self) -> CalibratorState:
        """The calibrator as data (`from_state` rebuilds it)."""
        kept = [
            LinearisationState(
                plan=cached.plan,
                offsets=dict(cached.offsets),
                gradients={key: [float(x) for x in row] for key, row in cached.gradients.items()},
            )
            for cached in self.linearisations
        ]
        return CalibratorState(
            forgetting=self.config.forgetting,
            prior_weight=self.config.prior_weight,
            cluster=self.cluster,
            calibration=self.calibration,
            prior=[float(x) for x in self.prior],
            prior_information=self.prior_information.tolist(),
            information=self.information.tolist(),
            vector=self.vector.tolist(),
            num_updates=self.num_updates,
            linearisations=kept,
            num_linearisations=self.num_linearisations,
        )

    @classmethod
    def from_state(cls, state: CalibratorState) -> OnlineCalibrator:
        """The calibrator `state` describes; ValueError when its arrays do not fit the fitted parameters."""
        size = len(FITTED)
        calibrator = cls(state.calibration, OnlineConfig(state.forgetting, state.prior_weight), state.cluster)
        calibrator.prior = _vector(state.prior, size, "prior")
        calibrator.prior_information = _matrix(state.prior_information, size, "prior_information")
        calibrator.information = _matrix(state.information, size, "information")
        calibrator.vector = _vector(state.vector, size, "vector")
        if state.num_updates < 0 or state.num_linearisations < 0:
            raise ValueError("num_updates and num_linearisations must be >= 0")
        calibrator.num_updates = state.num_updates
        calibrator.num_linearisations = state.num_linearisations
        calibrator.linearisations = [
            Linearisation(
                kept.plan,
                dict(kept.offsets),
                {key: _vector(row, size, f"linearisations.gradients.{key}") for key, row in kept.gradients.items()},
            )
            for kept in state.linearisations
        ]
        return calibrator
