"""What a checkpoint folder of `switchhead train` holds, and how each file is written and read back safely.

    OUTPUT/checkpoints/step-NNNNNNN/
        model.safetensors, optimizer.bin, ...   Accelerate's `save_state` (its pickled RNG file is replaced)
        rng_state_P.safetensors                 process P's generators: torch (CPU, CUDA), Python, NumPy
        xl_memory_P.safetensors                 process P's XL memory of each micro-batch slot
        trainer_state.json                      step, processes, the TrainingConfig, skipped updates
        SHA256SUMS                              the manifest, written last

Nothing a resume reads is fully unpickled unless `allow_pickle` says so: the model is safetensors, the RNG states
and XL memory are safetensors with JSON metadata, the optimizer state (Accelerate's `optimizer.bin`) goes through
torch's restricted loader (`weights_only=True`, which refuses any object that could run code). Older checkpoints
keep their RNG state in `random_states_P.pkl` (Accelerate's pickle) and their XL memory in `xl_memory_P.pt`; both
are read with the restricted loader, and the RNG pickle is fully unpickled only with `allow_pickle`
(`--allow-pickle`) when that loader refuses it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..integrity import MANIFEST, read_manifest, verify_manifest

CHECKPOINT_STATE = "trainer_state.json"  # written last: its presence marks a complete checkpoint
# the most processes a checkpoint's trainer_state.json may claim (it is read before anything verifies it)
MAX_PROCESSES = 1 << 20


def checkpoint_dirs(output_dir: str) -> list[str]:
    """Checkpoints of a run, oldest first (temporary folders of interrupted saves are not listed; whether a listed
    one is still intact is for `inspect_checkpoint` to say)."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step-") and
                   (os.path.isfile(os.path.join(root, n, MANIFEST))
                    or os.path.isfile(os.path.join(root, n, CHECKPOINT_STATE))))
    return [os.path.join(root, n) for n in names]


RNG_FILE = "rng_state_{}.safetensors"  # per process: torch (CPU, CUDA), Python and NumPy generators
LEGACY_RNG_FILE = "random_states_{}.pkl"  # Accelerate's pickle, written by checkpoints before the format above
MEMORY_FILE = "xl_memory_{}.safetensors"  # per process: the XL memory of each micro-batch slot
LEGACY_MEMORY_FILE = "xl_memory_{}.pt"
RNG_FORMAT = "switchhead-rng-1"


class RngStateError(ValueError):
    """An RNG state file that is missing, damaged, foreign, or refused without `allow_pickle` (one-line reason)."""


def _rng_file(name: str) -> bool:
    base = os.path.basename(name)
    return base.startswith(("random_states_", "rng_state_"))


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's generators as (tensors, string metadata) for a safetensors file: exact, no pickle."""
    import random

    import numpy as np

    version, words, gauss_next = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    tensors = {"torch_cpu": torch.get_rng_state(),
               "python_words": torch.tensor(words, dtype=torch.int64),
               "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64))}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = state
    metadata = {"format": RNG_FORMAT, "python_version": json.dumps(version), "python_gauss_next": json.dumps(gauss_next),
                "numpy_kind": str(kind), "numpy_position": json.dumps(int(position)),
                "numpy_has_gauss": json.dumps(int(has_gauss)), "numpy_cached_gaussian": json.dumps(float(cached_gaussian)),
                "cuda_devices": json.dumps(torch.cuda.device_count() if torch.cuda.is_available() else 0)}
    return tensors, metadata


def write_rng_state(folder: str, process_index: int, state=None) -> str:
    """Process `process_index`'s RNG state (`state` from `capture_rng_state`; default: this process's now)."""
    from safetensors.torch import save_file

    tensors, metadata = capture_rng_state() if state is None else state
    path = os.path.join(folder, RNG_FILE.format(process_index))
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, path, metadata=metadata)
    return path


def _legacy_rng_state(path: str, allow_pickle: bool) -> dict[str, Any]:
    """Accelerate's pickled RNG dictionary, through torch's restricted loader (with the NumPy types Accelerate itself
    allows); a full unpickle only when `allow_pickle`."""
    from accelerate.utils import load as restricted_load

    try:
        return restricted_load(path, map_location="cpu")  # weights_only=True: refuses anything that could run code
    except Exception as error:  # noqa: BLE001 - a refused or damaged pickle fails in many ways
        if not allow_pickle:
            raise RngStateError(f"{os.path.basename(path)} is an older pickled RNG state that the restricted loader "
                                f"refuses ({type(error).__name__}); pass --allow-pickle to unpickle it (only for a "
                                "checkpoint you trust: unpickling can run code stored in the file)") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)  # the user allowed it (--allow-pickle)
    except Exception as error:  # noqa: BLE001
        raise RngStateError(f"unreadable {os.path.basename(path)} ({type(error).__name__})") from None


def read_rng_state(folder: str, process_index: int, allow_pickle: bool = False) -> dict[str, Any]:
    """The RNG state of one process as {"torch_cpu", "torch_cuda" (list), "python" (tuple), "numpy" (tuple)};
    RngStateError naming the file when it is missing, damaged or refused."""
    import numpy as np

    path = os.path.join(folder, RNG_FILE.format(process_index))
    legacy = os.path.join(folder, LEGACY_RNG_FILE.format(process_index))
    if not os.path.isfile(path):
        if not os.path.isfile(legacy):
            raise RngStateError(f"missing {RNG_FILE.format(process_index)}")
        states = _legacy_rng_state(legacy, allow_pickle)
        try:
            return {"torch_cpu": states["torch_manual_seed"], "torch_cuda": list(states.get("torch_cuda_manual_seed", [])),
                    "python": states["random_state"], "numpy": states["numpy_random_seed"]}
        except (KeyError, TypeError) as error:
            raise RngStateError(f"unreadable {LEGACY_RNG_FILE.format(process_index)} (no {error})") from None
    from safetensors import safe_open

    name = RNG_FILE.format(process_index)
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        if metadata.get("format") != RNG_FORMAT:
            raise ValueError(f"format {metadata.get('format')!r}, expected {RNG_FORMAT!r}")
        words = tuple(int(w) for w in tensors["python_words"].tolist())
        python = (json.loads(metadata["python_version"]), words, json.loads(metadata["python_gauss_next"]))
        numpy = (metadata["numpy_kind"], tensors["numpy_keys"].numpy().astype(np.uint32),
                 json.loads(metadata["numpy_position"]), json.loads(metadata["numpy_has_gauss"]),
                 json.loads(metadata["numpy_cached_gaussian"]))
        cuda = [tensors[f"torch_cuda_{i}"] for i in range(json.loads(metadata["cuda_devices"]))]
        cpu = tensors["torch_cpu"]
        if cpu.dtype != torch.uint8 or cpu.dim() != 1 or len(words) != 625 or numpy[1].shape != (624,):
            raise ValueError("tensor shapes or types are not those of RNG states")
    except Exception as error:  # noqa: BLE001 - a damaged file fails in many ways; say which file
        raise RngStateError(f"unreadable {name} ({type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''})") from None
    return {"torch_cpu": cpu, "torch_cuda": cuda, "python": python, "numpy": numpy}


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's generators; RngStateError when the state does not fit them (then nothing is exact)."""
    import random

    import numpy as np

    try:
        torch.set_rng_state(state["torch_cpu"])
        random.setstate(tuple(state["python"]))
        np.random.set_state(tuple(state["numpy"]))
        if torch.cuda.is_available():
            if len(state["torch_cuda"]) != torch.cuda.device_count():
                raise ValueError(f"the checkpoint holds {len(state['torch_cuda'])} CUDA generator states, this "
                                 f"machine has {torch.cuda.device_count()} GPUs")
            torch.cuda.set_rng_state_all(state["torch_cuda"])
    except Exception as error:  # noqa: BLE001
        raise RngStateError(f"the RNG state does not load ({type(error).__name__}: {error})") from None


def write_memory(folder: str, process_index: int, memory: list) -> None:
    """XL memory of every micro-batch slot (None, or a tuple / list of per-layer tensors) as safetensors + JSON."""
    from safetensors.torch import save_file

    tensors, layout = memory_record(memory)
    save_file(tensors, os.path.join(folder, MEMORY_FILE.format(process_index)),
              metadata={"layout": json.dumps(layout)})


def write_process_states(accelerator, folder: str, memory: list) -> None:
    """Every process's RNG state and XL memory, gathered (Accelerate's `gather_object`) and written by the main
    process alone: rng_state_P.safetensors and xl_memory_P.safetensors for each process P."""
    from accelerate.utils import gather_object

    mine = [(capture_rng_state(), memory_record(memory))]
    states = gather_object(mine) if accelerator.num_processes > 1 else mine
    if accelerator.is_main_process:
        from safetensors.torch import save_file

        for index, (rng, (tensors, layout)) in enumerate(states):
            write_rng_state(folder, index, rng)
            save_file(tensors, os.path.join(folder, MEMORY_FILE.format(index)), metadata={"layout": json.dumps(layout)})


def memory_record(memory: list) -> tuple[dict[str, torch.Tensor], list]:
    """(CPU tensors, layout) of the XL memory of every micro-batch slot, as `write_memory` stores them."""
    tensors, layout = {}, []
    for slot, entry in enumerate(memory):
        if entry is None:
            layout.append(None)
            continue
        items = [entry] if isinstance(entry, torch.Tensor) else list(entry)
        if not all(isinstance(item, torch.Tensor) for item in items):
            raise TypeError(f"XL memory slot {slot} holds {type(entry).__name__}, not tensors")
        kind = "tensor" if isinstance(entry, torch.Tensor) else type(entry).__name__
        layout.append([kind, len(items)])
        for index, item in enumerate(items):
            tensors[f"{slot}.{index}"] = item.detach().to("cpu").contiguous().clone()
    return tensors, layout


def read_memory(folder: str, process_index: int, device) -> list:
    """The XL memory `write_memory` wrote (or an older checkpoint's `xl_memory_P.pt`, restricted loader)."""
    path = os.path.join(folder, MEMORY_FILE.format(process_index))
    if not os.path.isfile(path):
        legacy = os.path.join(folder, LEGACY_MEMORY_FILE.format(process_index))
        return torch.load(legacy, map_location=device, weights_only=True)  # refuses anything that could run code
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        layout = json.loads((handle.metadata() or {})["layout"])
        memory = []
        for slot, entry in enumerate(layout):
            if entry is None:
                memory.append(None)
                continue
            kind, count = entry
            items = [handle.get_tensor(f"{slot}.{index}").to(device) for index in range(count)]
            memory.append(items[0] if kind == "tensor" else (list(items) if kind == "list" else tuple(items)))
    return memory


def unloadable_file(folder: str, process_index: int) -> str | None:
    """After a failed load: the first file of the checkpoint that does not load on its own, as 'NAME does not load
    (reason)', read the same safe way the resume reads it (None when each loads alone)."""
    from safetensors import safe_open

    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        try:
            if name.endswith(".safetensors") and not _rng_file(name) and not name.startswith("xl_memory_"):
                with safe_open(path, framework="pt") as handle:
                    for key in handle.keys():
                        handle.get_slice(key)
            elif name.endswith(".bin"):
                torch.load(path, map_location="cpu", weights_only=True)  # refuses anything that could run code
            elif name in (MEMORY_FILE.format(process_index), LEGACY_MEMORY_FILE.format(process_index)):
                read_memory(folder, process_index, "cpu")
        except Exception as error:  # noqa: BLE001 - this is the diagnosis
            text = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
            return f"{name} does not load: {type(error).__name__}{': ' + text if text else ''}"
    return None


def inspect_checkpoint(path: str, allow_pickle: bool = False) -> tuple[list[str], list[str]]:
    """(problems, RNG problems) of a checkpoint folder: files that changed or are missing against its SHA-256
    manifest, or that the manifest does not list (not written by the run), split into the RNG states (resumable,
    inexactly, with `inexact_resume`) and everything else. Every process's RNG state is also read (safely: see the
    module docstring), so one that would not load is found here, before anything is resumed."""
    has_manifest = os.path.isfile(os.path.join(path, MANIFEST))
    problems = verify_manifest(path) if has_manifest else []
    if has_manifest and not problems:
        listed = set(read_manifest(path))
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                relative = os.path.relpath(os.path.join(root, name), path).replace(os.sep, "/")
                if relative != MANIFEST and relative not in listed:
                    problems.append(f"unlisted {relative}")
    if not has_manifest and not os.path.isfile(os.path.join(path, CHECKPOINT_STATE)):
        problems.append(f"no {MANIFEST} or {CHECKPOINT_STATE}")
    # a changed or missing RNG state leaves the rest resumable (inexactly); a file the run did not write does not
    rng = [p for p in problems if not p.startswith("unlisted ") and _rng_file(p.split(" ", 1)[-1])]
    other = [p for p in problems if p not in rng]
    try:
        with open(os.path.join(path, CHECKPOINT_STATE)) as handle:
            processes = json.load(handle).get("num_processes", 1)
        if isinstance(processes, bool) or not isinstance(processes, int) or not 1 <= processes <= MAX_PROCESSES:
            raise ValueError(f"num_processes {str(processes)[:40]} is not an integer in [1, {MAX_PROCESSES}]")
    except (OSError, ValueError, TypeError, AttributeError) as error:
        if not other:
            other.append(f"unreadable {CHECKPOINT_STATE}" + (f" ({error})" if isinstance(error, ValueError) else ""))
        processes = 1
    if not other and not rng:
        for index in range(processes):
            try:
                read_rng_state(path, index, allow_pickle)
            except RngStateError as error:
                rng.append(str(error))
                break  # one is enough to make the resume inexact; the rest may be as many as num_processes says
    return other, rng


__all__ = ["CHECKPOINT_STATE", "MAX_PROCESSES", "RngStateError", "capture_rng_state", "checkpoint_dirs",
           "inspect_checkpoint", "memory_record", "read_memory", "read_rng_state", "restore_rng_state", "unloadable_file",
           "write_memory", "write_process_states", "write_rng_state"]
