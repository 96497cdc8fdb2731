"""Steps skipped for non-finite gradients, counted, and a warning when training is stuck."""

from __future__ import annotations

import warnings

from shardwise.amp import GradScaler


class SkippedStepsWarning(RuntimeWarning):
    """Optimizer steps keep being skipped for non-finite gradients."""


class SkippedSteps:
    """Steps skipped in a row, and the warning once they come with no loss scale left to
    lower (`warn_after` in a row, and again every as many after).

    Attributes:
        in_a_row: steps skipped in a row up to the last one.
        warning: the warning last given while they go on (None once a step is taken).
    """

    def __init__(self, warn_after: int) -> None:
        self.warn_after = warn_after
        self.in_a_row = 0
        self.warning: str | None = None
        self._stuck = 0  # of those, skipped with no loss scale left to lower

    def count(self, overflow: bool, scaler: GradScaler) -> None:
        """Count a step, skipped when `overflow`; warn when steps keep being skipped with no
        loss scale left to lower (called from the optimizer's `step()`, whose caller the
        warning names)."""
        self.in_a_row = self.in_a_row + 1 if overflow else 0
        if not overflow:
            self._stuck, self.warning = 0, None
            return
        if scaler.can_back_off:
            return
        self._stuck += 1
        if self._stuck % self.warn_after == 0:
            self.warning = (
                f"{self.in_a_row} optimizer steps in a row were skipped: the gradients "
                f"are inf or nan on some rank at loss scale {scaler.scale:g}, which "
                f"cannot be lowered further, so training makes no progress. Check the loss and "
                f"inputs for inf/nan, the learning rate, and fp16 overflow (try bf16)"
            )
            warnings.warn(self.warning, SkippedStepsWarning, stacklevel=3)

    def snapshot(self) -> tuple[int, int, str | None]:
        """What `restore` puts back (a step rolled back)."""
        return self.in_a_row, self._stuck, self.warning

    def restore(self, snapshot: tuple[int, int, str | None]) -> None:
        self.in_a_row, self._stuck, self.warning = snapshot


__all__ = ["SkippedSteps", "SkippedStepsWarning"]
