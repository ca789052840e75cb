"""Every step's metrics as TensorBoard scalars (`log: {tensorboard: true}`).

The launcher writes them from metrics.jsonl as the ranks append to it, so the events say
what the run folder says. `tensorboard` is an optional extra: the package is imported here,
when a run asks for it, and a run that asks without it is refused before its ranks start
(`setup.logging_problem`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nereus.errors import NereusError
from nereus.spec.run_folder import StepMetrics

#: The run folder's subfolder of TensorBoard event files.
TENSORBOARD_NAME = "tensorboard"
#: StepMetrics fields written as scalars under `rl/` (the per-model-stage maps go on their own).
SCALAR_FIELDS = ("reward", "score", "kl", "response_len_mean", "actor_loss", "critic_loss", "step_seconds")


def step_scalars(metrics: StepMetrics) -> dict[str, float]:
    """The step's scalars by TensorBoard tag."""
    scalars = {f"rl/{name}": getattr(metrics, name) for name in SCALAR_FIELDS}
    scalars.update({f"grad_norm/{stage}": value for stage, value in metrics.grad_norm.items()})
    scalars.update({f"lr/{stage}": value for stage, value in metrics.lr.items()})
    scalars.update({f"seconds/{stage}": value for stage, value in metrics.stage_seconds.items()})
    return {tag: float(value) for tag, value in scalars.items() if value is not None}


class TensorBoardLog:
    """Writes each step's scalars into the run folder's `tensorboard/` events."""

    def __init__(self, out: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise NereusError(
                f"log.tensorboard: needs the tensorboard package ({error}); install it with "
                "`pip install 'nereus[tensorboard]'` or set log.tensorboard: false"
            ) from None
        self.writer: Any = SummaryWriter(log_dir=str(out / TENSORBOARD_NAME))

    def __call__(self, metrics: StepMetrics) -> None:
        for tag, value in step_scalars(metrics).items():
            self.writer.add_scalar(tag, value, metrics.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
