"""How every command writes its outputs (the only way: `atomic_file`, `write_bytes`, `save_into`, `staging_folder`,
`open_append`, `make_folder`), how `publish` reads what it uploads (`open_for_upload`), and the refusals they share.

Every file a command writes (`export`, `card`, `eval --output / --plots`, `convert`, `upcycle`, a run's files, a
checkpoint, the final save, `finetune`'s outputs) is written into a private folder made inside the destination's
folder, then renamed over the destination: killed at any moment, the user has the old file or the new one, never
none and never half of one. The destination's folder is opened once (`Folder`) and everything after is done
relative to its descriptor (`dir_fd=`): the private folder is created there under a random name with mode 0700
and reopened by descriptor (checked to be the one just made: ours, private, empty), the temporary file is created
in it with O_CREAT | O_EXCL | O_NOFOLLOW, a library that writes by name is given the private folder as
/proc/self/fd/N (that very folder, whatever is later renamed or linked at its name), and the rename goes from the
private folder's descriptor to the destination folder's. Before it, every file is checked to be a regular file of
one name (no link at any depth) and fsync'd; a folder output is checked to be the same folder (device, inode)
right before and right after its rename. Someone else writing into the output folder meanwhile can make the
command fail (`OutputError`, one line), never redirect a write.

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
import secrets
import shutil
from collections.abc import Callable, Iterator
from typing import BinaryIO

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
    _refuse_existing(info, path, overwrite, option)


def _refuse_existing(info: os.stat_result | None, path: str, overwrite: bool, option: str) -> None:
    """OutputError unless what `info` describes at `path` may be written over (absent, or a regular file with
    `overwrite`)."""
    if info is None:
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


# ------------------------------------------------------------------------------------------ writing by descriptor
# A test may set this to a callable taking (step, name): the writer calls it between its steps ("staged": a private
# folder was made; "written": the caller's bytes are in it; "publish": just before a rename into place), so that a
# test can swap a name for a link at that very moment. The product never sets it.
race_hook: Callable[[str, str], None] | None = None

_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | os.O_CLOEXEC
# a folder's open descriptor as a path (Linux): a library that writes by name, given this path, writes into the very
# folder that was opened, whatever has since been renamed or planted at the folder's name
_BY_DESCRIPTOR = "/proc/self/fd"
_HAS_BY_DESCRIPTOR = os.path.isdir(_BY_DESCRIPTOR)


def _at(step: str, name: str) -> None:
    if race_hook is not None:
        race_hook(step, name)


# a rename onto these fails whatever is retried: a bind-mounted file (EBUSY), a folder, another file system
_UNREPLACEABLE = frozenset({errno.EBUSY, errno.EISDIR, errno.ENOTDIR, errno.EXDEV, errno.ENOTEMPTY, errno.EEXIST})


def _identity(info: os.stat_result | None) -> tuple[int, int] | None:
    return None if info is None else (info.st_dev, info.st_ino)


def _replaced(path: str) -> OutputError:
    return OutputError(f"{path!r} was replaced while it was written (by another program writing into the same "
                       "folder); nothing was written through it: rerun when nothing else writes there")


class Folder:
    """A folder opened once: every name asked about is looked up inside it, relative to its descriptor
    (`dir_fd=`), so that a link planted at the folder's name (or above it) cannot redirect what is done in it.

    `path` is the name it was opened by (for messages and for what runs in another process); `entry(name)` is the
    path a library that writes by name is given: through the descriptor where the platform has /proc/self/fd."""

    def __init__(self, path: str, fd: int, name: str | None = None, parent: Folder | None = None):
        self.path, self.fd, self.name, self.parent = path, fd, name, parent
        self.published = False
        info = os.fstat(fd)
        self.identity = (info.st_dev, info.st_ino)

    @classmethod
    def open(cls, path: str) -> Folder:
        """Open the folder `path` (refused: a link at its last component, not a folder, absent)."""
        # `here` of a folder opened before (/proc/self/fd/N) is the one link followed: it is that folder itself
        by_descriptor = _HAS_BY_DESCRIPTOR and os.path.dirname(path) == _BY_DESCRIPTOR
        try:
            fd = os.open(path, _DIRECTORY & ~os.O_NOFOLLOW if by_descriptor else _DIRECTORY)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                check_folder(path)  # a link or a file: the refusal that names it
            raise write_error(error, path) from None
        return cls(path, fd)

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    @property
    def here(self) -> str:
        """This folder as a path a library can write into: through the descriptor where possible."""
        return f"{_BY_DESCRIPTOR}/{self.fd}" if _HAS_BY_DESCRIPTOR else self.path

    def entry(self, name: str) -> str:
        return os.path.join(self.here, name)

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def holds(self, name: str, identity: tuple[int, int]) -> bool:
        """Whether `name` here is (without following a link) the file or folder `identity` (device, inode)."""
        info = self.lstat(name)
        return info is not None and (info.st_dev, info.st_ino) == identity

    def still_named(self) -> bool:
        """Whether this (private) folder is still at its name in its parent: nothing was renamed or planted there."""
        return self.parent is None or (self.name is not None and self.parent.holds(self.name, self.identity))

    def check_target(self, name: str, overwrite: bool = True, option: str = "--overwrite",
                     shown: str | None = None) -> None:
        """`check_target` of `name` in this folder, looked up through the descriptor."""
        _refuse_existing(self.lstat(name), shown or os.path.join(self.path, name), overwrite, option)

    def private(self, prefix: str) -> Folder:
        """A new folder inside this one, named `prefix` + 16 random hex digits (nobody can plant anything at the
        name beforehand), mode 0700 (nobody else can create, rename or link anything inside it), opened once."""
        for _ in range(64):
            name = f"{prefix}{secrets.token_hex(8)}"
            try:
                os.mkdir(name, 0o700, dir_fd=self.fd)
            except FileExistsError:
                continue
            except BaseException:  # a signal just after the folder was made: it does not stay (nobody else's name)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=self.fd)
                raise
            break
        else:
            raise OutputError(f"cannot create a private folder in {self.path!r}")
        path = os.path.join(self.path, name)
        fd = -1
        try:
            _at("staged", name)
            try:
                fd = os.open(name, _DIRECTORY, dir_fd=self.fd)
            except OSError:
                raise _replaced(path) from None
            folder = Folder(path, fd, name, self)
            info = os.fstat(fd)
            # what was opened is the folder just made: ours, private and empty (not one renamed to its name since)
            if info.st_uid != os.geteuid() or info.st_mode & 0o077 or os.listdir(fd):
                raise _replaced(path)
        except BaseException:  # Ctrl-C or SIGTERM included: the folder just made does not stay behind
            if fd >= 0:
                with contextlib.suppress(OSError):
                    if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == \
                            _identity(self.lstat(name)) and not os.listdir(fd):
                        os.rmdir(name, dir_fd=self.fd)
                    os.close(fd)
            raise
        return folder

    def check_tree(self, shown: str | None = None) -> None:
        """OutputError if anything inside (at any depth) is a link, a hard link, or not a regular file or folder:
        what a library wrote here by name is then published as it is."""
        shown = shown or self.path
        for name in os.listdir(self.fd):
            info = self.lstat(name)
            if info is None:
                continue
            if stat.S_ISDIR(info.st_mode):
                try:
                    inner = Folder(os.path.join(shown, name), os.open(name, _DIRECTORY, dir_fd=self.fd))
                except OSError:
                    raise _replaced(os.path.join(shown, name)) from None
                with inner:
                    inner.check_tree()
            elif not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                raise _replaced(os.path.join(shown, name))

    def fsync_tree(self) -> None:
        """fsync every file under this folder and the folders themselves, through descriptors."""
        for name in os.listdir(self.fd):
            info = self.lstat(name)
            if info is None:
                continue
            flags = _DIRECTORY if stat.S_ISDIR(info.st_mode) else os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, dir_fd=self.fd)
            try:
                if stat.S_ISDIR(info.st_mode):
                    Folder(name, fd).fsync_tree()
                else:
                    os.fsync(fd)
            finally:
                os.close(fd)
        with contextlib.suppress(OSError):
            os.fsync(self.fd)

    def remove(self) -> None:
        """Delete this private folder: its contents through its descriptor, then its name only if that is still
        this folder (a folder renamed to its name meanwhile is left alone), then close it."""
        if self.fd < 0:
            return
        if self.published:  # renamed into place: it is the output now, not a staging folder
            self.close()
            return
        with contextlib.suppress(OSError):
            for name in os.listdir(self.fd):
                info = self.lstat(name)
                if info is not None and stat.S_ISDIR(info.st_mode):
                    shutil.rmtree(name, ignore_errors=True, dir_fd=self.fd)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=self.fd)
        if self.parent is not None and self.name is not None and self.still_named():
            with contextlib.suppress(OSError):
                os.rmdir(self.name, dir_fd=self.parent.fd)
        self.close()

    def move_file(self, name: str, target: Folder, target_name: str | None = None, overwrite: bool = True,
                  option: str = "--overwrite") -> None:
        """Rename the regular file `name` of this (private) folder to `target_name` in `target`, both looked up
        through their descriptors: fsync'd first, refused when the destination is a link, a device or a folder."""
        target_name = target_name or name
        shown = os.path.join(target.path, target_name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOENT):
                raise _replaced(os.path.join(self.path, name)) from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                raise _replaced(os.path.join(self.path, name))
            os.fsync(fd)
        finally:
            os.close(fd)
        target.check_target(target_name, overwrite, option, shown)
        raise_if_stopped()
        _at("publish", target_name)
        try:
            os.rename(name, target_name, src_dir_fd=self.fd, dst_dir_fd=target.fd)
        except OSError as error:
            if error.errno in _UNREPLACEABLE:
                raise OutputError(f"cannot replace {shown!r}: {error.strerror} (a mount point, a file in use or a "
                                  "folder); choose another path") from None
            raise write_error(error, shown) from None

    def publish_as(self, target_name: str, mode: int | None = None) -> None:
        """Rename this private folder to `target_name` in its parent (absent, or an empty folder the user made):
        checked, right before and right after the rename, to be this very folder at both names."""
        parent = self.parent
        assert parent is not None and self.name is not None
        shown = os.path.join(parent.path, target_name)
        self.check_tree(shown)
        self.fsync_tree()
        if mode is not None:
            os.fchmod(self.fd, mode)
        raise_if_stopped()
        existing = parent.lstat(target_name)
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            try:
                os.rmdir(target_name, dir_fd=parent.fd)  # an empty folder made by the user: replaced
            except OSError:
                raise OutputError(f"output {shown!r} already exists; choose a new path or delete it first") from None
        elif existing is not None:
            check_target(shown, overwrite=False)
        _at("publish", target_name)
        if not self.still_named():
            raise _replaced(self.path)
        try:
            os.rename(self.name, target_name, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
        except OSError as error:
            if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise OutputError(f"output {shown!r} appeared while it was written; nothing was replaced") from None
            raise write_error(error, shown) from None
        if not parent.holds(target_name, self.identity):  # something else was renamed in the instant between
            info = parent.lstat(target_name)
            if info is not None and stat.S_ISLNK(info.st_mode):
                with contextlib.suppress(OSError):
                    os.unlink(target_name, dir_fd=parent.fd)
            raise _replaced(self.path)
        self.name, self.published = target_name, True
        with contextlib.suppress(OSError):
            os.fsync(parent.fd)


def new_folder_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


@contextlib.contextmanager
def staging_folder(folder: str | Folder, prefix: str = PARTIAL) -> Iterator[Folder]:
    """A private folder (`Folder.private`) inside `folder`, removed at the end whatever happened: libraries that
    write by name write into `staged.here`, the result goes into place by `move_file` / `publish_as`."""
    parent = Folder.open(folder) if isinstance(folder, str) else folder
    staged = None
    try:
        with _signals_held():  # a signal now is raised once `staged` is set, so the folder is removed
            staged = parent.private(prefix)
        yield staged
    finally:
        if staged is not None:
            staged.remove()
        if isinstance(folder, str):
            parent.close()


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back (in the main thread, where Python runs their handlers) until the block ends."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def save_into(folder: str, write: Callable[[str], None], prefix: str = PARTIAL) -> list[str]:
    """Let `write` (a library that writes by name: save_pretrained, a tokenizer's) fill a private folder made in
    `folder`, check it holds only regular files of one name, then rename each of them into `folder` from
    descriptor to descriptor, each one replacing a regular file of its name (never a link, a device or a folder).
    A file there is always the old complete one or the new complete one, and renaming or replacing the private
    folder meanwhile redirects nothing. Returns the names written."""
    with Folder.open(folder) as target, staging_folder(target, prefix) as staged:
        write(staged.here)
        staged.check_tree(folder)
        names = sorted(os.listdir(staged.fd))
        for name in names:
            staged.move_file(name, target)
    return names


def open_for_upload(folder: str, name: str) -> BinaryIO:
    """The file `name` of `folder`, opened once for reading (folder and file without following a link at their
    last component, without blocking on a FIFO) and checked through its descriptor to be a regular file with one
    name: what is uploaded is read from this descriptor, never from the name again. OutputError (one line) for a
    symbolic link, a hard link (a second name of another file), a FIFO, a device or a folder."""
    shown = os.path.join(folder, name)
    with Folder.open(folder) as opened:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=opened.fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise OutputError(f"{shown!r} is a symbolic link; only plain files are uploaded: replace it by the "
                                  "file itself") from None
            raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = _kind(info.st_mode) if not stat.S_ISREG(info.st_mode) else \
            f"a file with {info.st_nlink} hard links (another file's name too)"
        raise OutputError(f"{shown!r} is {what}; only plain files of one name are uploaded: replace it by a copy")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def check_writable(destination: str) -> None:
    """Before a long computation whose result goes to `destination`: WriteError naming it now, rather than after,
    when its folder cannot take a file (read-only, full, over quota). A block is written, fsync'd and deleted in a
    private folder (nothing appears at `destination`)."""
    destination = os.path.abspath(destination)
    try:
        with staging_folder(os.path.dirname(destination)) as staged:
            fd = os.open("probe", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=staged.fd)
            try:
                os.write(fd, bytes(4096))
                os.fsync(fd)
            finally:
                os.close(fd)
    except OSError as error:
        raise write_error(error, destination) from None


@contextlib.contextmanager
def _file_in_staging(destination: str, overwrite: bool, option: str) -> Iterator[tuple[Folder, str, int]]:
    destination = os.path.abspath(destination)
    check_target(destination, overwrite, option)
    final = os.path.basename(destination)
    name = PARTIAL + final[-200:]  # the same extension as NAME, for writers that choose a format by it
    try:
        with staging_folder(os.path.dirname(destination)) as staged:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _mode(destination),
                         dir_fd=staged.fd)
            try:
                yield staged, name, fd
            finally:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _at("written", name)
            staged.move_file(name, staged.parent, final, overwrite, option)
    except BaseException as error:
        failure = write_error(error, destination)
        if failure is not error:
            raise failure from None
        raise


@contextlib.contextmanager
def atomic_file(destination: str, overwrite: bool = True, option: str = "--overwrite") -> Iterator[str]:
    """Yield a path for the caller (or a library) to write by name; when the block ends without an error, fsync
    the file and rename it over `destination`; on any error (Ctrl-C and SIGTERM included), delete it.

        with atomic_file("results.json") as path:
            Path(path).write_text(text)

    The path is inside a private folder made beside `destination` (`Folder.private`: a random name, mode 0700),
    reached through that folder's descriptor, and the rename goes from that descriptor to the one of
    `destination`'s folder: nobody else can plant a link where the bytes go or redirect the rename.
    `destination` must be absent or, with `overwrite`, a regular file (`check_target`, checked before the block
    and again just before the rename). A failed write of the disk is raised as WriteError naming `destination`.
    """
    with _file_in_staging(destination, overwrite, option) as (staged, name, _):
        yield staged.entry(name)


def write_bytes(destination: str, data: bytes | str, overwrite: bool = True, option: str = "--overwrite") -> None:
    """Write `data` (str: UTF-8) to `destination` as `atomic_file` does, through the descriptor the temporary
    file was created with."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with _file_in_staging(destination, overwrite, option) as (_, _, fd):
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]


__all__ = ["DISK_ERRNOS", "Folder", "OutputError", "PARTIAL", "Terminated", "WriteError", "atomic_file",
           "check_folder", "check_target", "check_writable", "clear_stops", "fsync_folder", "make_folder",
           "new_folder_mode", "open_append", "open_for_upload", "raise_if_stopped", "record_stop", "save_into",
           "staging_folder", "write_bytes", "write_error"]
