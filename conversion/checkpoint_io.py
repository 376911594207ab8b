"""Reading and writing checkpoints safely: no code runs on load, nothing half-written is ever left behind.

- `load_torch_checkpoint` unpickles with `torch.load(weights_only=True)` (tensors, containers and numbers only).
  The authors' training checkpoints hold one non-tensor class, the framework's `DotDict` (a plain `dict`
  subclass under "state"); it is read back as a plain dict without importing or running anything. Any other
  object makes the load fail with a message naming `--allow-pickle`, which falls back to full unpickling:
  that executes whatever code the file carries, so use it only for files you trust.
- `atomic_output` gives a temporary path next to the destination and renames it into place only when the
  writer finished (fsync'd first), so an error (bad key, full disk) or a kill leaves the destination untouched;
  a file may replace an existing one this way (`overwrite=True`, `switchhead export --overwrite`).
- `save_hf_folder` / `load_hf_folder` write and read `save_pretrained` folders in safetensors, sharded above
  `max_shard_size`, with an optional dtype conversion on the way out.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Iterator

import torch
from safetensors.torch import load_file

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.checkpoint_format import rename_old_keys
from switchhead.integrity import atomic_file, check_saved_model, raise_if_stopped
from switchhead.integrity.files import check_target, fsync_folder, write_error
from switchhead.integrity.loading import weight_files


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the problem and what to change."""


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class _PlainDotDict:
    """Stand-in for `framework.data_structures.dotdict.DotDict`: unpickles as a plain dict, runs no code."""

    def __new__(cls, *args, **kwargs):
        return {}


_SAFE_AUTHORS_GLOBALS = [(_PlainDotDict, "framework.data_structures.dotdict.DotDict")]


def load_torch_checkpoint(path: str, allow_pickle: bool = False):
    """`torch.load` a file on the CPU, refusing anything but tensors and plain containers unless `allow_pickle`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such checkpoint file: {path}")
    try:
        with torch.serialization.safe_globals(_SAFE_AUTHORS_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):
            raise ConversionError(f"{path} is not a readable torch checkpoint ({error})") from None
        if not allow_pickle:
            detail = str(error).split("WeightsUnpickler error:")[-1].strip().splitlines()[0:1]
            raise ConversionError(
                f"{path} contains Python objects that a safe load (weights_only=True) refuses"
                f"{' (' + detail[0] + ')' if detail else ''}; rerun with --allow-pickle only if you trust the file's "
                f"source (full unpickling can execute arbitrary code)"
            ) from None
    except (RuntimeError, EOFError, OSError, KeyError, ValueError, IndexError, TypeError) as error:
        # KeyError / ValueError / IndexError: a file that is no checkpoint at all (a text file read as a pickle)
        raise ConversionError(f"{path} is not a readable torch checkpoint ({type(error).__name__}: {error})") from None
    warnings.warn(f"--allow-pickle: fully unpickling {path}; this runs any code stored in the file", stacklevel=2)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - e.g. the pickled classes' modules are not importable here
        raise ConversionError(f"{path} could not be unpickled even with --allow-pickle ({error})") from None


@contextlib.contextmanager
def atomic_output(destination: str, is_dir: bool, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary path beside `destination`; on success fsync it and rename it into place, on error delete it.

    Refuses an existing destination (a non-empty folder or any file) so that nothing the user has is replaced;
    with `overwrite` (files only) an existing file is replaced by that rename, so it stays whole until the new one is.
    """
    destination = os.path.abspath(destination)
    if os.path.islink(destination) or (os.path.lexists(destination) and not os.path.isdir(destination)):
        check_target(destination, overwrite and not is_dir)  # a link, a FIFO or a device is never replaced
    if os.path.isdir(destination) and (not is_dir or os.listdir(destination)):
        raise ConversionError(f"output {destination} already exists; choose a new path or delete it first")
    if os.path.lexists(destination) and not os.path.isdir(destination) and not (overwrite and not is_dir):
        raise ConversionError(f"output {destination} already exists; choose a new path or delete it first")
    parent = os.path.dirname(destination)
    if not os.path.isdir(parent):
        raise ConversionError(f"the folder of the output, {parent}, does not exist")
    if not is_dir:
        with atomic_file(destination) as target:
            yield target
        return
    try:
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(destination)}.partial-", dir=parent)
    except OSError as error:
        raise write_error(error, destination) from None
    try:
        yield staging
        _fsync_tree(staging)
        raise_if_stopped()
        if os.path.isdir(destination):
            os.rmdir(destination)  # an empty folder made by the user: replace it
        os.replace(staging, destination)
        fsync_folder(parent)
    except Exception as error:  # a full or read-only disk: one line naming the output (the CLI's `cannot write`)
        failure = write_error(error, destination)
        if failure is not error:
            raise failure from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fsync_tree(folder: str) -> None:
    """fsync every file under `folder` (and the folders), so that the rename publishes complete files."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_folder(root)


def save_hf_folder(state_dict: dict[str, torch.Tensor], config: SwitchHeadConfig, output: str,
                   dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB") -> None:
    """Write a `save_pretrained` folder (config, safetensors shards, model code) from our state dict.

    The state dict is loaded strictly into a fresh `SwitchHeadForCausalLM`, so the folder is known to load.
    """
    model = SwitchHeadForCausalLM(config)
    model.load_state_dict(state_dict, strict=True)
    if dtype is not None:
        model.to(dtype)
    model.eval()
    with atomic_output(output, is_dir=True) as staging:
        model.save_pretrained(staging, max_shard_size=max_shard_size)


def load_hf_folder(folder: str, verify: bool = True) -> tuple[SwitchHeadConfig, dict[str, torch.Tensor]]:
    """Config and tensors of a `save_pretrained` folder, read from its safetensors files (sharded or not), under
    today's names (a folder of an earlier release may hold the sigma-MoE tensors as `mlp.keys` / `mlp.values`).
    The folder is checked first (`switchhead.integrity.check_saved_model`; `verify=False` skips its manifest)."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConversionError(f"{folder} is not a saved model folder (it has no config.json)")
    check_saved_model(folder, verify=verify)
    config = SwitchHeadConfig.from_pretrained(folder)
    files = weight_files(folder)
    state_dict: dict[str, torch.Tensor] = {}
    for name in files:
        state_dict.update(load_file(os.path.join(folder, name)))
    rename_old_keys(state_dict)
    return config, state_dict


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


__all__ = ["ConversionError", "load_torch_checkpoint", "atomic_output", "save_hf_folder", "load_hf_folder",
           "parse_dtype", "DTYPES"]
