"""One run per output folder: an advisory lock on ``OUT/.lock`` held for the whole run.

The lock is ``fcntl.flock`` on a file that holds the owner's pid. The kernel drops it when the
process dies, so a crashed run never leaves a stale lock; a finished run removes the file, and a
folder that the run created and left empty is removed as well, so a failed run leaves nothing in
the way of the corrected rerun. Standard library only: the CLI takes the lock before it imports
torch or loads a model.
"""

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".lock"


class FolderInUseError(RuntimeError):
    """Another live process holds the lock of the output folder."""


def _owner(lock: Path) -> str:
    try:
        pid = lock.read_text(encoding="utf-8").strip()
    except OSError:
        pid = ""
    return f" (pid {pid})" if pid.isdigit() else ""


def _acquire(lock: Path) -> int:
    """An open descriptor of ``lock`` holding an exclusive flock, or raise FolderInUseError."""
    import fcntl

    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderInUseError(
                f"{lock.parent} is in use by another run{_owner(lock)}; wait for it or choose another folder"
            ) from None
        # The previous owner unlinks the file before unlocking: if the name now points to another
        # file (or none), the lock we got is on a dead inode; start again.
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


@contextlib.contextmanager
def locked(out: str | os.PathLike) -> Iterator[Path]:
    """Create ``out`` if needed and hold its lock until the block ends.

    Raises:
        FolderInUseError: another process holds the lock.
        NotADirectoryError: ``out`` exists and is not a folder.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp, locked(Path(tmp) / "run") as out:
        ...     (out / ".lock").is_file()
        True
    """
    folder = Path(out)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    try:
        fd = _acquire(lock)
    except BaseException:
        if created:
            _remove_if_empty(folder)
        raise
    try:
        yield folder
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)
        if created:
            _remove_if_empty(folder)


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()
