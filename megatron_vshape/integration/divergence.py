"""What the training driver does with a non-finite loss or gradient norm, with Megatron-LM's flags.

* `--check-for-nan-in-loss-and-grad` (the default): a NaN or infinite loss, or gradient norm,
  stops the run with `Diverged`, one line naming the iteration and what to do.  The loss is checked
  before the optimizer steps, so the weights saved last are the last finite ones.  Under --fp16 a
  non-finite gradient norm is dynamic loss scaling's overflow: that step is skipped by design and
  counted, not stopped on.
* `--no-check-for-nan-in-loss-and-grad`: such steps are skipped (no update) and counted.

Every rank sees the same reduced loss and norm, so every rank stops at the same iteration.
`Counters` counts both kinds of iteration, per log window (Megatron-LM's "number of skipped
iterations" and "number of nan iterations") and for the whole run (the summary's status says so).
`json_safe` makes figures valid JSON: a non-finite number becomes null.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


class Diverged(RuntimeError):
    """The run stopped on a non-finite loss or gradient norm; the message says what to do."""


def add_arguments(group) -> None:
    group.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                       action="store_true", default=True,
                       help="stop on a NaN or infinite loss or gradient norm (default)")
    group.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                       action="store_false", help="skip such steps instead (no update), counting them")


def finite(x) -> bool:
    return x is not None and math.isfinite(x)


@dataclass
class Counters:
    check: bool = True
    fp16: bool = False
    skipped: int = 0  # iterations without an update (non-finite gradient norm, fp16 overflow)
    nan: int = 0  # iterations with a non-finite loss or gradient norm
    window_skipped: int = 0
    window_nan: int = 0

    def check_loss(self, iteration: int, loss: float, lr: float) -> Optional[str]:
        """Before the update: why to stop (a non-finite loss, when checking), or None.  Not under fp16,
        whose dynamic loss scale skips an overflowed step by itself (Megatron-LM turns the check off there)."""
        if self.check and not self.fp16 and not finite(loss):
            return self._message(iteration, f"lm loss is {loss}", lr)
        return None

    def record(self, iteration: int, loss: float, grad_norm: Optional[float], updated: bool,
               lr: float) -> Optional[str]:
        """After the optimizer step: why to stop (a non-finite gradient norm, when checking), or
        None after counting the iteration."""
        bad_norm = grad_norm is not None and not finite(grad_norm)
        if self.check and bad_norm and not self.fp16:
            return self._message(iteration, f"grad norm is {grad_norm}", lr)
        nan = bad_norm or not finite(loss)
        self.skipped += not updated
        self.nan += nan
        self.window_skipped += not updated
        self.window_nan += nan
        return None

    def take_window(self):
        """(skipped, nan) since the last log line."""
        out = self.window_skipped, self.window_nan
        self.window_skipped = self.window_nan = 0
        return out

    def status(self) -> str:
        """The summary's status: "ok" when every iteration updated the model with finite numbers, or
        when the only skips are fp16 loss scaling's (by design, at the start of every fp16 run)."""
        if not self.nan and (not self.skipped or self.fp16):
            return "ok"
        return f"ok with {self.skipped} skipped and {self.nan} nan iteration(s)"

    @staticmethod
    def _message(iteration: int, what: str, lr: float) -> str:
        return (f"iteration {iteration}: {what} (learning rate {lr:.3g}): training diverged, stopping before the "
                f"update; lower --lr (or raise --lr-warmup-iters, lower --clip-grad) and restart, or resume from the "
                f"last checkpoint with --load and --override-opt-param-scheduler (which takes the new flags); "
                f"--no-check-for-nan-in-loss-and-grad skips such steps instead")


def json_safe(value):
    """`value` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
