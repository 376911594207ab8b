"""switchhead.integrity: what every command that writes or loads a saved folder shares.

- `manifest`: SHA-256 manifests (`SHA256SUMS`) written last into checkpoints and run folders, verified by
  `--resume` and before every load of a saved model.
- `loading`: `check_saved_model`, what every command checks before it loads a saved model folder (its own code only
  with `--trust-remote-code`, manifest, safetensors weights only and exactly those Transformers loads, sizes within
  memory, weights that fit config.json in names, shapes and kinds, finite values); `check_model_size` for configs
  built from scratch.
- `trust`: `check_remote_code`, the one place that decides `trust_remote_code` for every command: the user's
  `--trust-remote-code` as a bool (Transformers never prompts); a folder asking for its own code is refused without it.
- `files`: the one way a command writes its outputs: `atomic_file` / `write_bytes` / `save_into` (a private folder
  reached through its descriptor, fsync, rename from descriptor to descriptor), `open_append`, `make_folder`; and
  `open_for_upload` for `publish`; links, devices and FIFOs are refused (`OutputError`), a full or read-only disk is
  a `WriteError`.
- `lock`: `FolderLock`, one writer per folder, taken by train, finetune, convert, upcycle and eval --plots.

Why a package of its own: its users are spread over training, evaluation, conversion, serving and the command
line. Inside any one of them, the others would import sideways (conversion importing training for a lock); inside
the model package, the model would carry application code. So it sits below the application packages and above
nothing of ours but the model: it imports only the standard library (and, when called, safetensors, torch,
transformers and the model package).
"""

from .files import (OutputError, Terminated, WriteError, atomic_file, check_target, clear_stops, make_folder,
                    open_append, raise_if_stopped, record_stop)
from .lock import LOCK_NAME, FolderLock, FolderLocked, FolderLockPathInvalid
from .loading import UnloadableModel, check_fits_memory, check_model_size, check_saved_model
from .trust import RemoteCodeRefused, check_remote_code
from .manifest import MANIFEST, check_model_folder, file_sha256, read_manifest, verify_manifest, write_manifest

__all__ = ["FolderLock", "FolderLocked", "FolderLockPathInvalid", "LOCK_NAME", "MANIFEST", "OutputError",
           "RemoteCodeRefused", "Terminated", "UnloadableModel", "WriteError", "atomic_file", "check_fits_memory",
           "check_model_folder", "check_model_size", "check_remote_code", "check_saved_model", "check_target",
           "clear_stops", "file_sha256", "make_folder", "open_append", "raise_if_stopped", "record_stop", "read_manifest", "verify_manifest", "write_manifest"]
