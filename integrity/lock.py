"""One writer per folder: `FolderLock`.

`switchhead train` and `finetune` lock their output folder for the whole run, `convert` and `upcycle` the path they
are about to create, `eval --plots` its plots folder; a second writer is refused naming the holder.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time

LOCK_NAME = ".switchhead.lock"


class FolderLocked(ValueError):
    """Another process holds the folder's lock (a ValueError: the CLI reports it in one line, exit code 2)."""


class FolderLockPathInvalid(ValueError):
    """The lock's path holds something this lock did not write (a symbolic link, a FIFO, a hard link to another
    file): refused, never opened for writing (a ValueError: one line, exit code 2)."""


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _open_no_follow(path: str, flags: int) -> int:
    """Open the lock file without following a link (O_NOFOLLOW) and without blocking on a FIFO (O_NONBLOCK); refuse
    (ValueError naming the path) anything but a regular file with one name: a symbolic link, a FIFO, a device, a
    folder, or a hard link to another file would make the lock's JSON land in a file that is not ours."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:  # the last component is a symbolic link
            raise FolderLockPathInvalid(f"lock file {path!r} is a symbolic link; the lock is never written through "
                                        "one: remove it (it is not a switchhead lock)") from None
        if error.errno == errno.EISDIR:
            raise FolderLockPathInvalid(f"lock file {path!r} is a folder; remove it (it is not a switchhead "
                                        "lock)") from None
        raise
    info = os.fstat(fd)
    problem = (None if stat.S_ISREG(info.st_mode) and info.st_nlink <= 1
               else "is not a regular file" if not stat.S_ISREG(info.st_mode)
               else f"has {info.st_nlink} hard links (it is another file's name too)")
    if problem is not None:
        os.close(fd)
        raise FolderLockPathInvalid(f"lock file {path!r} {problem}; remove it (it is not a switchhead lock)")
    os.set_blocking(fd, True)
    return fd


class FolderLock:
    """An exclusive lock on a folder that a command writes: `with FolderLock(folder, "train"): ...`.

    The lock is a file holding the owner's process id, host and command, locked with `flock`. The kernel drops an
    `flock` when its process ends however it ends (SIGKILL included), so a crashed writer never blocks the next
    one; a clean exit also deletes the file. Where `flock` is not available (some network file systems) the
    process id in the file decides: a holder that no longer runs on this host is taken over.

    The lock file is opened without following a symbolic link and only when it is a regular file with a single name
    (`FolderLockPathInvalid` otherwise), so a link planted at its path never makes the lock write into a user's file.

    `inside=True` puts the lock file into `folder` (created if needed; a folder this lock created and left empty
    is removed on release); `inside=False` puts it beside `folder` (for commands that create `folder` by renaming
    a finished temporary folder into place).
    """

    def __init__(self, folder: str, command: str, inside: bool = True):
        self.folder = os.path.abspath(folder)
        self.command = command
        self.inside = inside
        if inside:
            self.path = os.path.join(self.folder, LOCK_NAME)
        else:
            self.path = os.path.join(os.path.dirname(self.folder), f".{os.path.basename(self.folder)}{LOCK_NAME}")
        self._fd: int | None = None
        self._created_folder = False

    def _holder(self) -> str:
        try:
            fd = _open_no_follow(self.path, os.O_RDONLY)
        except (OSError, ValueError):
            info = {}
        else:
            try:
                info = json.loads(os.read(fd, 1 << 16) or "{}")
            except (OSError, ValueError):
                info = {}
            finally:
                os.close(fd)
        if not isinstance(info, dict) or not info.get("pid"):
            return "another process"
        alive = "" if info.get("host") != socket.gethostname() or _process_alive(int(info["pid"])) else ", not running"
        return (f"process {info['pid']} on {info.get('host', '?')} (switchhead {info.get('command', '?')}, since "
                f"{info.get('since', '?')}{alive})")

    def acquire(self) -> "FolderLock":
        import fcntl

        if self.inside and not os.path.isdir(self.folder):
            if os.path.exists(self.folder):
                raise NotADirectoryError(f"{self.folder!r} is a file, not a folder")
            os.makedirs(self.folder)
            self._created_folder = True
        fd = None  # the lock file this process opened and holds, until it is recorded in self._fd
        try:
            while True:
                fd = None
                fd = _open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    fd = None  # another's lock: never deleted here
                    raise FolderLocked(f"{self.folder!r} is being written by {self._holder()}; wait for it to "
                                       "finish or stop it (one writer per folder)") from None
                except OSError:  # no flock here: decide by the recorded process id
                    holder = self._holder()
                    if "process " in holder and not holder.endswith("not running)") and \
                            not holder.startswith(f"process {os.getpid()} "):
                        os.close(fd)
                        fd = None
                        raise FolderLocked(f"{self.folder!r} is being written by {holder}; wait for it to finish "
                                           "or stop it (one writer per folder)") from None
                try:  # a holder that was releasing may have deleted the file we opened: lock the current one
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
                fd = None
            record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
            self._fd = fd
        except BaseException as error:
            if fd is not None:  # ours, locked, its record unwritten (a full disk): it does not stay behind
                self._fd = fd
                self.release()
            self._remove_created_folder()
            from .files import write_error

            failure = write_error(error, self.path)
            if failure is not error:
                raise failure from None
            raise
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still holding it: a waiting process then locks a fresh file
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        self._remove_created_folder()

    def _remove_created_folder(self) -> None:
        if self._created_folder:
            try:
                os.rmdir(self.folder)  # only when nothing was written into it
            except OSError:
                pass
            self._created_folder = False

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["LOCK_NAME", "FolderLock", "FolderLockPathInvalid", "FolderLocked"]
