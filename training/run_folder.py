"""A run's folder: its lock, the resume rule (`open_run`), its data and tokenizer (`load_data`), its log
(`RunLog`), and the final model saved into it (`save_final_model`).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from .. import PRESETS, SwitchHeadConfig
from ..integrity import LOCK_NAME, MANIFEST, FolderLock, atomic_file, make_folder, open_append, read_manifest, \
    write_manifest
from ..integrity.files import PARTIAL, check_target, save_into
from .checkpoint_files import checkpoint_dirs
from .checkpoints import (EVENTS, Resume, _write_failure, choose_checkpoint, merge_resumed_config,
                          read_checkpoint_state)
from .data import DataError, TokenBatches, load_documents, load_tokenizer, tokenize_documents, train_tokenizer, \
    unigram_perplexity
from .run_config import TrainingConfig, TrainingError, build_model_config, check_config
from .run_card import with_context, write_train_card


LOG_FIELDS = ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "peak_memory_mb", "valid_loss",
              "valid_perplexity", "skipped_updates")


RUN_MARKER = "training_config.json"  # marks a folder as a `switchhead train` run (written before anything else)


TRACKER_PROJECT = "switchhead"  # the trackers' project (W&B project, MLflow experiment); runs are named by folder


class RunLog:
    """log.csv of the main process, and the same rows for the run's experiment trackers (`accelerator`'s, started
    by `start_trackers`). On resume the CSV is cut back to the checkpoint's step, so the log of an interrupted and
    resumed run reads like that of an uninterrupted one. Rows are appended by `open_append` (opened again for each
    row, without following a link): a link planted at log.csv while the run goes on stops it instead of receiving
    the rows. With `tensorboard`, TensorBoard's folder (tensorboard/TRACKER_PROJECT) is created here, each level a
    folder, never a link to one, before a tracker writes into it."""

    def __init__(self, output_dir: str, start_step: int, tensorboard: bool, enabled: bool, accelerator=None):
        self.enabled = enabled
        self.path = os.path.join(output_dir, "log.csv")
        self.accelerator = accelerator
        if not enabled:
            return
        rows = []
        check_target(self.path)  # a link or a device at log.csv is neither read nor replaced
        if start_step > 0 and os.path.exists(self.path):
            with open(self.path, newline="") as handle:
                rows = [row for row in csv.DictReader(handle) if int(row["step"]) <= start_step]
        with atomic_file(self.path) as temporary:  # a fresh name: a link planted in the run folder is not followed
            with open(temporary, "w", newline="") as handle:
                writer = csv.DictWriter(handle, LOG_FIELDS)
                writer.writeheader()
                writer.writerows(rows)
        if tensorboard:
            make_folder(os.path.join(make_folder(tensorboard_dir(output_dir)), TRACKER_PROJECT))

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open_append(self.path, newline="") as handle:
            csv.DictWriter(handle, LOG_FIELDS).writerow(row)
        if self.accelerator is not None and self.accelerator.trackers:
            metrics = {(f"valid/{key}" if "valid" in key else f"train/{key}"): float(value)
                       for key, value in row.items() if key != "step" and value not in ("", None)}
            self.accelerator.log(metrics, step=int(row["step"]))

    def close(self) -> None:
        """The run ends here (a divergence stop): the trackers close their runs."""
        if self.accelerator is not None:
            finish_trackers(self.accelerator)


def tensorboard_dir(output_dir: str) -> str:
    """The folder the run's TensorBoard tracker writes under (Accelerate's `logging_dir`)."""
    return os.path.join(output_dir, "tensorboard")


def installed_trackers(names: list[str]) -> tuple[list[str], list[str]]:
    """(the trackers of `names` that can run, the built-in ones whose package is not installed); trackers
    registered with Accelerate (`accelerate.tracking.register_tracker_class`) count as installed."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    available = {getattr(tracker, "value", str(tracker)) for tracker in get_available_trackers()}
    built_in = {tracker.value for tracker in LoggerType}
    missing = [name for name in names if name in built_in and name not in available]
    return [name for name in names if name not in missing], missing


def start_trackers(accelerator, config: TrainingConfig, start_step: int) -> None:
    """`init_trackers` on the main process, with the run's settings flattened to scalars (nested fields as
    "model.hidden_size", lists joined by commas, unset ones left out). Resuming at `start_step`, TensorBoard drops
    the events its writer wrote after that step (purge_step), so the curve has no step twice; the other trackers
    start a new run of the same name."""
    if not accelerator.is_main_process or not accelerator.log_with:
        return
    settings: dict[str, Any] = {}

    def flatten(prefix: str, values: dict) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                flatten(f"{prefix}{key}.", value)
            elif isinstance(value, (list, tuple)):
                settings[prefix + key] = ",".join(str(item) for item in value)
            elif value is not None:
                settings[prefix + key] = value

    flatten("", config.to_dict())
    name = os.path.basename(os.path.abspath(config.output_dir))
    accelerator.init_trackers(TRACKER_PROJECT, config=settings,
                              init_kwargs={"tensorboard": {"purge_step": start_step + 1}, "wandb": {"name": name},
                                           "mlflow": {"run_name": name}})


def finish_trackers(accelerator) -> None:
    """Close the trackers' runs (TensorBoard flushes its events), once; `Accelerator.end_training` finds none left."""
    trackers, accelerator.trackers = list(accelerator.trackers), []
    for tracker in trackers:
        tracker.finish()


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


def load_data(config: TrainingConfig, accelerator, fresh: bool, data_count: int | None = None) -> RunData:
    """Documents, tokenizer and token streams. A fresh run checks its settings (and loads a given tokenizer)
    before anything is written, then writes the run marker, then the tokenizer. `data_count`: the processes that
    see distinct rows (default: all of them; fewer when tensor-parallel groups share their rows)."""
    data_count = accelerator.num_processes if data_count is None else data_count
    train_documents, valid_documents = load_documents(config.data, config.text_field, config.valid_data,
                                                      config.valid_fraction)
    given_tokenizer = None
    if fresh:  # bad settings (and a tokenizer that does not load) fail before anything is written
        check_config(config, build_model_config(config, None), data_count)
        if config.tokenizer:
            given_tokenizer = load_tokenizer(config.tokenizer)
        if accelerator.is_main_process:  # the run marker goes first: from here on the folder is this run's
            os.makedirs(config.output_dir, exist_ok=True)
            _write_json(os.path.join(config.output_dir, RUN_MARKER), config.to_dict())
    accelerator.wait_for_everyone()
    tokenizer = prepare_tokenizer(config, train_documents, accelerator, given_tokenizer)
    model_config = build_model_config(config, tokenizer)
    check_config(config, model_config, data_count)
    train_ids = tokenize_documents(tokenizer, train_documents)
    valid_ids = tokenize_documents(tokenizer, valid_documents)
    ordered = model_config.position_encoding == "xl"  # XL memory needs each row to continue the previous segment
    train_batches = TokenBatches(train_ids, config.block_size, config.batch_size, config.seed, ordered)
    eval_rows = max(1, min(config.batch_size, valid_ids.numel() // (config.block_size * 2)))
    eval_rows = max(data_count, eval_rows // data_count * data_count)
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


def check_output_dir(config: TrainingConfig) -> None:
    """`train` writes only into a new or empty folder, or into one of its own runs with resume / overwrite."""
    folder = config.output_dir
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise TrainingError(f"--output-dir {folder!r} is a file, not a folder; choose a new folder")
    if config.resume and config.overwrite:
        raise TrainingError("--resume continues a run and --overwrite starts it over: give only one")
    # (a marker whose atomic write was interrupted does not make the folder anyone else's)
    if not os.path.isdir(folder) or not [e for e in os.listdir(folder) if e not in (RUN_MARKER + ".tmp", LOCK_NAME)
                                         and not (e.startswith(PARTIAL) and e.endswith("-" + RUN_MARKER))]:
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
    with atomic_file(path) as temporary:  # a fresh name: a stale link at a fixed ".tmp" name is never written through
        with open(temporary, "w") as handle:
            json.dump(content, handle, indent=1)


def save_final_model(accelerator, model, tokenizer, output_dir: str, placement=None,
                     settings: dict | None = None) -> None:
    """Write the run folder's save_pretrained model, tokenizer (truncating to the model's context), manifest and
    model card (`settings`: the run's TrainingConfig as a dict, for the card; main process; every process gathers
    the weights). A failed write raises TrainingError; the checkpoints stay intact for a resume."""
    from .placement import AcceleratePlacement

    placement = placement or AcceleratePlacement(accelerator)
    accelerator.wait_for_everyone()
    state_dict = placement.full_state_dict(model)  # the full weights (gathered when sharded); every process calls it
    if accelerator.is_main_process:
        try:
            saveable = placement.saveable(model)
            _save_model(saveable, state_dict, with_context(tokenizer, saveable.config), output_dir)
            write_train_card(output_dir, saveable.config, settings)  # after the manifest: the user may edit it
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
    """Let `write` fill a private folder, then move each file into `output_dir` (`integrity.files.save_into`)."""
    save_into(output_dir, write, ".tmp-save-")
