"""What `nereus run` executes, as data: which memory-saving choices of a plan and which
workload dtypes.

Everything that says what the runtime can run is derived from this table: the planner's
search space for the runtime (`nereus.solver.layouts.runtime_choices`: every executed choice,
searched when a run plans itself, replans on a resume and in its controller) and the runtime's
own refusal of a plan (`nereus.solver.admission`). So they cannot disagree; a feature the
runtime gains is one `executed` flag flipped here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from nereus.spec.plan import StagePlan

MemoryChoice = Literal["recompute", "token_budget", "zero1", "offload", "kv_budget", "full_shard", "train_offload"]


@dataclass(frozen=True)
class ChoiceSupport:
    """One memory-saving choice of a plan entry and whether the runtime executes it."""

    executed: bool
    """Whether `nereus run` executes a plan entry that makes this choice: its own planner, its
    resume replanner and its controller search it (`nereus.solver.layouts.runtime_choices`); the
    runtime refuses a plan making a choice it does not execute."""
    label: str
    """The choice in prose (`ZeRO-1`), for help texts."""
    flag: str
    """The `nereus plan` option that pins it (`--zero1`)."""
    off: str
    """That option's value that leaves the choice out (`off`, `none`)."""
    used: Callable[[StagePlan], bool]
    """Whether a plan entry makes the choice (an entry leaving `zero1` to the workload's
    optimizer counts as not choosing it: the runtime follows the optimizer either way)."""

    @property
    def pin(self) -> str:
        """The `nereus plan` option that leaves the choice out, `--zero1 off`."""
        return f"{self.flag} {self.off}"


#: Every memory-saving choice a plan entry can make, in the planner's order (`MemoryChoices`).
MEMORY_CHOICES: dict[MemoryChoice, ChoiceSupport] = {
    "recompute": ChoiceSupport(
        True,
        "recompute",
        "--recompute",
        "none",
        lambda e: e.recompute != "none",
    ),
    "token_budget": ChoiceSupport(
        True,
        "token budgets",
        "--token-budget",
        "off",
        lambda e: e.token_budget is not None,
    ),
    "zero1": ChoiceSupport(
        True,
        "ZeRO-1",
        "--zero1",
        "off",
        lambda e: bool(e.zero1),
    ),
    "offload": ChoiceSupport(
        True,
        "offload",
        "--offload",
        "off",
        lambda e: e.offload,
    ),
    "kv_budget": ChoiceSupport(
        True,
        "KV budgets",
        "--kv-budget",
        "off",
        lambda e: e.kv_budget_bytes is not None,
    ),
    "full_shard": ChoiceSupport(
        True,
        "full sharding",
        "--full-shard",
        "off",
        lambda e: e.full_shard,
    ),
    "train_offload": ChoiceSupport(
        True,
        "training-time offload",
        "--train-offload",
        "none",
        lambda e: e.train_offload != "none",
    ),
}


#: Workload dtypes the runtime computes in, with the torch dtype of each (16-bit weights keep
#: fp32 masters; fp16 is not run: it needs loss scaling).
RUNTIME_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16"}


def executed(choice: MemoryChoice) -> bool:
    """Whether the runtime executes `choice`."""
    return MEMORY_CHOICES[choice].executed


def unexecuted_choices(entry: StagePlan) -> list[MemoryChoice]:
    """The choices `entry` makes that the runtime does not execute, in the table's order."""
    return [name for name, support in MEMORY_CHOICES.items() if not support.executed and support.used(entry)]
