"""How every command writes its outputs: `atomic_file`, `open_append`, `make_folder`, and the refusals they share.

Every file a command writes over (`export --overwrite`, `eval --output --overwrite`, `card --overwrite`, a run's
log and manifests) is written beside its destination under a fresh name, flushed to disk, then renamed over it:
killed at any moment, the user has the old file or the new one, never none and never half of one. The fresh name
is created with O_EXCL | O_NOFOLLOW (`tempfile.mkstemp`), so a link planted at a predictable name is never
written through, and it is checked to be a regular file of one name (no link) before it is renamed into place.

What is never written: a destination that is a symbolic link (the rename would replace the link, but the user
meant the file it points to, and a link the command did not create is not the command's to replace), or anything
that is not a regular file (a FIFO, a character or block device such as /dev/null, a socket, a folder): a
regular file renamed over a device node destroys it. Appends (`open_append`: events.log, log.csv) open without
following a link and write only into a regular file with one name. Folders the commands create inside their
outputs (`make_folder`: a run's checkpoints/ and tensorboard/) are refused when something else is at their name.

A write that fails because of the disk (full, read-only, over quota, a file too large) is raised as `WriteError`
naming the destination, so the command line reports it in one line: `cannot write PATH: <strerror>`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator

PARTIAL = ".partial-"  # the start of every temporary file's name

# failures that say the disk (or the file system) refused the write, whichever file the OS error names
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
# ... and those that do when they name the file being written
WRITE_ERRNOS = DISK_ERRNOS | {errno.EACCES, errno.EPERM, errno.EIO}


class OutputError(ValueError):
    """A destination that is not the command's to write (a link, a device, a FIFO, an existing file without
    --overwrite): refused before any byte is written (a ValueError: one line, exit code 2)."""


class WriteError(OSError):
    """Writing `filename` failed because of the disk: full, read-only, over quota, a file too large. The command
    line reports `cannot write FILENAME: STRERROR` (exit code 2); nothing half-written is left behind."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command line receives it so that every writer cleans up as for Ctrl-C (exit code
    143 rather than 130)."""


# Ctrl-C or SIGTERM received by the command line while it runs (`record_stop`): an exception raised in the middle of
# a library's work may be caught there, so each writer also asks before it publishes (`raise_if_stopped`)
_stops: list[BaseException] = []


def record_stop(stop: KeyboardInterrupt) -> None:
    """Remember that the running command was asked to stop (its signal handler calls this before raising)."""
    _stops.append(stop)


def clear_stops() -> None:
    _stops.clear()


def raise_if_stopped() -> None:
    """Raise the stop the command received, if any, before something is published: what was written after it is not
    kept even where a library swallowed the exception."""
    if _stops:
        raise type(_stops[-1])()


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def check_target(path: str, overwrite: bool = True, option: str = "--overwrite") -> None:
    """OutputError unless `path` may be written: absent, or (with `overwrite`) a regular file. A symbolic link
    (dangling or not), a FIFO, a device, a socket or a folder is refused whatever `overwrite` says."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except NotADirectoryError:  # a parent is a file: the write fails with its own error
        return
    if stat.S_ISLNK(info.st_mode):
        raise OutputError(f"output {path!r} is a symbolic link; outputs are never written through a link: remove it "
                          "or choose another path")
    if not stat.S_ISREG(info.st_mode):
        raise OutputError(f"output {path!r} is {_kind(info.st_mode)}, not a regular file; choose a file path")
    if not overwrite:
        raise OutputError(f"output {path!r} already exists; pass {option} to replace it, or choose another path")


def check_folder(path: str) -> None:
    """OutputError when `path`, a folder a command creates inside its output, is anything but a real folder or
    absent (a symbolic link to the user's folder, a file)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        raise OutputError(f"{path!r} is {_kind(info.st_mode)} where this command keeps a folder of its own; nothing "
                          "is written through it: remove it")


def make_folder(path: str) -> str:
    """Create `path` (and its parents) unless it exists; refused (OutputError) when its last component is a link
    or not a folder, before and after creating it (a link planted in between)."""
    check_folder(path)
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        pass
    except OSError as error:
        raise write_error(error, path) from None
    check_folder(path)
    return path


def _regular_fd(fd: int, path: str, single_name: bool) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or (single_name and info.st_nlink > 1):
        os.close(fd)
        what = _kind(info.st_mode) if not stat.S_ISREG(info.st_mode) else \
            f"a file with {info.st_nlink} hard links (another file's name too)"
        raise OutputError(f"output {path!r} is {what}; it is never written into: remove it")


def open_append(path: str, encoding: str = "utf-8", newline: str | None = None):
    """Open `path` for appending (created if absent) without following a link and without blocking on a FIFO;
    OutputError unless it is a regular file with one name. Open it again for each batch of lines: a link planted
    at `path` meanwhile is then refused instead of written through."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OutputError(f"output {path!r} is a symbolic link; it is never appended through: remove it") from None
        if error.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO nobody reads, a folder
            check_target(path)
        raise write_error(error, path) from None
    _regular_fd(fd, path, single_name=True)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding=encoding, newline=newline)


def write_error(error: BaseException, destination: str) -> BaseException:
    """`error` as a WriteError naming `destination` when it (or an exception it came from) is a failed write: an
    OSError of the disk, or a full disk as torch's zip writer ('basic_ios::clear', 'PytorchStreamWriter failed',
    'unexpected pos N vs M') or safetensors report it; else `error` itself."""
    seen = set()
    cause = error
    markers = {"No space left": errno.ENOSPC, "basic_ios": errno.ENOSPC, "PytorchStreamWriter failed": errno.ENOSPC,
               "failed writing": errno.ENOSPC, "unexpected pos": errno.ENOSPC, "StorageFull": errno.ENOSPC,
               "Disk quota": errno.EDQUOT, "FilesystemQuotaExceeded": errno.EDQUOT, "File too large": errno.EFBIG,
               "FileTooLarge": errno.EFBIG, "Read-only file system": errno.EROFS, "ReadOnlyFilesystem": errno.EROFS,
               "Input/output error": errno.EIO}
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, WriteError):
            return cause
        if isinstance(cause, OSError) and cause.errno is not None:
            named = cause.filename is None or str(cause.filename).startswith(os.path.dirname(destination) or "/")
            if cause.errno in DISK_ERRNOS or (cause.errno in WRITE_ERRNOS and named):
                return WriteError(cause.errno, cause.strerror or os.strerror(cause.errno), destination)
        elif isinstance(cause, RuntimeError) or type(cause).__name__ == "SafetensorError":
            for marker, number in markers.items():
                if marker in str(cause):
                    return WriteError(number, os.strerror(number), destination)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return error


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
        return os.lstat(destination).st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


@contextlib.contextmanager
def atomic_file(destination: str, overwrite: bool = True, option: str = "--overwrite") -> Iterator[str]:
    """Yield a temporary path beside `destination` for the caller to write; when the block ends without an error,
    fsync it and rename it over `destination`; on any error (Ctrl-C and SIGTERM included), delete it.

        with atomic_file("results.json") as path:
            Path(path).write_text(text)

    `destination` must be absent or, with `overwrite`, a regular file (`check_target`, checked before the block
    and again just before the rename). A failed write of the disk is raised as WriteError naming `destination`.
    """
    destination = os.path.abspath(destination)
    check_target(destination, overwrite, option)
    folder = os.path.dirname(destination)
    # ".partial-XXXX-NAME": hidden, and the same extension as NAME for writers that choose a format by it (the end
    # of a long NAME only, so that the temporary name fits where NAME does)
    try:
        fd, temporary = tempfile.mkstemp(prefix=PARTIAL, suffix=f"-{os.path.basename(destination)[-200:]}",
                                         dir=folder)
    except OSError as error:
        raise write_error(error, destination) from None
    try:
        os.fchmod(fd, _mode(destination))  # mkstemp makes it 0600: give it what a plain open() would
        os.close(fd)
        fd = None
        yield temporary
        # still a regular file of one name (a writer may have replaced it by its own rename; a link or a hard link
        # to another file is refused): what is renamed into place is what was written here
        try:
            fd = os.open(temporary, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            info = os.fstat(fd)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            info = None
        if info is None or not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise OutputError(f"the temporary file {temporary!r} was replaced while it was written; nothing was "
                              f"written to {destination!r}")
        os.fsync(fd)
        os.close(fd)
        fd = None
        check_target(destination, overwrite, option)  # something planted at the name while the file was written
        raise_if_stopped()
        os.replace(temporary, destination)
    except BaseException as error:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):  # the name only (a link there is removed, never followed)
            os.unlink(temporary)
        failure = write_error(error, destination)
        if failure is not error:
            raise failure from None
        raise
    fsync_folder(folder)


__all__ = ["DISK_ERRNOS", "OutputError", "PARTIAL", "Terminated", "WriteError", "atomic_file", "check_folder",
           "check_target", "clear_stops", "fsync_folder", "make_folder", "open_append", "raise_if_stopped",
           "record_stop", "write_error"]
