"""Writing files so that a reader never sees half of one: every file the package writes goes through here.

A file is written under a temporary name in its own folder and renamed onto its real name
(``os.replace``, atomic on POSIX and Windows) once complete. An interrupted write leaves the old
file, or none, never a truncated one; the temporary file is removed on error.

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> write_text(folder / "a.txt", "hello").read_text()
    'hello'
    >>> sorted(p.name for p in folder.iterdir())  # no temporary file left behind
    ['a.txt']
"""

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; it replaces ``path`` when the block ends without error."""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a folder, not a file")
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(handle)
    staging = Path(name)
    try:
        yield staging
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o666 & ~umask)  # mkstemp makes the file private; what we write is not
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with atomic_path(path) as staging:
        staging.write_text(text, encoding="utf-8")
    return Path(path)
