"""SHA-256 manifests of saved folders, and the checks run before a saved model folder is loaded.

A manifest is a `SHA256SUMS` file in the folder, in `sha256sum` format (`<hex>  <relative path>` per line, so
`sha256sum -c SHA256SUMS` checks it too). It is written last, after every file it lists is on disk (fsync'd), so
its presence marks the folder complete, and `verify_manifest` finds every listed file that changed or vanished
afterwards. `switchhead train` writes one into every checkpoint and into the run folder after the final save;
`--resume` verifies them, and every command that loads a saved model calls `check_model_folder` first (through
`loading.check_saved_model`).
"""

from __future__ import annotations

import hashlib
import os

from .files import PARTIAL, atomic_file

MANIFEST = "SHA256SUMS"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _listed_files(folder: str) -> list[str]:
    names = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".tmp"))
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != MANIFEST and not name.endswith(".tmp") and not name.startswith(PARTIAL):
                names.append(relative.replace(os.sep, "/"))
    return sorted(names)


def write_manifest(folder: str, names: list[str] | None = None) -> str:
    """Hash `names` (default: every file under `folder`), fsync them, then write the manifest atomically."""
    names = _listed_files(folder) if names is None else sorted(names)
    lines = []
    for name in names:
        path = os.path.join(folder, name)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        lines.append(f"{file_sha256(path)}  {name}\n")
    target = os.path.join(folder, MANIFEST)
    with atomic_file(target) as temporary:  # a fresh name: a link planted at a fixed ".tmp" name is not followed
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.writelines(lines)
    return target


def read_manifest(folder: str) -> dict[str, str]:
    """{relative path: sha256} of the folder's manifest; ValueError when it is unreadable or malformed."""
    entries = {}
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                digest, sep, name = line.rstrip("\n").partition("  ")
                if not sep or len(digest) != 64 or not name or any(c not in "0123456789abcdef" for c in digest):
                    raise ValueError(f"line {number} is not '<sha256>  <file>'")
                entries[name] = digest
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{MANIFEST} is unreadable ({error})") from None
    if not entries:
        raise ValueError(f"{MANIFEST} lists no files")
    return entries


def verify_manifest(folder: str) -> list[str]:
    """Problems of `folder` against its manifest ('missing FILE', 'changed FILE', or why the manifest is bad);
    an empty list means every listed file is present with the recorded bytes."""
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        return [f"no {MANIFEST} (incomplete: the save did not finish)"]
    try:
        entries = read_manifest(folder)
    except ValueError as error:
        return [str(error)]
    problems = []
    for name, digest in entries.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"missing {name}")
        elif file_sha256(path) != digest:
            problems.append(f"changed {name}")
    return problems


def check_model_folder(folder: str) -> None:
    """Before loading a saved model folder: when it is a training run's folder (it has `training_config.json`) or
    carries a manifest, refuse it (ValueError with the reason) unless the manifest verifies."""
    has_manifest = os.path.isfile(os.path.join(folder, MANIFEST))
    if not has_manifest and not os.path.isfile(os.path.join(folder, "training_config.json")):
        return  # a plain save_pretrained folder (not written by `switchhead train`): nothing to check against
    problems = verify_manifest(folder)
    if problems:
        shown = ", ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ValueError(f"model folder {folder!r} is damaged or incomplete ({shown}); resume the run to finish "
                         f"its final save, or pass --no-verify to load it anyway")


__all__ = ["MANIFEST", "check_model_folder", "file_sha256", "read_manifest", "verify_manifest", "write_manifest"]
