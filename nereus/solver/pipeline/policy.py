"""The fused search's tuning knobs, as one documented value (`SearchPolicy`).

`SearchConfig` (search.py) says how long and how widely a search looks; `SearchPolicy`
says how it spends that: the shares of the time limit each part gets, the annealing's
temperatures, weights and move mix, and the activation caps the starts and seeds try. The
default instance is what every caller gets; the measurements behind each default are in
docs/schedule-memory.md ("The search's knobs").

Units: a *share* is a fraction of a stated budget (seconds and, with `max_iterations`,
iterations); a *factor* multiplies the memory bound (`bounds.memory_bound`, the serial 1F1B
reference); *slack* and *step* are relative makespan differences.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Relative tolerance of every makespan and peak comparison (float sums in another order).
#: A numerical tolerance, not a knob: it is the same for every search.
RELATIVE_EPS = 1e-9


@dataclass(frozen=True)
class SearchPolicy:
    """How the fused search spends its time: starts, annealing phases, CP-SAT windows."""

    # Starts.
    greedy_cap_factors: tuple[float, ...] = (1.0, 1.25, 1.5, 2.0, 3.0)
    """Activation caps (factors of the memory bound) under which the longest-tail list
    schedules also run, to find the same latency with less memory (`starts.list_schedules`)."""
    improved_starts: int = 16
    """How many of the best distinct list schedules forward-backward passes improve (count)."""
    lean_cap_factors: tuple[float, ...] = (1.1, 1.3, 1.6)
    """Activation caps (factors of the memory bound) of the lean starts (`starts.lean_starts`)."""
    lean_all_rules_ops: int = 1000
    """Above this many ops (count), a lean start improves only the fastest of its list
    schedules per cap (the forward-backward passes take seconds there)."""
    sequence_share: float = 0.15
    """Share of the time limit that builds the sequenced starts (`starts.sequenced_starts`);
    none with `max_iterations` (their count would depend on time)."""
    sequence_extras: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8)
    """Extra warm-up forwards per model over 1F1B's S - s that the sequenced starts try (count)."""
    restart_slack: float = 0.01
    """Seeds also start from starts at most this much slower (relative makespan) than the fastest."""

    # Seeds.
    min_anneal_share: float = 0.1
    """The annealing keeps at least this share of the time limit, whatever the starts took."""
    memory_phase_share: float = 0.5
    """Share of each seed's budget (seconds and iterations) that belongs to the memory phase."""
    capped_seed_factor: float = 1.7
    """Activation cap (factor of the memory bound) under which seeds anneal from the starts
    within it (`search.run_seeds`)."""
    capped_latency_share: float = 0.7
    """Share of a capped seed's budget that its latency phase gets, when the fastest start
    holds more than `capped_seed_factor` and the seeds catch up from lean starts."""

    # Annealing.
    move_span: int = 8
    """How far (positions on a node) a move or swap reaches."""
    latency_temperature: float = 0.01
    """Initial temperature of the latency phase, as a fraction of the starting makespan."""
    memory_temperature: float = 1.0
    """Initial temperature of the memory phase, in its penalty's units (mean activations,
    mean op durations)."""
    cooling: float = 1e-3
    """Factor by which the temperature falls over a phase."""
    lateness_weight: float = 3.0
    """Latency phase: weight of the ops' summed lateness (per node) against the makespan."""
    memory_lateness_weight: float = 3.0
    """Memory phase: weight of the lateness (in mean op durations) against the excess over
    the level (in mean activations)."""
    critical_share: float = 0.5
    """Share of moves that reorder a critical node arc (latency phase; in the memory phase, of
    the moves not aimed at a high moment, while the walk is late)."""
    peak_share: float = 0.5
    """Memory phase: share of moves aimed at a high moment."""
    memory_step: float = 1.0
    """Memory phase: the level sits this many of the smallest activations under the best peak."""
    nearest_ops: int = 4
    """Memory phase: how many forwards (backwards) nearest a high moment a peak move picks from (count)."""

    # Lean phase (after a seed's descent, on top of its budget).
    lean_share: float = 0.4
    """The lean phase's budget, as a share of the two phases' before it (it comes on top)."""
    lean_try_factors: tuple[float, ...] = (1.7, 1.3)
    """Caps (factors of the memory bound) under which the lean phase looks for a schedule as
    fast as the best; odd seeds try them in reverse order."""
    lean_try_share: float = 0.6
    """Share of the lean phase's remaining budget one lean try may take."""
    lean_patience: float = 0.15
    """Share of the lean phase after which a try that stopped gaining stops."""

    # CP-SAT after the annealing (`SearchConfig.window_share` of the time limit).
    at_bound_window_factor: float = 0.5
    """The windows' share shrinks by this factor when the fastest start already meets the
    lower bound and holds at most `capped_seed_factor` (the seeds' peak descent gets the time)."""
    shorten_share: float = 0.2
    """Share of the windows' time that first shortens the fastest schedule towards the lower
    bound (`window.shorten`), where it is above it."""
    shorten_again_share: float = 0.1
    """Share of the windows' time kept, where the schedule is still above the lower bound, to
    shorten the peak windows' result once more."""
    endgame_share: float = 0.8
    """Share of what is left of the windows' time after shortening that tries to bring lean
    starts to the best makespan (`window.meet_makespan`); the peak windows keep the rest."""
    endgame_slack: float = 0.005
    """Lean starts at most this much slower (relative makespan) than the best are endgame tries."""
    endgame_tries: int = 32
    """At most this many endgame tries (count), in turn; each has half of what is left (the
    last one all of it)."""
    endgame_step: float = 0.0001
    """Relative makespan gaps within one step count as alike when the endgame orders its
    tries (nearest first, then least memory)."""

    def __post_init__(self) -> None:
        shares = ("sequence_share", "min_anneal_share", "memory_phase_share", "capped_latency_share",
                  "critical_share", "peak_share", "lean_try_share", "lean_patience", "shorten_share",
                  "shorten_again_share", "endgame_share", "at_bound_window_factor")  # fmt: skip
        for name in shares:
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"SearchPolicy.{name} is a share and must lie in [0, 1], got {value}")
        if self.move_span < 1 or self.nearest_ops < 1 or self.endgame_tries < 0 or self.improved_starts < 1:
            raise ValueError(
                "SearchPolicy: move_span, nearest_ops and improved_starts must be at least 1, endgame_tries at least 0"
            )
        for name in ("lean_share", "restart_slack", "endgame_slack", "endgame_step", "memory_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"SearchPolicy.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.cooling <= 1:
            raise ValueError(f"SearchPolicy.cooling must lie in (0, 1], got {self.cooling}")
        if not self.lean_try_factors or not self.sequence_extras:
            raise ValueError("SearchPolicy: lean_try_factors and sequence_extras need at least one value")


#: The policy every search uses unless told otherwise.
DEFAULT_POLICY = SearchPolicy()
