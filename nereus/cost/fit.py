"""Fitting the cost model's efficiencies to measured step timings (`nereus fit`).

The cost model is linear in the inverse efficiencies (seconds = work / (peak x efficiency))
and in its fixed overheads, except where it takes a maximum (decode is compute- or
memory-bound) or overlaps pools. So the fit is Gauss-Newton on that piecewise-linear
model: linearise every prediction in the fitted parameters by finite differences, solve a
bounded least-squares problem (efficiencies at most 1, overheads at least 0), and
linearise again at the solution. Residuals are measured as fractions of the step's wall
time, so a model-stage weighs as much as it costs.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nereus.cost.calibration import Calibration
from nereus.cost.kv_pool import engine_budget
from nereus.cost.plan_cost import evaluate_plan
from nereus.cost.vllm_engine import fit_engine_phases, phase_times, weight_bytes_per_gpu
from nereus.spec.cluster import Cluster
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig, RunConfig
from nereus.spec.run_folder import CONFIG_NAME, METRICS_NAME, PLAN_NAME, json_lines
from nereus.spec.stages import ACTOR_GENERATION, STAGES
from nereus.spec.workload import ResponseLengths

#: The first steps of every run pay for allocation and lazy initialisation; the fit drops them.
WARMUP_STEPS = 2
#: Calibration fields the fit estimates. Efficiencies are fitted as their inverse.
EFFICIENCIES = ("gemm", "decode_gemm", "attention", "decode_memory", "collective_intra", "collective_inter")
SCALARS = (
    "launch_overhead_s",
    "micro_batch_overhead_s",
    "link_latency_scale",
    "stage_overhead_s",
    "decode_token_overhead_s",
    "step_overhead_s",
)
FITTED = EFFICIENCIES + SCALARS
#: Lower bound of every fitted parameter (inverse efficiency >= 1: at most 100% of peak).
LOWER = {**{name: 1.0 for name in EFFICIENCIES}, **{name: 0.0 for name in SCALARS}, "link_latency_scale": 1e-3}
#: Scale of a parameter for finite differences and for the pull towards the prior.
TYPICAL = {**{name: 1.0 for name in EFFICIENCIES}, "link_latency_scale": 1.0}
TYPICAL_SECONDS = 1e-4
#: Pull towards the starting calibration on every parameter, relative to the parameter's whole
#: sensitivity: only for numerical stability. A stronger pull on all of them (1e-4 once) acts
#: on the small independent part of nearly collinear effects and biased attention and
#: decode_memory by 10-20%; the identifiability check decides what the prior may settle.
STABILITY_PULL = 1e-10
GAUSS_NEWTON_ITERATIONS = 12
#: Largest gap (fraction of a step) between the model and its linearisation taken as none.
LINEAR_TOLERANCE = 1e-9
#: Relative decrease of the squared residual below which a fit stops.
COST_TOLERANCE = 1e-3
#: A parameter whose standard error (relative to max(|value|, TYPICAL)) exceeds this is not
#: identified by the runs: two standard errors are then more than 5%.
IDENTIFIED_REL_ERROR = 0.025
#: Width of the prior an unidentified parameter is pulled towards, relative to max(|start|,
#: TYPICAL): wide, so that a wrong prior barely moves the identified parameters it correlates with.
PRIOR_SD = 1.0
#: Least residual per row (fraction of the step's time) the standard errors assume: a fit
#: to synthetic or very regular runs leaves almost none, and a zero residual would call every
#: parameter known. No real run repeats its stage times closer than 0.1% of its step.
NOISE_FLOOR = 0.001
STEP_KEY = "step"
REQUIRED_METRICS = ("step", "step_seconds", "stage_seconds", "prompt_len", "response_len_max")


# ---- measured runs ----


@dataclass(frozen=True)
class StepSample:
    """One RL step's measured sizes and wall times."""

    step: int
    prompt_len: int
    response_len_max: int
    step_seconds: float
    stage_seconds: dict[str, float]


@dataclass(frozen=True)
class RunRecord:
    """One `nereus run` directory: its plan and its post-warm-up steps."""

    source: str
    plan: Plan
    steps: tuple[StepSample, ...]
    engineless: tuple[str, ...] | None = None
    """A `nereus run`'s model-stages that ran no engine (a rule-scored reward: it held no
    memory); None: another trainer's run (its generation engine is not nereus's)."""
    engine_phases: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Seconds of the vLLM engine's phases the run recorded (`nereus.cost.vllm_engine.ENGINE_PHASES`),
    over every step, warm-up included (an engine starts once, at the first step or at a transition)."""

    @property
    def plan_key(self) -> str:
        """Identity of the plan's placement (pools and layouts), whatever the workload size."""
        layout = [p.model_dump() for p in self.plan.pools] + [s.model_dump() for s in self.plan.stages]
        return json.dumps(layout, sort_keys=True)


def _sample(data: Any, where: str) -> StepSample:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object per line")
    missing = [key for key in REQUIRED_METRICS if key not in data]
    if missing:
        raise ValueError(f"{where}: missing key {missing[0]!r}; metrics must come from `nereus run`")
    stages = data["stage_seconds"]
    if not isinstance(stages, dict) or not all(isinstance(v, (int, float)) for v in stages.values()):
        raise ValueError(f"{where}: stage_seconds must map model-stage names to seconds")
    try:
        return StepSample(
            int(data["step"]),
            int(data["prompt_len"]),
            int(data["response_len_max"]),
            float(data["step_seconds"]),
            {str(k): float(v) for k, v in stages.items()},
        )
    except (TypeError, ValueError):
        raise ValueError(f"{where}: step, prompt_len, response_len_max and step_seconds must be numbers") from None


def read_run(run_dir: Path, warmup_steps: int = WARMUP_STEPS) -> RunRecord:
    """A run directory's plan and its steps after `warmup_steps`, with one-line errors."""
    from nereus.spec.io import load_document

    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory; give the output folder of a `nereus run`")
    plan = load_document(run_dir / PLAN_NAME)
    if not isinstance(plan, Plan):
        raise ValueError(f"{run_dir / PLAN_NAME}: kind: expected Plan, got {type(plan).__name__}")
    metrics = run_dir / METRICS_NAME
    if not metrics.is_file():
        raise ValueError(f"{metrics}: no such file; is {run_dir} a `nereus run` output folder?")
    samples = [_sample(data, where) for where, data in json_lines(metrics)]
    kept = tuple(s for s in samples if s.step >= warmup_steps)
    if not kept:
        raise ValueError(
            f"{metrics}: {len(samples)} steps, none after the {warmup_steps} warm-up steps; run more steps"
        )
    phases = phase_times([s.stage_seconds for s in samples])
    return RunRecord(str(run_dir), plan, kept, _engineless(run_dir, plan), phases)


def _engineless(run_dir: Path, plan: Plan) -> tuple[str, ...]:
    """The run's engine-less model-stages, from its config (a folder without one: none)."""
    from nereus.spec.io import load_document

    if not (run_dir / CONFIG_NAME).is_file():
        return ()
    config = load_document(run_dir / CONFIG_NAME)
    if not isinstance(config, RunConfig):
        raise ValueError(f"{run_dir / CONFIG_NAME}: kind: expected RunConfig, got {type(config).__name__}")
    return engineless_stages(plan, config.rl)


def measured_plan(
    plan: Plan,
    prompt_len: int,
    response_len_max: int,
    cluster: Cluster | None = None,
    engineless: Collection[str] | None = None,
) -> Plan:
    """The plan priced at the sizes a step ran: padded prompts and every row as long as the
    longest response (the runtime pads rows to it and decodes until it ends). For a step of
    nereus's runtime (`engineless` given: the model-stages that ran no engine, so held no
    memory), generation is priced in the KV pool its engine had (`with_engine_budget`); for
    another trainer's (None), as planned. `cluster` (a profile's) replaces the plan's for the
    pricing; the pool stays the one the run's plan gave the engine."""
    longest = max(1, response_len_max)
    lengths = ResponseLengths(median=longest, p99=longest, max=longest)
    workload = plan.workload.model_copy(update={"prompt_len": max(1, prompt_len), "response_len": lengths})
    sized = plan.model_copy(update={"workload": workload, "predictions": None})
    if engineless is not None:
        sized = with_engine_budget(sized, engineless)
    if cluster is None:
        return sized
    if cluster.num_gpus < plan.cluster.num_gpus:
        raise ValueError(
            f"the profile has {cluster.num_gpus} GPUs but the run's plan uses {plan.cluster.num_gpus}; "
            "profile with more ranks"
        )
    return sized.model_copy(update={"cluster": cluster})


def with_engine_budget(plan: Plan, engineless: Collection[str] = ()) -> Plan:
    """The plan with actor/generation's KV budget set to the pool the engine runs it in, when
    that pool cannot hold the batch (`nereus.cost.kv_pool.engine_budget`): its generation is
    then priced in the waves the engine runs (first-come admission, newest-first preemption)
    rather than unbounded."""
    budget = engine_budget(plan, engineless)
    if budget is None:
        return plan
    stages = [
        entry.model_copy(update={"kv_budget_bytes": budget}) if entry.model_stage == ACTOR_GENERATION else entry
        for entry in plan.stages
    ]
    return plan.model_copy(update={"stages": stages})


def engineless_stages(plan: Plan, config: RLConfig) -> tuple[str, ...]:
    """Model-stages of `plan` that run no engine under `config` (a rule-scored reward)."""
    return tuple(entry.model_stage for entry in plan.stages if not config.runs_engine(entry.role))


# ---- the linearised model ----


def parameters(calibration: Calibration) -> np.ndarray:
    """The fitted parameter vector of a calibration (inverse efficiencies, then scalars)."""
    values = [1.0 / _efficiency(calibration, name) for name in EFFICIENCIES]
    return np.array(values + [float(getattr(calibration, name)) for name in SCALARS])


def _efficiency(calibration: Calibration, name: str) -> float:
    if name == "decode_gemm" and calibration.decode_gemm is None:
        return calibration.gemm  # unset: decode GEMMs run as efficiently as the others
    value: float = getattr(calibration, name)
    return value


def with_parameters(calibration: Calibration, theta: np.ndarray) -> Calibration:
    """`calibration` with the fitted fields set from `theta` (clipped to their bounds)."""
    update: dict[str, Any] = {}
    for name, value in zip(FITTED, theta, strict=True):
        value = max(float(value), LOWER[name])
        update[name] = min(1.0, 1.0 / value) if name in EFFICIENCIES else value
    return Calibration.model_validate({**calibration.model_dump(), **update})


def predict(plan: Plan, calibration: Calibration) -> dict[str, float]:
    """Seconds per model-stage, `weight_sync`, and the whole `step`, as the runtime reports them."""
    predictions = evaluate_plan(plan, calibration).predictions
    out = {name: p.time_s for name, p in predictions.model_stages.items()}
    out["weight_sync"] = predictions.step_breakdown_s.get("weight_sync", 0.0)
    # Whole phases, for trainers that time a phase rather than each model-stage (OpenRLHF).
    out.update({f"phase/{stage}": predictions.step_breakdown_s.get(stage, 0.0) for stage in STAGES})
    out[STEP_KEY] = predictions.step_time_s
    return out


def _step_size(name: str, value: float) -> float:
    return 1e-3 * max(abs(value), TYPICAL.get(name, TYPICAL_SECONDS))


def linearise(
    plan: Plan, calibration: Calibration, base: dict[str, float] | None = None
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Predictions at `calibration` and their gradients in the fitted parameters (`base`:
    the predictions at `calibration`, when the caller has them already)."""
    theta = parameters(calibration)
    if base is None:
        base = predict(plan, calibration)
    gradients = {key: np.zeros(len(FITTED)) for key in base}
    for k, name in enumerate(FITTED):
        h = _step_size(name, theta[k])
        moved = theta.copy()
        moved[k] += h
        shifted = predict(plan, _unchecked(calibration, moved))
        for key in base:
            gradients[key][k] = (shifted[key] - base[key]) / h
    return base, gradients


def _unchecked(calibration: Calibration, theta: np.ndarray) -> Calibration:
    """Like `with_parameters` without validation: finite differences may step past 100%."""
    update = {name: (1.0 / v if name in EFFICIENCIES else float(v)) for name, v in zip(FITTED, theta, strict=True)}
    return calibration.model_copy(update=update)


# ---- least squares ----


@dataclass(frozen=True)
class Row:
    """One measured time and where its prediction comes from."""

    group: int
    """Index of the (plan, sizes) point in the linearisation cache."""
    key: str
    """Model-stage name, `weight_sync`, or `step`."""
    seconds: float
    scale: float
    """Seconds the residual is divided by (the step's wall time)."""


def bounded_lstsq(design: np.ndarray, target: np.ndarray, lower: np.ndarray, free: np.ndarray) -> np.ndarray:
    """min |design x - target| with x >= lower; parameters not `free` stay at `lower`.

    Lawson-Hanson active-set NNLS on x - lower, with columns scaled to unit norm.
    """
    x = lower.copy()
    columns = design[:, free]
    norms = np.linalg.norm(columns, axis=0)
    norms[norms == 0] = 1.0
    a = columns / norms
    b = target - design @ lower
    z = _nnls(a, b)
    x[free] = lower[free] + z / norms
    return x


def _nnls(a: np.ndarray, b: np.ndarray, tolerance: float = 1e-12) -> np.ndarray:
    """Lawson-Hanson non-negative least squares: min |a z - b| with z >= 0."""
    n = a.shape[1]
    z = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 3):
        gradient = a.T @ (b - a @ z)
        candidates = ~passive & (gradient > tolerance)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, gradient, -np.inf)))] = True
        for _ in range(3 * n + 3):
            trial = np.zeros(n)
            trial[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (trial[passive] > 0).all():
                z = trial
                break
            # Step towards the trial until a passive coordinate hits zero; that one leaves.
            blocking = passive & (trial <= 0)
            step = np.min(z[blocking] / np.maximum(z[blocking] - trial[blocking], 1e-300))
            z = z + step * (trial - z)
            passive &= z > tolerance
            z[~passive] = 0.0
    return z


def _exercised(gradients: list[dict[str, np.ndarray]]) -> np.ndarray:
    """Parameters some prediction depends on (the others keep their prior value)."""
    total = np.zeros(len(FITTED))
    for grads in gradients:
        for g in grads.values():
            total += np.abs(g)
    return total > 0


@dataclass(frozen=True)
class GaussNewtonFit:
    """A converged fit and its last linearisation."""

    theta: np.ndarray
    exercised: np.ndarray
    """Parameters some prediction depends on (the others keep their starting value)."""
    design: np.ndarray
    """d(residual)/d(parameter) per row at `theta` (rows scaled by their step time)."""
    residual: np.ndarray

    @property
    def sigma(self) -> float:
        """Residual noise per row (at least NOISE_FLOOR)."""
        rows = len(self.residual)
        dof = max(rows - int(self.exercised.sum()), 1)
        return max(float(np.linalg.norm(self.residual)) / math.sqrt(dof), NOISE_FLOOR)


def _scale(theta: np.ndarray) -> np.ndarray:
    typical = np.array([TYPICAL.get(name, TYPICAL_SECONDS) for name in FITTED])
    return np.maximum(np.abs(theta), typical)


def gauss_newton(
    plans: Sequence[Plan],
    rows: Sequence[Row],
    start: Calibration,
    progress: Callable[[int, int], None] | None = None,
    prior_weight: np.ndarray | None = None,
    at: GaussNewtonFit | None = None,
) -> GaussNewtonFit:
    """Fit the parameters to `rows`, from the linearisation `at` (else at `start`);
    `prior_weight` (residual units per unit of a parameter) pulls parameters towards their
    value in `start`, the others only get STABILITY_PULL."""
    theta0 = parameters(start)
    pull = np.zeros(len(FITTED)) if prior_weight is None else prior_weight

    def cost(theta: np.ndarray, residual: np.ndarray) -> float:
        return float(residual @ residual + np.sum((pull * (theta - theta0)) ** 2))

    current = at if at is not None else _linearised(plans, rows, start, theta0, None)
    for iteration in range(GAUSS_NEWTON_ITERATIONS):
        if progress is not None:
            progress(iteration + 1, GAUSS_NEWTON_ITERATIONS)
        theta = target = _step(current, theta0, pull)
        base = _predictions(plans, start, theta)
        # A step that crosses a kink of the piecewise-linear model (decode turning memory-
        # bound) may overshoot: go back halfway until it improves, rather than cycle.
        while cost(theta, _residual(rows, base)) > cost(current.theta, current.residual):
            if np.allclose(theta, current.theta, rtol=1e-6, atol=1e-12):
                return current
            theta = (theta + current.theta) / 2
            base = _predictions(plans, start, theta)
        residual = _residual(rows, base)
        linear = current.residual - current.design @ (theta - current.theta)
        if theta is target and np.allclose(residual, linear, rtol=0, atol=LINEAR_TOLERANCE):
            # Same linear piece as `current`: its solution is the solution.
            return GaussNewtonFit(theta, current.exercised, current.design, residual)
        if cost(theta, residual) > (1 - COST_TOLERANCE) * cost(current.theta, current.residual):
            return current  # creeping along a kink: what is left is below the noise
        current = _linearised(plans, rows, start, theta, base)
    return current


def _predictions(plans: Sequence[Plan], start: Calibration, theta: np.ndarray) -> list[dict[str, float]]:
    calibration = _unchecked(start, theta)
    return [predict(plan, calibration) for plan in plans]


def _residual(rows: Sequence[Row], base: list[dict[str, float]]) -> np.ndarray:
    return np.array([(r.seconds - base[r.group][r.key]) / r.scale for r in rows])


def _linearised(
    plans: Sequence[Plan],
    rows: Sequence[Row],
    start: Calibration,
    theta: np.ndarray,
    base: list[dict[str, float]] | None,
) -> GaussNewtonFit:
    """The rows' residuals and their gradients at `theta` (`base`: its predictions, if known)."""
    calibration = _unchecked(start, theta)
    known = base if base is not None else [None] * len(plans)
    points = [linearise(plan, calibration, b) for plan, b in zip(plans, known, strict=True)]
    design = np.array([points[r.group][1][r.key] / r.scale for r in rows])
    residual = _residual(rows, [values for values, _ in points])
    return GaussNewtonFit(theta, _exercised([grads for _, grads in points]), design, residual)


def _step(at: GaussNewtonFit, theta0: np.ndarray, prior_weight: np.ndarray) -> np.ndarray:
    """The bounded least-squares solution of the linearisation `at`, with the pull rows."""
    lower = np.array([LOWER[name] for name in FITTED])
    # The pull rows: a parameter's prior as extra residual rows (weight x (theta - start)).
    stability = math.sqrt(STABILITY_PULL) * np.maximum(np.linalg.norm(at.design, axis=0), 1e-12)
    weight = np.maximum(stability, prior_weight)
    design = np.vstack([at.design, np.diag(weight)])
    target = np.concatenate([at.residual + at.design @ at.theta, weight * theta0])
    updated = bounded_lstsq(design, target, np.where(at.exercised, lower, theta0), at.exercised)
    updated[~at.exercised] = theta0[~at.exercised]
    return updated


def relative_standard_errors(fit: GaussNewtonFit) -> np.ndarray:
    """Each exercised parameter's standard error from the rows alone, relative to
    max(|value|, TYPICAL); NaN for parameters nothing depends on.

    The standard error is the residual noise over the part of the parameter's effect that no
    combination of the other free parameters reproduces (its column's distance from their
    span): collinear effects, however large, leave that part small. Parameters held at a
    bound by the fit do not count among the others (the bound, not the data, fixes them).
    """
    lower = np.array([LOWER[name] for name in FITTED])
    inside = fit.exercised & (fit.theta > lower + 1e-9 * _scale(lower))
    scaled = fit.design * _scale(fit.theta)  # d(residual) / d(relative change)
    out = np.full(len(FITTED), math.nan)
    for k in np.flatnonzero(fit.exercised):
        others = scaled[:, inside & (np.arange(len(FITTED)) != k)]
        column = scaled[:, k]
        if others.shape[1]:
            column = column - others @ np.linalg.lstsq(others, column, rcond=None)[0]
        independent = float(np.linalg.norm(column))
        out[k] = fit.sigma / independent if independent > 0 else math.inf
    return out


# ---- fitting runs, and held-out error ----


@dataclass
class Observations:
    """Runs turned into least-squares rows over distinct (plan, sizes) points."""

    plans: list[Plan] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def add(self, run: RunRecord, cluster: Cluster | None) -> None:
        """One row per time the run reports at each of its sizes: the median over its steps of
        that size (robust to a step slowed by another process)."""
        by_size: dict[tuple[int, int], list[StepSample]] = {}
        for sample in run.steps:
            by_size.setdefault((sample.prompt_len, sample.response_len_max), []).append(sample)
        known = {entry.model_stage for entry in run.plan.stages} | {"weight_sync", STEP_KEY}
        known |= {f"phase/{stage}" for stage in STAGES}
        for (prompt_len, response_len_max), samples in by_size.items():
            group = len(self.plans)
            self.plans.append(measured_plan(run.plan, prompt_len, response_len_max, cluster, run.engineless))
            step = statistics.median(s.step_seconds for s in samples)
            times = {STEP_KEY: [s.step_seconds for s in samples]}
            for sample in samples:
                for key, seconds in sample.stage_seconds.items():
                    times.setdefault(key, []).append(seconds)
            for key, values in times.items():
                if key in known:
                    self.rows.append(Row(group, key, statistics.median(values), max(step, 1e-9)))


def observations(runs: Sequence[RunRecord], cluster: Cluster | None) -> Observations:
    out = Observations()
    for run in runs:
        out.add(run, cluster)
    return out


@dataclass(frozen=True)
class FitResult:
    """A fitted calibration and what the runs did and did not determine."""

    calibration: Calibration
    fitted: list[str]
    """Fields some prediction depends on: the fit estimated them from the runs."""
    relative_error: dict[str, float]
    """Standard error of each fitted field's parameter (inverse efficiency, or overhead)
    relative to its value, from the runs alone."""

    @property
    def identified(self) -> list[str]:
        """Fitted fields the runs determine (relative standard error at most IDENTIFIED_REL_ERROR)."""
        return [name for name in self.fitted if self.relative_error[name] <= IDENTIFIED_REL_ERROR]

    @property
    def not_identified(self) -> list[str]:
        """Fitted fields the runs cannot separate from the others: their value leans on the
        starting calibration (pulled towards it with a prior of width PRIOR_SD)."""
        return [name for name in self.fitted if name not in self.identified]


def fit_calibration(
    runs: Sequence[RunRecord],
    start: Calibration,
    cluster: Cluster | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> FitResult:
    """The calibration that best explains `runs`: a fit free of the prior tells which
    parameters the runs identify, then a refit pulls only the others towards `start`.

    Pools of a phase are priced as the runtime runs them, at the same time: a fit cannot
    learn that from runs (few plans split their pools) and must not trade it for a better
    in-sample error.
    """
    data = observations(runs, cluster)
    fit = gauss_newton(data.plans, data.rows, start, progress)
    errors = relative_standard_errors(fit)
    unknown = fit.exercised & ~(errors <= IDENTIFIED_REL_ERROR)
    if unknown.any():
        # A Gaussian prior of width PRIOR_SD on the unidentified parameters, in residual units.
        prior = np.where(unknown, fit.sigma / (PRIOR_SD * _scale(parameters(start))), 0.0)
        fit = gauss_newton(data.plans, data.rows, start, progress, prior, at=fit)
    fitted = [name for name, used in zip(FITTED, fit.exercised, strict=True) if used]
    calibration = with_parameters(start, fit.theta)
    # Fields nothing depends on stay exactly as given (decode_gemm None included).
    kept = {name: getattr(start, name) for name in FITTED if name not in fitted}
    calibration = calibration.model_copy(update=kept)
    relative = {name: float(e) for name, e in zip(FITTED, errors, strict=True) if name in fitted}
    # The vLLM engine's phases are measured directly (no other term explains them): their medians.
    engine = fit_engine_phases([(_engine_weight_bytes(run, start), run.engine_phases) for run in runs])
    calibration = calibration.model_copy(update=engine.values)
    return FitResult(calibration, fitted + list(engine.values), {**relative, **engine.relative_error})


def _engine_weight_bytes(run: RunRecord, calibration: Calibration) -> float:
    """Bytes one GPU of the run's actor/generation replicas loads into its engine."""
    entry = next((e for e in run.plan.stages if e.model_stage == ACTOR_GENERATION), None)
    return 0.0 if entry is None else weight_bytes_per_gpu(run.plan, calibration, entry.tp, entry.pp)


def fit_runs(
    runs: Sequence[RunRecord],
    start: Calibration,
    cluster: Cluster | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Calibration, list[str]]:
    """`fit_calibration`'s calibration and the names of the fields it fitted."""
    result = fit_calibration(runs, start, cluster, progress)
    return result.calibration, result.fitted


@dataclass(frozen=True)
class RunError:
    """Measured and predicted medians of one run (post-warm-up steps)."""

    source: str
    plan_key: str
    measured: dict[str, float]
    predicted: dict[str, float]

    def error(self, key: str) -> float:
        """Relative error of `key` (predicted / measured - 1)."""
        return self.predicted[key] / self.measured[key] - 1.0


@dataclass
class ErrorReport:
    """Errors of predictions against measurements, per run and summarised."""

    runs: list[RunError]

    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for run in self.runs:
            seen.update(dict.fromkeys(k for k in run.measured if k != STEP_KEY and run.measured[k] > 0))
        return list(seen)

    def mape(self, key: str) -> float:
        errors = [abs(r.error(key)) for r in self.runs if r.measured.get(key, 0) > 0 and key in r.predicted]
        return statistics.fmean(errors) if errors else math.nan

    @property
    def step_mape(self) -> float:
        return self.mape(STEP_KEY)

    @property
    def step_max(self) -> float:
        return max((abs(r.error(STEP_KEY)) for r in self.runs), default=math.nan)

    def summary(self) -> dict[str, Any]:
        return {
            "step_mape": self.step_mape,
            "step_max_ape": self.step_max,
            "model_stage_mape": {key: self.mape(key) for key in self.keys()},
            "runs": [
                {
                    "run": r.source,
                    "measured_step_s": r.measured[STEP_KEY],
                    "predicted_step_s": r.predicted[STEP_KEY],
                    "error": r.error(STEP_KEY),
                }
                for r in self.runs
            ],
        }


def run_errors(runs: Sequence[RunRecord], calibration: Calibration, cluster: Cluster | None = None) -> ErrorReport:
    """Median measured vs median predicted times of every run, under `calibration`."""
    out = []
    for run in runs:
        measured: dict[str, list[float]] = {}
        predicted: dict[str, list[float]] = {}
        cache: dict[tuple[int, int], dict[str, float]] = {}
        for sample in run.steps:
            sizes = (sample.prompt_len, sample.response_len_max)
            if sizes not in cache:
                cache[sizes] = predict(measured_plan(run.plan, *sizes, cluster, run.engineless), calibration)
            for key, seconds in [*sample.stage_seconds.items(), (STEP_KEY, sample.step_seconds)]:
                if key in cache[sizes]:
                    measured.setdefault(key, []).append(seconds)
                    predicted.setdefault(key, []).append(cache[sizes][key])
        out.append(
            RunError(
                run.source,
                run.plan_key,
                {k: statistics.median(v) for k, v in measured.items()},
                {k: statistics.median(v) for k, v in predicted.items()},
            )
        )
    return ErrorReport(out)


def held_out_errors(
    runs: Sequence[RunRecord], start: Calibration, cluster: Cluster | None = None
) -> ErrorReport | None:
    """Leave-one-plan-out: each plan's runs predicted by a fit on the other plans' runs.

    None when the runs cover fewer than two plans (nothing to hold out).
    """
    keys = list(dict.fromkeys(run.plan_key for run in runs))
    if len(keys) < 2:
        return None
    out: list[RunError] = []
    for key in keys:
        train = [run for run in runs if run.plan_key != key]
        test = [run for run in runs if run.plan_key == key]
        calibration, _ = fit_runs(train, start, cluster)
        out.extend(run_errors(test, calibration, cluster).runs)
    return ErrorReport(out)
