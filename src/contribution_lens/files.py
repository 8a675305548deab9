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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; it replaces ``path`` when the block ends without error."""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a folder, not a file")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as error:
        raise _naming(error, f"cannot write {target}") from error
    os.close(handle)
    staging = Path(name)
    try:
        yield staging
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o666 & ~umask)  # mkstemp makes the file private; what we write is not
        os.replace(staging, target)
    except OSError as error:
        # Not the temporary name: the user asked for ``target``.
        raise _naming(error, f"cannot write {target}") from error
    finally:
        staging.unlink(missing_ok=True)


def _naming(error: OSError, doing: str) -> OSError:
    """``error`` of the same type, its message saying what was being done (and so naming the file)."""
    reason = error.strerror or str(error) or type(error).__name__
    return type(error)(f"{doing}: {reason}")


@contextlib.contextmanager
def reading(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Re-raise any error met while reading ``path`` as one that names the file and what it should hold.

    A missing or unreadable file stays an ``OSError`` of its kind; anything else (a truncated
    safetensors header, metadata that does not parse, tensors that do not fit) becomes a
    ``ValueError``: ``PATH is not WHAT (the reader's reason)``.

    Example:
        >>> with reading("results.json", "a results file"):
        ...     int("x")
        Traceback (most recent call last):
        ...
        ValueError: results.json is not a results file (ValueError: invalid literal for int() with base 10: 'x')
    """
    try:
        yield
    except OSError as error:
        if str(path) in str(error):
            raise
        raise _naming(error, f"cannot read {path}") from error
    except Exception as error:  # every reader's own error type: safetensors', json's, ours
        lines = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        raise ValueError(f"{path} is not {what} ({reason})") from error


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with atomic_path(path) as staging:
        staging.write_text(text, encoding="utf-8")
    return Path(path)


def save_tensors(
    path: str | os.PathLike, tensors: "dict[str, Tensor]", metadata: dict[str, str], *, format: str, example: str
) -> Path:
    """Write ``tensors`` and string ``metadata`` (with ``format``) to one ``.safetensors`` file, atomically.

    A folder is refused, naming a file in it (``example``) to give instead.
    """
    from safetensors.torch import save_file

    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a folder; give a file path such as {target / example}")
    with atomic_path(target) as staging:
        save_file(tensors, str(staging), metadata={**metadata, "format": format})
    return target


def load_tensors(path: str | os.PathLike, *, format: str, kind: str) -> "tuple[dict[str, Tensor], dict[str, str]]":
    """The tensors and metadata of a file `save_tensors` wrote for ``kind`` (a class name) in ``format``.

    A missing file, a folder, a truncated file or another format is refused, naming the file.
    """
    from safetensors import safe_open

    source = Path(path)
    if source.is_dir():
        raise IsADirectoryError(f"{source} is a folder; give the file {kind}.save wrote")
    if not source.is_file():
        raise FileNotFoundError(f"no saved {kind} at {source}")
    with reading(source, f"a {kind} written by {kind}.save"):
        with safe_open(str(source), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != format:
                raise ValueError(f"its format is {metadata.get('format')!r}")
            return {name: handle.get_tensor(name) for name in handle.keys()}, metadata
