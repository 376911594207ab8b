"""Pretraining of SwitchHead / SwitchAll / dense language models: one short, linear loop over Accelerate.

    config = TrainingConfig.from_preset("tiny-switchhead", data="../shared/data/wikitext-2", max_steps=300)
    result = train(config)          # -> TrainResult(output_dir, step, valid_loss, ...)

The loop (read `_train` top to bottom): the run folder and the resume rule (`open_run`) -> tokenizer and data
(`load_data`) -> model from a preset -> AdamW -> the checkpoint to continue from (`restore_checkpoint`) -> for each
step: learning rate (linear warmup, cosine decay), `gradient_accumulation_steps` micro-batches with backward
(`accumulate_gradients`), gradient clipping, the divergence guard (`DivergenceGuard`), optimizer step
(`apply_update`), logs, periodic validation, periodic checkpoint (`save_checkpoint`) -> the final model
(`save_final_model`). Run it under `accelerate launch` for several processes (DDP, FSDP, several nodes), or under
torchrun with `distributed` sizes for Transformers' distributed engine (tensor, expert and FSDP2 plans): every
data-parallel process cuts its own rows out of the same global batch, so the numbers do not depend on how many
processes share the work.

Output folder layout:
    OUTPUT/                         save_pretrained folder (config, weights, model code, tokenizer) at the end
    OUTPUT/training_config.json     the TrainingConfig of the run
    OUTPUT/log.csv                  one row per logged step (loss, lr, grad norm, tokens/s, peak memory, validation)
    OUTPUT/tensorboard/switchhead/  the same numbers for TensorBoard (with report_to="tensorboard"; Accelerate's
                                    trackers, as W&B and MLflow, get them too)
    OUTPUT/checkpoints/step-NNNNNNN model, optimizer, RNG states, XL memory and the step (the data position);
                                    RNG states and XL memory as safetensors + JSON (rng_state_P.safetensors,
                                    xl_memory_P.safetensors), so resuming unpickles nothing of ours
    OUTPUT/SHA256SUMS, OUTPUT/checkpoints/step-NNNNNNN/SHA256SUMS   SHA-256 manifests, written last
    OUTPUT/README.md                the model card (Hub metadata, settings, validation losses), after the manifest
    OUTPUT/events.log               fallbacks to older checkpoints, inexact resumes, divergence stops

Checkpoints are written to a hidden temporary folder, closed with a SHA-256 manifest and renamed into place when
complete, so a crash or kill never leaves a half-written checkpoint under a `step-*` name, and `--resume` finds
any file that changed afterwards (it then falls back to the newest intact checkpoint and says so).

Failing loudly: `train` writes only into a new or empty folder, or into one of its own runs with `resume` or
`overwrite`. A non-finite loss or gradient norm stops the run (`TrainingDiverged`, exit code 3 on the command
line) before the update is applied, unless `skip_nonfinite` allows skipping that many bad updates in a row; no
non-finite weights are ever saved. A checkpoint whose RNG state is damaged, missing or does not load is resumed
only with `inexact_resume` (written to events.log). One writer per run folder: `train` holds an exclusive lock on
`output_dir` (`switchhead.integrity.FolderLock`) for the whole run.

This file holds the loop; the rest sits in rooms of one purpose: the settings and what follows from them
(`run_config`), writing checkpoints and choosing the one to resume (`checkpoints`), the files of a checkpoint and
how a resume reads them without unpickling anything of ours (`checkpoint_files`), the divergence guard (`guard`),
the run folder with its lock, data, log and final model (`run_folder`), where the model lives and who writes its
state (`placement`: Accelerate's, or Transformers' distributed engine).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import resource
import signal
import sys
import threading
import time

import torch

from .. import SwitchHeadForCausalLM
from .checkpoints import choose_checkpoint, restore_checkpoint, save_checkpoint
from .data import TokenBatches
from .guard import DivergenceGuard, apply_update, plain_tensor
from .placement import check_sizes, placement_for, start_accelerator
from .run_config import (TINY_TRAINING, TrainingConfig, TrainingDiverged, TrainingError, TrainResult, learning_rate_at,
                         report_trackers)
from .run_folder import (RunLog, check_processes_joined, finish_trackers, installed_trackers, load_data, open_run,
                         run_folder_lock, save_final_model, start_trackers, tensorboard_dir)


def _detach(memory):
    """XL memory with the autograd graph cut (tensors, or tuples / lists of them)."""
    if isinstance(memory, torch.Tensor):
        return memory.detach()
    if isinstance(memory, (tuple, list)):
        return type(memory)(_detach(m) for m in memory)
    return memory


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ================================================================================================ the loop
def train(config: TrainingConfig) -> TrainResult:
    """Run (or resume) the pretraining job `config` describes; returns the final numbers.

    The main process holds the run folder's lock (`FolderLock`) from before anything is checked or written until
    the run ends, however it ends; a second writer gets TrainingError naming the holder. With `config.distributed`
    sizes the model is sharded by Transformers' distributed engine (`placement`); without a GPU its processes join
    over gloo."""
    from accelerate.utils import ProjectConfiguration

    check_sizes(config.distributed)  # launched processes that do not fit the sizes: before any process group
    on_cpu = bool(config.distributed) and not torch.accelerator.is_available()
    trackers, missing = installed_trackers(report_trackers(config))
    project = ProjectConfiguration(project_dir=config.output_dir, logging_dir=tensorboard_dir(config.output_dir))
    accelerator = start_accelerator(mixed_precision=config.mixed_precision, cpu=on_cpu,  # peers join in bounded time
                                    log_with=trackers or None, project_config=project)
    check_processes_joined(accelerator)
    if missing and accelerator.is_main_process:  # a note, not an error: the run goes on without them
        print(f"switchhead train: note: {' and '.join(missing)} not installed (pip install {' '.join(missing)}); "
              f"training without {'it' if len(missing) == 1 else 'them'}", file=sys.stderr)
    with run_folder_lock(accelerator, config.output_dir), StopOnSignal.restoring():
        try:
            return _train(config, accelerator)
        finally:  # however the run ends (a failure, a signal), the trackers close their runs
            finish_trackers(accelerator)


def _train(config: TrainingConfig, accelerator) -> TrainResult:
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    started = time.time()
    is_main = accelerator.is_main_process
    config, resume = open_run(config, accelerator)
    placement = placement_for(config, accelerator)
    data = load_data(config, accelerator, fresh=resume is None, data_count=placement.data_count)

    # ---------------------------------------------------------------- model and optimizer
    set_seed(config.seed)  # the same initial weights in every process
    model = SwitchHeadForCausalLM(data.model_config)
    num_parameters = model.num_parameters()
    model = placement.place(model)  # sharded by Transformers' engine, or as is for Accelerate's prepare
    memory_supported = (data.model_config.position_encoding == "xl" and data.model_config.xl_memory_length > 0
                        and "xl_memory" in inspect.signature(model.forward).parameters)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=config.adam_betas,
                                  weight_decay=config.weight_decay, **placement.optimizer_options)
    model, optimizer = placement.prepare(model, optimizer)
    accumulation = config.gradient_accumulation_steps
    memory: list = [None] * accumulation  # XL memory of each micro-batch slot (each is its own set of streams)
    step, skipped_updates = 0, 0
    if resume is not None:
        step, skipped_updates, memory = restore_checkpoint(accelerator, config, resume, placement)

    tracked = [getattr(tracker, "value", tracker) for tracker in accelerator.log_with]
    log = RunLog(config.output_dir, step, "tensorboard" in tracked, is_main, accelerator)
    start_trackers(accelerator, config, step)
    if is_main:
        accelerator.print(f"{config.preset} ({data.model_config.attention_type} attention): "
                          f"{num_parameters / 1e6:.2f}M parameters, {data.train_tokens:,} training tokens, "
                          f"{data.valid_tokens:,} validation tokens, unigram perplexity {data.unigram:.1f}"
                          + (f", resuming at step {step}" if step else ""))
    progress = tqdm(total=config.max_steps, initial=step, disable=not (is_main and config.progress),
                    desc=f"train {config.preset}", dynamic_ncols=True)
    guard = DivergenceGuard(accelerator, config, log, progress, skipped_updates)

    # ---------------------------------------------------------------- the loop
    model.train()
    loss_value, valid_loss = float("nan"), float("nan")
    tokens_per_step = config.batch_size * config.block_size
    tick, steps_since_tick = time.time(), 0
    stop = StopOnSignal(accelerator)
    while stop.watching(step < config.max_steps):
        learning_rate = learning_rate_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        if data.train_batches.segment_index(step) == 0:
            memory = [None] * accumulation  # a new pass over the streams: no previous segment to remember

        step_loss, step_memory = accumulate_gradients(model, data.train_batches, step, memory, accumulation,
                                                      accelerator, memory_supported, placement)
        grad_norm = clip_gradients(model, accelerator, config.grad_clip)
        finite = guard.update_is_finite(step_loss, grad_norm)
        apply_update(optimizer, finite, config.mixed_precision)
        if finite:
            memory = step_memory
        else:  # the bad step's XL memory is not carried on
            loss_value = guard.skip(step + 1, step_loss, grad_norm, learning_rate)
        step += 1
        steps_since_tick += 1
        progress.update(1)

        is_log = step % config.log_every == 0 or step == config.max_steps
        is_eval = step % config.eval_every == 0 or step == config.max_steps
        if is_log or is_eval:
            loss_value = float(accelerator.reduce(step_loss, reduction="mean"))
            throughput = tokens_per_step * steps_since_tick / max(time.time() - tick, 1e-9)
            row = dict(step=step, loss=repr(loss_value), learning_rate=repr(learning_rate),
                       grad_norm=f"{float(grad_norm):.6g}", peak_memory_mb=f"{_peak_memory_mb(accelerator.device):.1f}",
                       tokens_per_second=f"{throughput:.1f}",
                       valid_loss="", valid_perplexity="", skipped_updates=guard.skipped_updates)
            if is_eval:
                valid_loss = evaluate(model, data.valid_batches, accelerator, memory_supported, config.eval_batches,
                                      placement)
                row.update(valid_loss=repr(valid_loss), valid_perplexity=f"{math.exp(valid_loss):.4f}")
            log.write(row)
            tick, steps_since_tick = time.time(), 0  # validation and logging time is not training throughput
            progress.set_postfix(loss=f"{loss_value:.3f}", ppl=f"{math.exp(valid_loss):.1f}"
                                 if valid_loss == valid_loss else "-")
        stopping = stop.requested()  # Ctrl-C or SIGTERM: the step is whole, so save it before stopping
        if step % config.save_every == 0 or step == config.max_steps or stopping:
            guard.check_weights(model, step, loss_value, grad_norm)
            save_checkpoint(accelerator, config.output_dir, step, config, memory, guard.skipped_updates, placement)
        if stopping:
            progress.close()
            raise stop.interrupt(step, config.output_dir)
    progress.close()

    # ---------------------------------------------------------------- the result folder
    save_final_model(accelerator, model, data.tokenizer, config.output_dir, placement, settings=config.to_dict())
    if valid_loss != valid_loss:  # resumed at the last step: nothing was evaluated in this process
        valid_loss = evaluate(model, data.valid_batches, accelerator, memory_supported, config.eval_batches,
                              placement)
    finish_trackers(accelerator)
    accelerator.end_training()
    return TrainResult(config.output_dir, step, loss_value, valid_loss, math.exp(valid_loss), data.unigram,
                       num_parameters, time.time() - started)


class StopOnSignal:
    """Ctrl-C (SIGINT) or SIGTERM during the training loop ends the run at the end of the step under way, with a
    verified checkpoint of that step to `--resume` from: a signal only sets a flag, which the loop reads between
    steps (every process agrees on it), so no save ever sees a half-applied update. A second signal stops at once.

    `watching(condition)` wraps the loop's condition: the handlers are installed while it is True (in the main
    thread only) and restored when it turns False; `interrupt` is the exception that ends the command (exit code
    130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def watching(self, condition: bool) -> bool:
        if condition and not self._previous and threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._handle)
        elif not condition:
            self.restore()
        return condition

    def _handle(self, number, frame) -> None:
        if self.signal is not None:  # the second signal: do not wait for the step
            self.restore()
            raise self._exception(number)()
        self.signal = number

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    @staticmethod
    @contextlib.contextmanager
    def restoring():
        """The SIGINT and SIGTERM handlers as they were, whichever way the run ends (an error inside the loop)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def requested(self) -> bool:
        flag = self.signal is not None
        if self.accelerator.num_processes > 1:  # one process signalled: every process stops at the same step
            flag = float(self.accelerator.reduce(torch.tensor([float(flag)], device=self.accelerator.device),
                                                 reduction="sum")) > 0
        return flag

    @staticmethod
    def _exception(number: int | None) -> type[KeyboardInterrupt]:
        from ..integrity import Terminated

        return Terminated if number == signal.SIGTERM else KeyboardInterrupt

    def interrupt(self, step: int, output_dir: str) -> KeyboardInterrupt:
        """The exception that ends the run, naming the checkpoint (verified against its manifest) to resume from."""
        from ..integrity import verify_manifest

        self.restore()
        checkpoint = os.path.join(output_dir, "checkpoints", f"step-{step:07d}")
        problems = verify_manifest(checkpoint)
        if problems:
            return self._exception(self.signal)(f"stopped at step {step}; its checkpoint does not verify "
                                                f"({problems[0]})")
        return self._exception(self.signal)(f"stopped at step {step}; checkpoint {checkpoint} saved and verified: "
                                            "continue with --resume")


def accumulate_gradients(model, batches: TokenBatches, step: int, memory: list, accumulation: int, accelerator,
                         memory_supported: bool, placement=None) -> tuple[torch.Tensor, list]:
    """Forward and backward of the step's `accumulation` micro-batches (this process's rows: `placement`'s share,
    default every process its own). Returns the step's mean loss (a tensor: no host sync) and the XL memory each
    micro-batch slot carries on, as a new list: `memory` stays as it was, for a step whose update is not applied."""
    step_loss = torch.zeros((), device=accelerator.device)
    carried = list(memory)
    index, count = _data_share(accelerator, placement)
    for micro in range(accumulation):
        rows = batches.micro_batch(step, micro, index, count, accumulation).to(accelerator.device)
        extra = {"xl_memory": carried[micro], "use_cache": False} if memory_supported else {"use_cache": False}
        # gradients are synchronised between processes only on the last micro-batch
        sync = contextlib.nullcontext() if micro == accumulation - 1 else accelerator.no_sync(model)
        with sync, accelerator.autocast():
            out = model(input_ids=rows, labels=rows, **extra)
            accelerator.backward(out.loss / accumulation)
        carried[micro] = _detach(getattr(out, "xl_memory", None))
        step_loss += out.loss.detach() / accumulation
    return step_loss, carried


def clip_gradients(model, accelerator, grad_clip: float) -> torch.Tensor:
    """Clip the gradient norm to `grad_clip` (0: no clipping) and return the norm before clipping, as a tensor.
    Clipping computes the norm anyway (max_norm=inf: the norm alone); with the loss it decides whether the update
    may be applied."""
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    return plain_tensor(torch.as_tensor(grad_norm, device=accelerator.device))  # a DTensor under the engine


def _data_share(accelerator, placement) -> tuple[int, int]:
    """(this process's index, the number of distinct shares) of each batch."""
    if placement is None:
        return accelerator.process_index, accelerator.num_processes
    return placement.data_index, placement.data_count


@torch.no_grad()
def evaluate(model, batches: TokenBatches, accelerator, memory_supported: bool, max_batches: int,
             placement=None) -> float:
    """Mean next-token loss over the validation stream (in order, XL memory carried), over all processes (the
    processes of a tensor-parallel group count their shared rows alike, which leaves the mean as it is)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # [sum of losses * tokens, tokens]
    memory = None
    steps = len(batches) if max_batches == 0 else min(len(batches), max_batches)
    index, count = _data_share(accelerator, placement)
    for step in range(steps):
        rows = batches.micro_batch(step, 0, index, count, 1)
        rows = rows.to(accelerator.device)
        extra = {"xl_memory": memory, "use_cache": False} if memory_supported else {"use_cache": False}
        with accelerator.autocast():
            out = model(input_ids=rows, labels=rows, **extra)
        memory = getattr(out, "xl_memory", None)
        tokens = rows.shape[0] * (rows.shape[1] - 1)  # the loss shifts inside each block
        total += torch.stack([out.loss.double() * tokens, torch.tensor(tokens, dtype=torch.float64,
                                                                       device=total.device)])
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    return float(total[0] / total[1])


__all__ = ["TINY_TRAINING", "TrainResult", "TrainingConfig", "TrainingDiverged", "TrainingError", "choose_checkpoint",
           "learning_rate_at", "train"]
