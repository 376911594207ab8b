"""Writing a run's checkpoints (closed with a SHA-256 manifest, renamed into place when complete) and choosing the
one a resume continues from (the newest intact one, with its notes); the files inside a checkpoint are
`checkpoint_files`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from typing import Any

from ..integrity import make_folder, open_append, write_manifest
from ..integrity.files import Folder, new_folder_mode, write_bytes
from .checkpoint_files import (CHECKPOINT_STATE, MAX_PROCESSES, RngStateError, checkpoint_dirs, inspect_checkpoint,
                               read_memory, read_rng_state, restore_rng_state, unloadable_file, write_process_states)
from .run_config import CHANGEABLE_ON_RESUME, TrainingConfig, TrainingError


EVENTS = "events.log"


def log_event(output_dir: str, message: str) -> None:
    """Append one line to the run's events.log (main process only), never through a link (`open_append`)."""
    with open_append(os.path.join(output_dir, EVENTS)) as handle:
        handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {message}\n")


def save_checkpoint(accelerator, output_dir: str, step: int, config: TrainingConfig, memory: list,
                    skipped_updates: int = 0, placement=None) -> str:
    """Write model, optimizer (the placement's `save_state`), RNG states, XL memory and the step, then the SHA-256
    manifest; atomically (temporary folder, then rename). A failed write (a full disk, a quota) raises TrainingError
    naming the folder and leaves every earlier checkpoint as it was."""
    from .placement import AcceleratePlacement

    placement = placement or AcceleratePlacement(accelerator)
    root = os.path.join(output_dir, "checkpoints")
    final = os.path.join(root, f"step-{step:07d}")
    folder = staged = None
    try:
        if accelerator.is_main_process:
            make_folder(root)  # checkpoints/ is the run's own: a link to another folder is refused, nothing entered
            folder = Folder.open(root)
            # a private folder of a random name (integrity.files): nothing can be planted there beforehand, and a
            # folder renamed or linked to its name meanwhile is refused by `publish_as`
            staged = folder.private(f".tmp-step-{step:07d}-")
        if accelerator.num_processes > 1:  # every process writes into it by name: it learns the name, the main
            from accelerate.utils import broadcast_object_list  # process checks the folder before publishing it

            temporary = os.path.join(root, broadcast_object_list([staged.name if staged else None])[0])
        else:
            temporary = staged.here  # through the descriptor: the folder itself, whatever is at its name
        accelerator.wait_for_everyone()
        placement.save_state(temporary)
        write_process_states(accelerator, temporary, memory)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            state = dict(step=step, num_processes=accelerator.num_processes, config=config.to_dict(),
                         skipped_updates=skipped_updates)
            write_bytes(os.path.join(temporary, CHECKPOINT_STATE), json.dumps(state, indent=1))
            write_manifest(temporary)  # last: its presence marks the checkpoint complete
            name = os.path.basename(final)
            existing = folder.lstat(name)
            if existing is not None and stat.S_ISDIR(existing.st_mode):  # the same step saved again (a resumed
                shutil.rmtree(name, dir_fd=folder.fd)  # run): replace the whole folder (never through a link)
            staged.publish_as(name, mode=new_folder_mode())
            for old in checkpoint_dirs(output_dir)[: -config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
    except Exception as error:  # noqa: BLE001 - only write failures are turned into a message, see _write_failure
        reason = _write_failure(error)
        if reason is None:
            raise
        found = checkpoint_dirs(output_dir)
        raise TrainingError(f"cannot write the checkpoint of step {step} into {root!r} ({reason}); earlier "
                            f"checkpoints are intact ({'newest: ' + found[-1] if found else 'none yet'}); free some "
                            "space and resume with --resume") from None
    finally:  # an incomplete checkpoint is never left behind, whatever failed; earlier checkpoints are untouched
        if staged is not None:
            staged.remove()
        if folder is not None:
            folder.close()
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
    fields = {f.name: f for f in dataclasses.fields(TrainingConfig)}
    known = set(fields)
    if not isinstance(stored, dict):
        raise TrainingError(f"--resume: the checkpoint's {CHECKPOINT_STATE} holds no settings object")
    unknown = sorted(set(stored) - known)
    if unknown:  # a misspelt or foreign setting: dropping it would resume another run than the one saved
        raise TrainingError(f"--resume: the checkpoint's {CHECKPOINT_STATE} has settings this release does not know "
                            f"({', '.join(map(str, unknown[:5]))}); it was not written by this release's train")
    for name, value in stored.items():
        if not _of_annotated_type(value, fields[name].type):
            raise TrainingError(f"--resume: the checkpoint's {CHECKPOINT_STATE} has {name} = {str(value)[:40]!r} "
                                f"({type(value).__name__}), but {name} is {fields[name].type}; the file is damaged")
    resumed = TrainingConfig(**{name: value for name, value in stored.items() if name in known})
    different = [f"{name} ({getattr(resumed, name)!r} -> {getattr(config, name)!r})"
                 for name in stored if name in known and name not in CHANGEABLE_ON_RESUME
                 and getattr(config, name) != stored[name]]
    if different:
        raise TrainingError("--resume continues a run with its own settings; these differ: " + ", ".join(different))
    for name in CHANGEABLE_ON_RESUME:
        setattr(resumed, name, getattr(config, name))
    return resumed


def _of_annotated_type(value, annotation) -> bool:
    """Whether a JSON value fits a TrainingConfig field's annotation ('int', 'str | None', 'tuple[float, float]',
    'dict[str, Any]', ...): a bool is no number, an int is a float, a JSON list is a tuple."""
    for part in str(annotation).split("|"):
        part = part.strip()
        base = part.split("[", 1)[0]
        if base == "None" and value is None:
            return True
        if base == "bool" and isinstance(value, bool):
            return True
        if isinstance(value, bool):
            continue
        if (base == "int" and isinstance(value, int)) or (base == "float" and isinstance(value, (int, float))) \
                or (base == "str" and isinstance(value, str)) or (base == "dict" and isinstance(value, dict)) \
                or (base in ("tuple", "list") and isinstance(value, (list, tuple))):
            return True
        if base not in ("None", "bool", "int", "float", "str", "dict", "tuple", "list"):
            return True  # an annotation this check does not model: left to the settings checks
    return False


@dataclass
class Resume:
    """The checkpoint a run continues from: its folder, its trainer state, notes for the user and events.log, and
    whether its RNG state allows an exact continuation."""

    path: str
    state: dict[str, Any]
    notes: list[str]
    exact: bool


def check_optimizer_state(optimizers) -> None:
    """ValueError naming the first parameter whose loaded optimizer state (AdamW's moments) has another shape than
    the parameter: torch's `load_state_dict` checks only the number of parameters per group, so a checkpoint of
    another model width loaded and then failed at the first step with a traceback from inside the optimizer."""
    import torch

    for optimizer in optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps torch's
        for group_index, group in enumerate(inner.param_groups):
            for index, param in enumerate(group["params"]):
                for key, value in inner.state.get(param, {}).items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                        raise ValueError(f"the optimizer's {key!r} of parameter {index} (group {group_index}) has "
                                         f"shape {tuple(value.shape)}, the parameter {tuple(param.shape)}")


def restore_checkpoint(accelerator, config: TrainingConfig, resume: "Resume", placement=None) -> tuple[int, int, list]:
    """Load `resume`'s model, optimizer and XL memory, and its RNG states when they allow an exact continuation;
    returns (step, skipped updates, XL memory). The main process reports the resume notes (and writes them to
    events.log) and removes the folders of interrupted saves."""
    from .placement import AcceleratePlacement

    checkpoint = resume.path
    try:
        (placement or AcceleratePlacement(accelerator)).load_state(checkpoint)  # model and optimizer
        memory = read_memory(checkpoint, accelerator.process_index, accelerator.device)
    except Exception as error:  # noqa: BLE001 - truncated or foreign files fail in many ways
        culprit = unloadable_file(checkpoint, accelerator.process_index) or \
            f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        raise TrainingError(f"--resume: checkpoint {checkpoint!r} is corrupt or incomplete ({culprit})") from None
    try:
        check_optimizer_state(getattr(accelerator, "_optimizers", []))
    except ValueError as error:
        raise TrainingError(f"--resume: checkpoint {checkpoint!r} does not fit this run's model ({error}); resume "
                            "with the model settings it was saved with") from None
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
