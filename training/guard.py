"""The divergence guard: a non-finite loss or gradient norm stops the run (`TrainingDiverged`) before the update
is applied, unless `skip_nonfinite` allows skipping that many bad updates in a row; no non-finite weights are ever
saved.
"""

from __future__ import annotations

import math

import torch

from .checkpoint_files import checkpoint_dirs
from .checkpoints import log_event
from .run_config import TrainingConfig, TrainingDiverged
from .run_folder import RunLog


class DivergenceGuard:
    """Keeps non-finite numbers out of the weights and the checkpoints.

    Once per optimizer step, `update_is_finite` decides (one host sync, agreed by every process) whether the
    step's loss and gradient norm allow the update. A bad update is not applied: `skip` counts it, and more than
    `skip_nonfinite` in a row stop the run with TrainingDiverged. `check_weights` stops the run before non-finite
    weights would be saved.
    """

    def __init__(self, accelerator, config: TrainingConfig, log: "RunLog", progress, skipped_updates: int = 0):
        self.accelerator, self.config, self.log, self.progress = accelerator, config, log, progress
        self.skipped_updates = skipped_updates  # over the whole run, those before a resume included
        self.in_a_row = 0

    def update_is_finite(self, step_loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        step_loss, grad_norm = plain_tensor(step_loss), plain_tensor(grad_norm)
        if self.config.mixed_precision == "fp16":  # the loss scaler skips non-finite gradients itself
            bad = ~torch.isfinite(step_loss)
        else:
            bad = ~(torch.isfinite(grad_norm) & torch.isfinite(step_loss))
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad.float(), reduction="sum") > 0
        if bool(bad):
            self.in_a_row += 1
            return False
        self.in_a_row = 0
        return True

    def skip(self, step: int, step_loss: torch.Tensor, grad_norm: torch.Tensor, learning_rate: float) -> float:
        """Account for the bad update of `step` (not applied): stop the run when it is one too many in a row, else
        count it and write it to events.log. Returns the step's loss."""
        step_loss, grad_norm = plain_tensor(step_loss), plain_tensor(grad_norm)
        loss_value = float(self.accelerator.reduce(step_loss, reduction="mean"))
        if self.in_a_row > self.config.skip_nonfinite:
            self.log.write(dict(step=step, loss=repr(loss_value), learning_rate=repr(learning_rate),
                                grad_norm=f"{float(grad_norm):.6g}", tokens_per_second="", peak_memory_mb="",
                                valid_loss="", valid_perplexity="", skipped_updates=self.skipped_updates))
            self.stop(step, loss_value, float(grad_norm), self.in_a_row)
        self.skipped_updates += 1
        if self.accelerator.is_main_process:
            log_event(self.config.output_dir, f"step {step}: skipped a non-finite update (loss {loss_value!r}, "
                                              f"grad norm {float(grad_norm)!r}); {self.in_a_row} in a row")
        return loss_value

    def check_weights(self, model, step: int, loss_value: float, grad_norm: torch.Tensor) -> None:
        if not _weights_finite(model, self.accelerator):
            self.stop(step, loss_value, float(grad_norm), 0, weights=True)

    def stop(self, step: int, loss: float, grad_norm: float, in_a_row: int, weights: bool = False) -> None:
        self.progress.close()
        self.log.close()
        _stop_diverged(self.accelerator, self.config, step, loss, grad_norm, in_a_row, weights)


def apply_update(optimizer, finite: bool, mixed_precision: str) -> None:
    """Step the optimizer when the update is finite, then clear the gradients. Under fp16 it steps either way:
    Accelerate's gradient scaler then sees the non-finite gradients, skips the update and lowers its scale."""
    if finite or mixed_precision == "fp16":
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """`value` as an ordinary tensor holding its whole value. Under Transformers' distributed engine a gradient norm
    (or a loss) can be a DTensor, often a pending sum over processes; collectives such as `accelerator.reduce` have
    no sharding rule for DTensors, so it is made whole (`full_tensor`, a collective every process reaches here)
    before anything reduces or reads it."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if full_tensor is not None else value


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor parameter (Transformers' engine puts them on several meshes, which one
    `torch.stack` cannot mix), or the parameter itself."""
    to_local = getattr(parameter, "to_local", None)
    return to_local() if to_local is not None else parameter


def _weights_finite(model, accelerator) -> bool:
    """Every parameter finite (one host sync; checked before each save so nothing non-finite is written)."""
    flags = torch.stack([torch.isfinite(_local(p)).all() for p in model.parameters()]).all()
    if accelerator.num_processes > 1:  # FSDP / DTensor shards: every process checks its own
        flags = accelerator.reduce(flags.float(), reduction="sum") == accelerator.num_processes
    return bool(flags)


def _stop_diverged(accelerator, config: TrainingConfig, step: int, loss: float, grad_norm: float, in_a_row: int,
                   weights: bool = False) -> None:
    found = checkpoint_dirs(config.output_dir)
    last = found[-1] if found else None
    where = f"last good checkpoint: {last} (resume with --resume)" if last else "no checkpoint was written yet"
    if weights:
        message = f"step {step}: the weights became non-finite; nothing was saved; {where}"
    else:
        message = (f"step {step}: non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} (loss "
                   f"{loss!r}, grad norm {grad_norm!r}{f', {in_a_row} bad updates in a row' if in_a_row > 1 else ''});"
                   f" the update was not applied; {where}; lower --learning-rate or allow --skip-nonfinite N")
    if accelerator.is_main_process:
        log_event(config.output_dir, f"stopped: {message}")
    accelerator.end_training()
    raise TrainingDiverged(message, step, last)
