"""switchhead.integrity: what every command that writes or loads a saved folder shares.

- `manifest`: SHA-256 manifests (`SHA256SUMS`) written last into checkpoints and run folders, verified by
  `--resume`, `eval` and `generate`; the weight-shape check of `generate` and `serve`.
- `lock`: `FolderLock`, one writer per folder, taken by train, finetune, convert, upcycle and eval --plots.

Why a package of its own: its users are spread over training, evaluation, conversion, serving and the command
line. Inside any one of them, the others would import sideways (conversion importing training for a lock); inside
the model package, the model would carry application code. So it sits below the application packages and above
nothing of ours: it imports only the standard library (and, when called, safetensors and transformers).
"""

from .lock import LOCK_NAME, FolderLock, FolderLocked
from .manifest import (MANIFEST, check_model_folder, file_sha256, read_manifest, verify_manifest,
                       weight_shape_problem, write_manifest)

__all__ = ["FolderLock", "FolderLocked", "LOCK_NAME", "MANIFEST", "check_model_folder", "weight_shape_problem",
           "file_sha256", "read_manifest", "verify_manifest", "write_manifest"]
