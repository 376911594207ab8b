"""Pretraining of SwitchHead / SwitchAll / dense language models: one short, linear loop over Accelerate.

    config = TrainingConfig.from_preset("tiny-switchhead", data="../shared/data/wikitext-2", max_steps=300)
    result = train(config)          # -> TrainResult(output_dir, step, valid_loss, ...)

The loop (read `_train` top to bottom): the run folder and the resume rule (`open_run`) -> tokenizer and data
(`load_data`) -> model from a preset -> AdamW -> the checkpoint to continue from (`restore_checkpoint`) -> for each
step: learning rate (linear warmup, cosine decay), `gradient_accumulation_steps` micro-batches with backward
(`accumulate_gradients`), gradient clipping, the divergence guard (`DivergenceGuard`), optimizer step
(`apply_update`), logs, periodic validation, periodic checkpoint (`save_checkpoint`) -> the final model
(`save_final_model`). Run it under `accelerate launch` for several processes (DDP, FSDP, several nodes): every
process cuts its own rows out of the same global batch, so the numbers do not depend on how many processes share
the work.

Output folder layout:
    OUTPUT/                         save_pretrained folder (config, weights, model code, tokenizer) at the end
    OUTPUT/training_config.json     the TrainingConfig of the run
    OUTPUT/log.csv                  one row per logged step (loss, lr, grad norm, tokens/s, peak memory, validation)
    OUTPUT/tensorboard/             the same numbers for TensorBoard (when it is installed)
    OUTPUT/checkpoints/step-NNNNNNN model, optimizer, RNG states, XL memory and the step (the data position);
                                    RNG states and XL memory as safetensors + JSON (rng_state_P.safetensors,
                                    xl_memory_P.safetensors), so resuming unpickles nothing of ours
    OUTPUT/SHA256SUMS, OUTPUT/checkpoints/step-NNNNNNN/SHA256SUMS   SHA-256 manifests, written last
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

The files of a checkpoint, and how a resume reads them without unpickling anything of ours, are in
`checkpoint_files`.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import inspect
import json
import math
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import PRESETS, SwitchHeadConfig, SwitchHeadForCausalLM
from .paper import PAPER_TRAINING
from ..integrity import (LOCK_NAME, MANIFEST, FolderLock, UnloadableModel, atomic_file, check_model_size,
                         read_manifest, write_manifest)
from .checkpoint_files import (CHECKPOINT_STATE, LEGACY_RNG_FILE, MAX_PROCESSES, RngStateError, checkpoint_dirs,
                               inspect_checkpoint, read_memory, read_rng_state, restore_rng_state, unloadable_file,
                               write_memory, write_rng_state)
from .data import DataError, TokenBatches, load_documents, load_tokenizer, tokenize_documents, train_tokenizer, \
    unigram_perplexity

# Training settings of the tiny presets, sized for a CPU.
TINY_TRAINING: dict[str, Any] = dict(block_size=128, batch_size=16, learning_rate=2e-3, max_steps=400,
                                     warmup_steps=40, grad_clip=0.25, vocab_size=2048, eval_every=100,
                                     save_every=200, log_every=10)

LOG_FIELDS = ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "peak_memory_mb", "valid_loss",
              "valid_perplexity", "skipped_updates")

# options that may change when a run is resumed: they do not change what is computed, except max_steps, which
# extends (or shortens) the run and so stretches the cosine schedule from the resumed step on
CHANGEABLE_ON_RESUME = ("output_dir", "resume", "eval_every", "save_every", "log_every", "keep_checkpoints",
                        "progress", "tensorboard", "eval_batches", "max_steps", "overwrite", "skip_nonfinite",
                        "inexact_resume", "allow_pickle")
RUN_MARKER = "training_config.json"  # marks a folder as a `switchhead train` run (written before anything else)
EVENTS = "events.log"


class TrainingError(ValueError):
    """The training run cannot start or continue as asked (one-line reason for the user)."""


class TrainingDiverged(RuntimeError):
    """A non-finite loss / gradient norm (or weights) stopped the run; `last_checkpoint` is the newest good one
    (None when none was written yet). `switchhead train` exits with code 3."""

    def __init__(self, message: str, step: int, last_checkpoint: str | None):
        super().__init__(message)
        self.step = step
        self.last_checkpoint = last_checkpoint


@dataclass
class TrainingConfig:
    """Everything a pretraining run needs; the defaults are the paper's (PAPER.md section 4).

    `from_preset(name)` fills in the paper's training settings of a model preset (or the tiny ones); `model`
    overrides single fields of the model preset (e.g. `{"hidden_size": 128}`).
    """

    preset: str = "tiny-switchhead"
    output_dir: str = "runs/switchhead"
    model: dict[str, Any] = field(default_factory=dict)
    # data
    data: str | None = None  # a file, a folder, a Hub dataset name; None: the Python standard library corpus
    valid_data: str | None = None
    text_field: str = "text"
    valid_fraction: float = 0.05
    tokenizer: str | None = None  # a tokenizer folder; None: train a BPE tokenizer on the training split
    vocab_size: int = 8000  # of the BPE tokenizer trained when no tokenizer is given
    block_size: int = 256  # tokens per sequence (T)
    # optimisation
    batch_size: int = 64  # sequences per optimizer step, over all processes and accumulation steps
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2.5e-4
    min_learning_rate: float = 0.0
    warmup_steps: int = 0
    max_steps: int = 100_000
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 0.25  # kappa; 0 disables clipping
    mixed_precision: str = "no"  # "no", "bf16" or "fp16" (GPU)
    seed: int = 0
    # evaluation, logging, checkpoints
    eval_every: int = 500
    eval_batches: int = 50  # validation segments per process and evaluation; 0: the whole split
    log_every: int = 10
    save_every: int = 1000
    keep_checkpoints: int = 2
    tensorboard: bool = True
    progress: bool = True
    resume: str | None = None  # "latest" or a checkpoint folder
    overwrite: bool = False  # start the run in output_dir (one of our runs) over, deleting its files
    skip_nonfinite: int = 0  # bad (non-finite) updates in a row to skip before stopping; 0: stop at the first
    inexact_resume: bool = False  # resume even when the checkpoint's RNG state is damaged or missing
    allow_pickle: bool = False  # fully unpickle an older checkpoint's RNG state that the restricted loader refuses

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> "TrainingConfig":
        """The model preset `preset` with its training settings: the paper's (PAPER_TRAINING) or the tiny ones."""
        if preset not in PRESETS:
            raise TrainingError(f"unknown preset {preset!r}; choose one of: {', '.join(sorted(PRESETS))}")
        if preset in PAPER_TRAINING:
            paper = PAPER_TRAINING[preset]
            settings = dict(block_size=paper["context"], batch_size=paper["batch_size"],
                            learning_rate=paper["learning_rate"], max_steps=paper["steps"],
                            grad_clip=paper["grad_clip"])
        else:
            settings = dict(TINY_TRAINING)
        settings.update(overrides)
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TrainingError(f"unknown training option(s): {', '.join(unknown)}")
        return cls(preset=preset, **settings)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainResult:
    output_dir: str
    step: int
    train_loss: float
    valid_loss: float
    valid_perplexity: float
    unigram_perplexity: float
    num_parameters: int
    seconds: float


# ================================================================================================ pieces
def learning_rate_at(step: int, config: TrainingConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `min_learning_rate` at `max_steps`."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_learning_rate + (config.learning_rate - config.min_learning_rate) * cosine


def check_config(config: TrainingConfig, model_config: SwitchHeadConfig, num_processes: int) -> None:
    """Raise TrainingError naming the option and the rule for settings the loop cannot run."""
    for name in ("block_size", "batch_size", "gradient_accumulation_steps", "max_steps", "log_every", "eval_every",
                 "save_every", "keep_checkpoints"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TrainingError(f"{name} must be an integer >= 1, got {value!r}")
    if config.block_size > model_config.max_position_embeddings:
        raise TrainingError(f"block_size ({config.block_size}) must be <= the model's max_position_embeddings "
                            f"({model_config.max_position_embeddings}); lower --block-size or choose another preset")
    slots = num_processes * config.gradient_accumulation_steps
    if config.batch_size % slots:
        raise TrainingError(f"batch_size ({config.batch_size}) must be divisible by processes ({num_processes}) x "
                            f"gradient_accumulation_steps ({config.gradient_accumulation_steps})")
    if config.mixed_precision not in ("no", "bf16", "fp16"):
        raise TrainingError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {config.mixed_precision!r}")
    if config.learning_rate <= 0 or config.min_learning_rate < 0 or config.min_learning_rate > config.learning_rate:
        raise TrainingError(f"need 0 <= min_learning_rate ({config.min_learning_rate}) <= learning_rate "
                            f"({config.learning_rate}) and learning_rate > 0")
    if config.warmup_steps < 0 or config.grad_clip < 0 or config.eval_batches < 0:
        raise TrainingError("warmup_steps, grad_clip and eval_batches must be >= 0")
    for name in ("learning_rate", "min_learning_rate", "grad_clip", "weight_decay", "valid_fraction"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TrainingError(f"{name} must be a finite number, got {value!r}")
    if isinstance(config.skip_nonfinite, bool) or not isinstance(config.skip_nonfinite, int) \
            or config.skip_nonfinite < 0:
        raise TrainingError(f"skip_nonfinite must be an integer >= 0, got {config.skip_nonfinite!r}")
    try:  # weights, gradients and AdamW's two moments in fp32: 16 bytes a parameter, before any is allocated
        check_model_size(model_config, bytes_per_parameter=16, what="the model to train")
    except UnloadableModel as error:
        raise TrainingError(str(error)) from None


def build_model_config(config: TrainingConfig, tokenizer) -> SwitchHeadConfig:
    """The preset's model configuration with the user's overrides and the tokenizer's vocabulary (None: the
    configured BPE vocabulary size, to check the settings before a tokenizer exists)."""
    import difflib

    known = {f.name for f in dataclasses.fields(SwitchHeadConfig)} | {"rope_theta"}
    for name in config.model:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.5)
            raise TrainingError(f"model configuration: unknown field {name!r}"
                                + (f"; did you mean {' or '.join(close)}?" if close else ""))
    if tokenizer is None:
        vocabulary = dict(vocab_size=config.vocab_size)
    else:
        vocabulary = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                          bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    try:
        return SwitchHeadConfig.from_preset(config.preset, **{**config.model, **vocabulary})
    except (TypeError, ValueError) as error:
        raise TrainingError(f"model configuration: {error}") from None


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


# ================================================================================================ checkpoints
def log_event(output_dir: str, message: str) -> None:
    """Append one line to the run's events.log (main process only)."""
    with open(os.path.join(output_dir, EVENTS), "a", encoding="utf-8") as handle:
        handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {message}\n")


def save_checkpoint(accelerator, output_dir: str, step: int, config: TrainingConfig, memory: list,
                    skipped_updates: int = 0) -> str:
    """Write model, optimizer, RNG states, XL memory and the step, then the SHA-256 manifest; atomically
    (temporary folder, then rename). A failed write (a full disk, a quota) raises TrainingError naming the folder
    and leaves every earlier checkpoint as it was."""
    root = os.path.join(output_dir, "checkpoints")
    final = os.path.join(root, f"step-{step:07d}")
    temporary = os.path.join(root, f".tmp-step-{step:07d}")
    try:
        if accelerator.is_main_process:
            shutil.rmtree(temporary, ignore_errors=True)  # leftovers of a save that was killed
            os.makedirs(temporary)
        accelerator.wait_for_everyone()
        accelerator.save_state(temporary)  # model, optimizer, and Accelerate's pickled RNG states ...
        index = accelerator.process_index
        legacy = os.path.join(temporary, LEGACY_RNG_FILE.format(index))
        if os.path.exists(legacy):
            os.remove(legacy)  # ... which are replaced by a format that loads without unpickling
        write_rng_state(temporary, index)
        write_memory(temporary, index, memory)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            state = dict(step=step, num_processes=accelerator.num_processes, config=config.to_dict(),
                         skipped_updates=skipped_updates)
            with open(os.path.join(temporary, CHECKPOINT_STATE), "w") as handle:
                json.dump(state, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            write_manifest(temporary)  # last: its presence marks the checkpoint complete
            if os.path.exists(final):  # the same step saved again (a resumed run): replace the whole folder
                shutil.rmtree(final)
            os.replace(temporary, final)
            for old in checkpoint_dirs(output_dir)[: -config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
    except Exception as error:  # noqa: BLE001 - only write failures are turned into a message, see _write_failure
        if accelerator.is_main_process:  # an incomplete checkpoint is never left behind, whatever failed
            shutil.rmtree(temporary, ignore_errors=True)  # gives the space back; earlier checkpoints are untouched
        reason = _write_failure(error)
        if reason is None:
            raise
        found = checkpoint_dirs(output_dir)
        raise TrainingError(f"cannot write the checkpoint of step {step} into {root!r} ({reason}); earlier "
                            f"checkpoints are intact ({'newest: ' + found[-1] if found else 'none yet'}); free some "
                            "space and resume with --resume") from None
    accelerator.wait_for_everyone()
    return final


def _write_failure(error: BaseException) -> str | None:
    """A short reason when `error` (or an exception it was raised from) is a failed write (disk full, quota, file
    too large, I/O error), else None. torch.save reports a full disk as a RuntimeError of its zip writer
    ('basic_ios::clear', 'PytorchStreamWriter failed writing', or, when the disk fills between two records,
    'unexpected pos N vs M'); safetensors as a SafetensorError quoting the OS error."""
    markers = ("basic_ios", "PytorchStreamWriter failed", "No space left", "Disk quota", "File too large",
               "failed writing", "I/O error", "Input/output error", "unexpected pos", "StorageFull",
               "FilesystemQuotaExceeded", "FileTooLarge")
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if isinstance(error, OSError):  # a full disk is the folder's, whichever file (a copy's source) it names
            full = error.errno in (errno.ENOSPC, errno.EDQUOT)
            return f"{error.strerror or text}" + (f": {error.filename}" if error.filename and not full else "")
        if isinstance(error, RuntimeError) or type(error).__name__ == "SafetensorError":
            if any(marker in str(error) for marker in markers):
                return f"write failed, is the disk full? {text[:160]}"
        error = error.__cause__ or error.__context__
    return None


def _problems(items: list[str]) -> str:
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def choose_checkpoint(config: TrainingConfig) -> tuple[str, list[str], bool]:
    """(folder, notes, exact) for `config.resume` ("latest": the newest intact checkpoint of `output_dir`,
    falling back past damaged ones; a folder: that one, refused when damaged). `notes` says what was skipped;
    `exact` is False when the RNG state is damaged or missing and `inexact_resume` allows going on."""
    if config.resume in ("latest", True):
        candidates = checkpoint_dirs(config.output_dir)[::-1]
        if not candidates:
            raise TrainingError(f"--resume: {config.output_dir!r} has no complete checkpoint to resume from")
    else:
        path = str(config.resume)
        if not os.path.isdir(path):
            raise TrainingError(f"--resume: checkpoint folder {path!r} does not exist")
        candidates = [path]
    notes = []
    for path in candidates:
        other, rng = inspect_checkpoint(path, config.allow_pickle)
        if other:
            notes.append(f"checkpoint {path} is damaged or incomplete ({_problems(other)})")
            continue
        if rng and not config.inexact_resume:
            raise TrainingError(f"--resume: the RNG state of checkpoint {path!r} is damaged or missing "
                                f"({_problems(rng)}), so the continuation would not be exact; pass --inexact-resume "
                                "to continue anyway")
        if rng:
            notes.append(f"inexact resume from {path}: RNG state damaged or missing ({_problems(rng)}); dropout, "
                         "expert dropout and data-independent randomness will differ from an uninterrupted run")
        elif notes:
            notes.append(f"falling back to the newest intact checkpoint, {path}")
        return path, notes, not rng
    raise TrainingError(f"--resume: {'; '.join(notes)}; no intact checkpoint is left to resume from")


def find_checkpoint(config: TrainingConfig) -> str:
    """The folder `config.resume` names, checked ("latest": the newest intact checkpoint of `output_dir`)."""
    return choose_checkpoint(config)[0]


def read_checkpoint_state(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, CHECKPOINT_STATE)) as handle:
            state = json.load(handle)
        state["config"]["adam_betas"] = tuple(state["config"]["adam_betas"])
        for name, low, high in (("step", 0, None), ("num_processes", 1, MAX_PROCESSES), ("skipped_updates", 0, None)):
            value = state.get(name, low)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                raise ValueError(f"{name} {str(value)[:40]} is not an integer in [{low}, {high or 'inf'}]")
        return state
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise TrainingError(f"--resume: checkpoint {path!r} is corrupt ({CHECKPOINT_STATE}: {error})") from None


def merge_resumed_config(config: TrainingConfig, stored: dict[str, Any]) -> TrainingConfig:
    """The stored configuration of the run being resumed; the new one may only change harmless options."""
    known = {f.name for f in dataclasses.fields(TrainingConfig)}
    resumed = TrainingConfig(**{name: value for name, value in stored.items() if name in known})
    different = [f"{name} ({getattr(resumed, name)!r} -> {getattr(config, name)!r})"
                 for name in stored if name in known and name not in CHANGEABLE_ON_RESUME
                 and getattr(config, name) != stored[name]]
    if different:
        raise TrainingError("--resume continues a run with its own settings; these differ: " + ", ".join(different))
    for name in CHANGEABLE_ON_RESUME:
        setattr(resumed, name, getattr(config, name))
    return resumed


def restore_checkpoint(accelerator, config: TrainingConfig, resume: "Resume") -> tuple[int, int, list]:
    """Load `resume`'s model, optimizer and XL memory, and its RNG states when they allow an exact continuation;
    returns (step, skipped updates, XL memory). The main process reports the resume notes (and writes them to
    events.log) and removes the folders of interrupted saves."""
    checkpoint = resume.path
    try:
        # model (safetensors) and optimizer (torch's restricted loader); Accelerate also tries its pickled RNG
        # file, with the same restricted loader, and says nothing when there is none: ours is restored below
        accelerator.load_state(checkpoint)
        memory = read_memory(checkpoint, accelerator.process_index, accelerator.device)
    except Exception as error:  # noqa: BLE001 - truncated or foreign files fail in many ways
        culprit = unloadable_file(checkpoint, accelerator.process_index) or \
            f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        raise TrainingError(f"--resume: checkpoint {checkpoint!r} is corrupt or incomplete ({culprit})") from None
    if resume.exact:
        try:
            restore_rng_state(read_rng_state(checkpoint, accelerator.process_index, config.allow_pickle))
        except RngStateError as error:
            if not config.inexact_resume:
                raise TrainingError(f"--resume: the RNG state of checkpoint {checkpoint!r} does not load "
                                    f"({error}), so the continuation would not be exact; pass --inexact-resume "
                                    "to continue anyway") from None
            resume.notes.append(f"inexact resume from {checkpoint}: RNG state does not load ({error}); dropout, "
                                "expert dropout and data-independent randomness will differ from an "
                                "uninterrupted run")
    step = resume.state["step"]
    skipped_updates = int(resume.state.get("skipped_updates", 0))
    if accelerator.is_main_process:
        for note in resume.notes:
            accelerator.print(f"switchhead train: {note}")
            log_event(config.output_dir, f"step {step}: {note}")
        root = os.path.join(config.output_dir, "checkpoints")  # folders of interrupted saves are not checkpoints
        for name in os.listdir(root) if os.path.isdir(root) else []:
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return step, skipped_updates, memory


# ================================================================================================ logs
class RunLog:
    """log.csv (and TensorBoard) of the main process. On resume the CSV is cut back to the checkpoint's step, so
    the log of an interrupted and resumed run reads like that of an uninterrupted one."""

    def __init__(self, output_dir: str, start_step: int, tensorboard: bool, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(output_dir, "log.csv")
        self.writer = None
        if not enabled:
            return
        rows = []
        if start_step > 0 and os.path.exists(self.path):
            with open(self.path, newline="") as handle:
                rows = [row for row in csv.DictReader(handle) if int(row["step"]) <= start_step]
        with atomic_file(self.path) as temporary:  # a fresh name: a link planted in the run folder is not followed
            with open(temporary, "w", newline="") as handle:
                writer = csv.DictWriter(handle, LOG_FIELDS)
                writer.writeheader()
                writer.writerows(rows)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra (pip install switchhead[train])
                SummaryWriter = None
            if SummaryWriter is not None:
                self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=start_step + 1)

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", newline="") as handle:
            csv.DictWriter(handle, LOG_FIELDS).writerow(row)
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    self.writer.add_scalar(f"train/{key}" if "valid" not in key else f"valid/{key}", value, row["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ================================================================================================ the guard
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


def _weights_finite(model, accelerator) -> bool:
    """Every parameter finite (one host sync; checked before each save so nothing non-finite is written)."""
    flags = torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()
    if accelerator.num_processes > 1:  # FSDP shards: every process checks its own
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


# ================================================================================================ the loop
def train(config: TrainingConfig) -> TrainResult:
    """Run (or resume) the pretraining job `config` describes; returns the final numbers.

    The main process holds the run folder's lock (`FolderLock`) from before anything is checked or written until
    the run ends, however it ends; a second writer gets TrainingError naming the holder."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    check_processes_joined(accelerator)
    with run_folder_lock(accelerator, config.output_dir):
        return _train(config, accelerator)


def _train(config: TrainingConfig, accelerator) -> TrainResult:
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    started = time.time()
    is_main = accelerator.is_main_process
    config, resume = open_run(config, accelerator)
    data = load_data(config, accelerator, fresh=resume is None)

    # ---------------------------------------------------------------- model and optimizer
    set_seed(config.seed)  # the same initial weights in every process
    model = SwitchHeadForCausalLM(data.model_config)
    num_parameters = model.num_parameters()
    memory_supported = (data.model_config.position_encoding == "xl" and data.model_config.xl_memory_length > 0
                        and "xl_memory" in inspect.signature(model.forward).parameters)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=config.adam_betas,
                                  weight_decay=config.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    accumulation = config.gradient_accumulation_steps
    memory: list = [None] * accumulation  # XL memory of each micro-batch slot (each is its own set of streams)
    step, skipped_updates = 0, 0
    if resume is not None:
        step, skipped_updates, memory = restore_checkpoint(accelerator, config, resume)

    log = RunLog(config.output_dir, step, config.tensorboard, is_main)
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
    while step < config.max_steps:
        learning_rate = learning_rate_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        if data.train_batches.segment_index(step) == 0:
            memory = [None] * accumulation  # a new pass over the streams: no previous segment to remember

        step_loss, step_memory = accumulate_gradients(model, data.train_batches, step, memory, accumulation,
                                                      accelerator, memory_supported)
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
                valid_loss = evaluate(model, data.valid_batches, accelerator, memory_supported, config.eval_batches)
                row.update(valid_loss=repr(valid_loss), valid_perplexity=f"{math.exp(valid_loss):.4f}")
            log.write(row)
            tick, steps_since_tick = time.time(), 0  # validation and logging time is not training throughput
            progress.set_postfix(loss=f"{loss_value:.3f}", ppl=f"{math.exp(valid_loss):.1f}"
                                 if valid_loss == valid_loss else "-")
        if step % config.save_every == 0 or step == config.max_steps:
            guard.check_weights(model, step, loss_value, grad_norm)
            save_checkpoint(accelerator, config.output_dir, step, config, memory, guard.skipped_updates)
    progress.close()
    log.close()

    # ---------------------------------------------------------------- the result folder
    save_final_model(accelerator, model, data.tokenizer, config.output_dir)
    if valid_loss != valid_loss:  # resumed at the last step: nothing was evaluated in this process
        valid_loss = evaluate(model, data.valid_batches, accelerator, memory_supported, config.eval_batches)
    accelerator.end_training()
    return TrainResult(config.output_dir, step, loss_value, valid_loss, math.exp(valid_loss), data.unigram,
                       num_parameters, time.time() - started)


def accumulate_gradients(model, batches: TokenBatches, step: int, memory: list, accumulation: int, accelerator,
                         memory_supported: bool) -> tuple[torch.Tensor, list]:
    """Forward and backward of the step's `accumulation` micro-batches. Returns the step's mean loss (a tensor: no
    host sync) and the XL memory each micro-batch slot carries on, as a new list: `memory` stays as it was, for a
    step whose update is not applied."""
    step_loss = torch.zeros((), device=accelerator.device)
    carried = list(memory)
    for micro in range(accumulation):
        rows = batches.micro_batch(step, micro, accelerator.process_index, accelerator.num_processes,
                                   accumulation).to(accelerator.device)
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
    return torch.as_tensor(grad_norm, device=accelerator.device)


# ================================================================================================ the run folder
@dataclass
class Resume:
    """The checkpoint a run continues from: its folder, its trainer state, notes for the user and events.log, and
    whether its RNG state allows an exact continuation."""

    path: str
    state: dict[str, Any]
    notes: list[str]
    exact: bool


@dataclass
class RunData:
    """The tokenizer, the model configuration that fits it, and the token streams of a run."""

    tokenizer: Any
    model_config: SwitchHeadConfig
    train_batches: TokenBatches
    valid_batches: TokenBatches
    unigram: float  # perplexity of the training split's unigram distribution on the validation split
    train_tokens: int
    valid_tokens: int


def check_processes_joined(accelerator) -> None:
    """TrainingError when more processes were launched than Accelerate joined: each would train alone into the
    same folder."""
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > accelerator.num_processes:  # e.g. an FSDP / multi-GPU Accelerate config on a CPU-only machine
        raise TrainingError(
            f"{launched} processes were launched but Accelerate joined none of them (it found no GPU and "
            f"ACCELERATE_USE_CPU is not set), so each would train alone into the same folder: use `switchhead train "
            f"--accelerate-config FILE`, or set ACCELERATE_USE_CPU=true to train on CPU processes (gloo)")


@contextlib.contextmanager
def run_folder_lock(accelerator, output_dir: str):
    """Hold `output_dir`'s FolderLock in the main process for the body; every process raises TrainingError when
    the main one cannot take it."""
    lock, lock_error = None, None
    if accelerator.is_main_process:
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            lock_error = f"--output-dir {output_dir!r} is a file, not a folder; choose a new folder"
        else:
            try:
                lock = FolderLock(output_dir, "train").acquire()
            except (ValueError, OSError) as error:  # FolderLocked, or the folder cannot be created
                lock_error = f"--output-dir: {error}"
    if accelerator.num_processes > 1:  # every process stops when the main one could not lock the folder
        flag = torch.tensor([0.0 if lock_error is None else 1.0], device=accelerator.device)
        if float(accelerator.reduce(flag, reduction="sum")) > 0:
            if lock is not None:
                lock.release()
            raise TrainingError(lock_error or f"--output-dir {output_dir!r} could not be locked (see the main "
                                              "process)")
    elif lock_error is not None:
        raise TrainingError(lock_error)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def open_run(config: TrainingConfig, accelerator) -> tuple[TrainingConfig, Resume | None]:
    """The output folder's rules (`check_output_dir`; `overwrite` clears the old run) and the resume rule: with
    `resume`, the checkpoint to continue from and the run's stored configuration, in which only the options of
    CHANGEABLE_ON_RESUME take the new values."""
    check_output_dir(config)
    if accelerator.is_main_process and config.overwrite and os.path.isdir(config.output_dir):
        clear_run(config.output_dir)
    accelerator.wait_for_everyone()
    resume = None
    if config.resume:
        path, notes, exact = choose_checkpoint(config)
        state = read_checkpoint_state(path)
        config = merge_resumed_config(config, state["config"])
        resume = Resume(path, state, notes, exact)
    if config.preset not in PRESETS:
        raise TrainingError(f"unknown preset {config.preset!r}; choose one of: {', '.join(sorted(PRESETS))}")
    return config, resume


def load_data(config: TrainingConfig, accelerator, fresh: bool) -> RunData:
    """Documents, tokenizer and token streams. A fresh run checks its settings (and loads a given tokenizer)
    before anything is written, then writes the run marker, then the tokenizer."""
    train_documents, valid_documents = load_documents(config.data, config.text_field, config.valid_data,
                                                      config.valid_fraction)
    given_tokenizer = None
    if fresh:  # bad settings (and a tokenizer that does not load) fail before anything is written
        check_config(config, build_model_config(config, None), accelerator.num_processes)
        if config.tokenizer:
            given_tokenizer = load_tokenizer(config.tokenizer)
        if accelerator.is_main_process:  # the run marker goes first: from here on the folder is this run's
            os.makedirs(config.output_dir, exist_ok=True)
            _write_json(os.path.join(config.output_dir, RUN_MARKER), config.to_dict())
    accelerator.wait_for_everyone()
    tokenizer = prepare_tokenizer(config, train_documents, accelerator, given_tokenizer)
    model_config = build_model_config(config, tokenizer)
    check_config(config, model_config, accelerator.num_processes)
    train_ids = tokenize_documents(tokenizer, train_documents)
    valid_ids = tokenize_documents(tokenizer, valid_documents)
    ordered = model_config.position_encoding == "xl"  # XL memory needs each row to continue the previous segment
    train_batches = TokenBatches(train_ids, config.block_size, config.batch_size, config.seed, ordered)
    eval_rows = max(1, min(config.batch_size, valid_ids.numel() // (config.block_size * 2)))
    eval_rows = max(accelerator.num_processes, eval_rows // accelerator.num_processes * accelerator.num_processes)
    try:
        valid_batches = TokenBatches(valid_ids, config.block_size, eval_rows, ordered=True)
    except DataError as error:
        raise DataError(f"validation split: {error}") from None
    return RunData(tokenizer, model_config, train_batches, valid_batches,
                   unigram_perplexity(train_ids, valid_ids, len(tokenizer)), train_ids.numel(), valid_ids.numel())


def prepare_tokenizer(config: TrainingConfig, train_documents: list[str], accelerator, given=None):
    """The run's tokenizer: the one saved in `output_dir` (resume), the given folder (`given`: already loaded from
    it), or a BPE trained on the training split by the main process and saved to `output_dir` for the others (all
    processes must agree)."""
    if config.resume:
        if not os.path.exists(os.path.join(config.output_dir, "tokenizer_config.json")):
            raise TrainingError(f"--resume: {config.output_dir!r} has no saved tokenizer; resume into the run's own "
                                "--output-dir")
        return load_tokenizer(config.output_dir)
    if accelerator.is_main_process:
        if given is not None:
            tokenizer = given
        elif config.tokenizer:
            tokenizer = load_tokenizer(config.tokenizer)
        else:
            tokenizer = train_tokenizer(train_documents, config.vocab_size)
        os.makedirs(config.output_dir, exist_ok=True)
        _save_into(config.output_dir, tokenizer.save_pretrained)
    accelerator.wait_for_everyone()
    return tokenizer if accelerator.is_main_process else load_tokenizer(config.output_dir)


@torch.no_grad()
def evaluate(model, batches: TokenBatches, accelerator, memory_supported: bool, max_batches: int) -> float:
    """Mean next-token loss over the validation stream (in order, XL memory carried), over all processes."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # [sum of losses * tokens, tokens]
    memory = None
    steps = len(batches) if max_batches == 0 else min(len(batches), max_batches)
    for step in range(steps):
        rows = batches.micro_batch(step, 0, accelerator.process_index, accelerator.num_processes, 1)
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



# ================================================================================================ saving
def check_output_dir(config: TrainingConfig) -> None:
    """`train` writes only into a new or empty folder, or into one of its own runs with resume / overwrite."""
    folder = config.output_dir
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise TrainingError(f"--output-dir {folder!r} is a file, not a folder; choose a new folder")
    if config.resume and config.overwrite:
        raise TrainingError("--resume continues a run and --overwrite starts it over: give only one")
    # (a marker whose atomic write was interrupted does not make the folder anyone else's)
    if not os.path.isdir(folder) or not [e for e in os.listdir(folder) if e not in (RUN_MARKER + ".tmp", LOCK_NAME)]:
        return
    if not os.path.isfile(os.path.join(folder, RUN_MARKER)):
        raise TrainingError(f"--output-dir {folder!r} is not empty and is not a switchhead training run; choose a "
                            "new or empty folder (nothing was written)")
    if not config.resume and not config.overwrite:
        raise TrainingError(f"--output-dir {folder!r} holds a training run: pass --resume to continue it or "
                            "--overwrite to start it over (deleting its checkpoints, logs and model)")


def clear_run(folder: str) -> None:
    """--overwrite: delete what a run wrote into `folder` (its files named in its manifest and the run's own
    files and folders); anything else the user put there stays."""
    names = {RUN_MARKER, "log.csv", "log.csv.tmp", EVENTS, MANIFEST, "checkpoints", "tensorboard", ".tmp-save"}
    try:
        names |= set(read_manifest(folder))
    except ValueError:
        pass
    for name in sorted(names - {RUN_MARKER}) + [RUN_MARKER]:  # the marker last: an interrupted clear stays ours
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)


def _write_json(path: str, content: dict) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(content, handle, indent=1)
    os.replace(path + ".tmp", path)


def save_final_model(accelerator, model, tokenizer, output_dir: str) -> None:
    """Write the run folder's save_pretrained model, tokenizer and manifest (main process; every process gathers
    the weights). A failed write raises TrainingError; the checkpoints stay intact for a resume."""
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # gathers the full weights under FSDP; every process calls it
    if accelerator.is_main_process:
        try:
            _save_model(accelerator.unwrap_model(model), state_dict, tokenizer, output_dir)
        except Exception as error:  # noqa: BLE001 - only write failures are turned into a message
            reason = _write_failure(error)
            if reason is None:
                raise
            found = checkpoint_dirs(output_dir)
            raise TrainingError(f"cannot write the final model into {output_dir!r} ({reason}); the "
                                f"checkpoints are intact ({'newest: ' + found[-1] if found else 'none'}); free some "
                                "space and resume with --resume to finish the save") from None
    accelerator.wait_for_everyone()


def _save_model(model, state_dict, tokenizer, output_dir: str) -> None:
    """save_pretrained (safetensors, model code for trust_remote_code) plus the tokenizer, file by file atomic."""
    def write(folder):
        model.save_pretrained(folder, state_dict=state_dict)
        tokenizer.save_pretrained(folder)
        written.extend(os.listdir(folder))
    written: list[str] = []
    manifest = os.path.join(output_dir, MANIFEST)
    if os.path.exists(manifest):  # the files it vouches for are about to be replaced
        os.remove(manifest)
    _save_into(output_dir, write)
    write_manifest(output_dir, written)  # last: the model folder is complete


def _save_into(output_dir: str, write) -> None:
    """Let `write` fill a temporary folder, then move each file into `output_dir` with an atomic rename: a file
    there is always either the old complete one or the new complete one."""
    temporary = os.path.join(output_dir, ".tmp-save")
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    try:
        write(temporary)
        for name in os.listdir(temporary):
            os.replace(os.path.join(temporary, name), os.path.join(output_dir, name))
    finally:
        shutil.rmtree(temporary, ignore_errors=True)  # nothing half-written stays behind (a full disk)


__all__ = ["TINY_TRAINING", "TrainResult", "TrainingConfig", "TrainingDiverged", "TrainingError", "choose_checkpoint",
           "learning_rate_at", "train"]
