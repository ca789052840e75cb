"""A policy's state between decisions as data (inside a run checkpoint): the monitor's
references and histories, the plan it believes in force, its replanner's calibration and
its decision log. Caches are not kept: they refill with the same values."""

from __future__ import annotations

from collections import deque
from typing import Any

from nereus.cost.calibration import Calibration
from nereus.solver.policy.log import record_from_data, record_to_data
from nereus.solver.policy.policies import AdaptationPolicy
from nereus.spec.base import StrictModel
from nereus.spec.plan import Plan


class SignalState(StrictModel):
    """One monitored signal."""

    reference: float | None
    """Its value at the last replan (None: the next value becomes it)."""
    history: list[tuple[int, float]]
    """(step, log value) of the recent observations, oldest first."""


class PolicyState(StrictModel):
    """What an AdaptationPolicy carries from one decision to the next."""

    plan: Plan | None
    """The plan the policy believes in force (None: suspended)."""
    signals: dict[str, SignalState]
    """The monitor's signals by name."""
    pool_change_steps: list[int]
    """Steps at which the GPU pool changed."""
    last_gpus: int | None
    """The pool size last observed."""
    base: Plan
    """The replanner's base plan (models, workload, cluster)."""
    calibration: Calibration
    """The calibration the replanner plans with."""
    num_searches: int
    """Plan searches the replanner ran."""
    log: list[dict[str, Any]]
    """The decision log, as `record_to_data` writes each entry."""


def policy_state(policy: AdaptationPolicy) -> PolicyState:
    """`policy` as data (`restore_policy` puts it back into a freshly made policy)."""
    monitor, replanner = policy.monitor, policy.replanner
    return PolicyState(
        plan=policy.plan,
        signals={
            name: SignalState(reference=signal.reference, history=list(signal.history))
            for name, signal in monitor.signals.items()
        },
        pool_change_steps=list(monitor.pool_change_steps),
        last_gpus=monitor.last_gpus,
        base=replanner.base,
        calibration=replanner.calibration,
        num_searches=replanner.num_searches,
        log=[record_to_data(record) for record in policy.log],
    )


def restore_policy(policy: AdaptationPolicy, state: PolicyState) -> None:
    """Put `state` into `policy` (made by make_policy with the same name); ValueError when it does not fit."""
    monitor, replanner = policy.monitor, policy.replanner
    if set(state.signals) != set(monitor.signals):
        raise ValueError(f"signals: expected {sorted(monitor.signals)}, got {sorted(state.signals)}")
    for name, saved in state.signals.items():
        signal = monitor.signals[name]
        signal.reference = saved.reference
        signal.history = deque(saved.history)
    monitor.pool_change_steps = list(state.pool_change_steps)
    monitor.last_gpus = state.last_gpus
    policy.plan = state.plan
    replanner.base = state.base
    replanner.recalibrate(state.calibration)
    replanner.num_searches = state.num_searches
    try:
        policy.log = [record_from_data(entry) for entry in state.log]
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"log: an entry is not a decision record ({error})") from None
