"""Replacing a file atomically: `atomic_file`.

Every file a command writes over (`export --overwrite`, `eval --output --overwrite`, `card --overwrite`) is written
beside its destination under a fresh name, flushed to disk, then renamed over it: killed at any moment, the user
has the old file or the new one, never none and never half of one. The temporary name comes from `tempfile`
(created with O_EXCL, so a link planted at a predictable name is never written through), and the rename replaces
a symbolic link at the destination itself, not the file it points to.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

PARTIAL = ".partial-"  # the start of every temporary file's name


def fsync_folder(folder: str) -> None:
    """Make a rename inside `folder` durable (where the platform can open folders)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _mode(destination: str) -> int:
    """The permission bits of the file being replaced, else those a new file gets under the current umask."""
    try:
        return os.stat(destination).st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


@contextlib.contextmanager
def atomic_file(destination: str) -> Iterator[str]:
    """Yield a temporary path beside `destination` for the caller to write; when the block ends without an error,
    fsync it and rename it over `destination` (replacing what is there); on an error, delete it.

        with atomic_file("results.json") as path:
            Path(path).write_text(text)
    """
    destination = os.path.abspath(destination)
    folder = os.path.dirname(destination)
    # ".partial-XXXX-NAME": hidden, and the same extension as NAME for writers that choose a format by it
    fd, temporary = tempfile.mkstemp(prefix=PARTIAL, suffix=f"-{os.path.basename(destination)}", dir=folder)
    os.close(fd)
    os.chmod(temporary, _mode(destination))  # mkstemp makes it 0600: give it what a plain open() would
    try:
        yield temporary
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, destination)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    fsync_folder(folder)


__all__ = ["atomic_file", "fsync_folder"]
