"""The two ways a training run ends early, shared by the settings' checks (run_config), the launch (placement), the
loop and its guard: `TrainingError` (it cannot start or continue as asked) and `TrainingDiverged` (non-finite)."""

from __future__ import annotations


class TrainingError(ValueError):
    """The training run cannot start or continue as asked (one-line reason for the user)."""


class TrainingDiverged(RuntimeError):
    """A non-finite loss / gradient norm (or weights) stopped the run; `last_checkpoint` is the newest good one
    (None when none was written yet). `switchhead train` exits with code 3."""

    def __init__(self, message: str, step: int, last_checkpoint: str | None):
        super().__init__(message)
        self.step = step
        self.last_checkpoint = last_checkpoint
