"""Writing files so that a reader never sees half of one: every file the package writes goes through here.

A file is written under a temporary name in its own folder and renamed onto its real name
(``os.replace``, atomic on POSIX and Windows) once complete. An interrupted write leaves the old
file, or none, never a truncated one; the temporary file is removed on error.

Every result saves and loads through one pair, `save_result` and `load_result`: one ``.safetensors``
file whose tensors are the result's tensors (named by where they sit, ``layers.3.attention``) and
whose metadata holds everything else as one JSON tree (see `save_result`).

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> write_text(folder / "a.txt", "hello").read_text()
    'hello'
    >>> sorted(p.name for p in folder.iterdir())  # no temporary file left behind
    ['a.txt']
"""

import contextlib
import dataclasses
import enum
import importlib
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from torch import Tensor

R = TypeVar("R")
S = TypeVar("S", bound="Saves")


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


def load_tensors(
    path: str | os.PathLike, *, format: str, kind: str, device: str | Any = "cpu"
) -> "tuple[dict[str, Tensor], dict[str, str]]":
    """The tensors (on ``device``) and metadata of a file `save_tensors` wrote for ``kind`` (a class name).

    A missing file, a folder, a truncated file or another format is refused, naming the file.
    """
    from safetensors import safe_open

    source = Path(path)
    if source.is_dir():
        raise IsADirectoryError(f"{source} is a folder; give the file {kind}.save wrote")
    if not source.is_file():
        raise FileNotFoundError(f"no saved {kind} at {source}")
    with reading(source, f"a {kind} written by {kind}.save"):
        with safe_open(str(source), framework="pt", device=str(device)) as handle:
            metadata = handle.metadata() or {}
            found = metadata.get("format")
            if found != format and str(found).rpartition("/")[0] == format.rpartition("/")[0]:
                raise ValueError(f"its format is {found!r}, an earlier layout: compute the result again")
            if found != format:
                raise ValueError(f"its format is {found!r}")
            return {name: handle.get_tensor(name) for name in handle.keys()}, metadata


# --- results: one file, tensors by name, the rest as one JSON tree ------------------------------------------

RESULT_VERSION = 2
"""The layout `save_result` writes (``contribution_lens.<Kind>/2``); version 1 files were written field by field."""


def stored_fields(value: Any) -> dict[str, Any] | None:
    """The keyword arguments that rebuild ``value``, or None if it is not stored as an object.

    A dataclass is stored as its ``init`` fields; any other class defines ``stored_fields()`` (and,
    where ``cls(**fields)`` is not its constructor, the classmethod ``from_fields(fields)``).
    """
    if hasattr(value, "stored_fields") and not isinstance(value, type):
        return dict(value.stored_fields())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
    return None


def _at(where: str, name: Any) -> str:
    return f"{where}.{name}" if where else str(name)


class _Writer:
    """Turns a result into tensors (each view written once) and a JSON tree that names them."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self._views: dict[tuple, str] = {}
        self._objects: dict[int, int] = {}
        self._alive: list[Any] = []  # ids and addresses stay unique while encoding

    def encode(self, value: Any, where: str) -> Any:
        import numpy as np
        import pandas as pd
        import torch

        if isinstance(value, enum.Enum):
            kind = type(value)
            return {"choice": f"{kind.__module__}:{kind.__qualname__}", "value": value.value}
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, torch.Tensor):
            return {"tensor": self._tensor(value, where)}
        if hasattr(value, "stored_fields") or dataclasses.is_dataclass(value):  # before Mapping: a result may be one
            return self._object(value, where)
        if isinstance(value, list | tuple):
            return {type(value).__name__: [self.encode(v, _at(where, i)) for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            items = [[self.encode(k, _at(where, "key")), self.encode(v, _at(where, k))] for k, v in value.items()]
            return {"dict": items}
        if isinstance(value, pd.DataFrame):
            return {"frame": self._frame(value, where)}
        return self._object(value, where)

    def _object(self, value: Any, where: str) -> Any:
        if id(value) in self._objects:
            return {"ref": self._objects[id(value)]}  # shared in memory, shared again when loaded
        fields = stored_fields(value)
        if fields is None:
            raise TypeError(f"cannot store {where}: a {type(value).__name__} is not a result, tensor, table or value")
        number = self._objects[id(value)] = len(self._objects)
        self._alive.append(value)
        kind = type(value)
        encoded = {name: self.encode(field, _at(where, name)) for name, field in fields.items()}
        return {"object": f"{kind.__module__}:{kind.__qualname__}", "id": number, "fields": encoded}

    def _tensor(self, tensor: "Tensor", where: str) -> str:
        view = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view not in self._views:
            name = where if where not in self.tensors else f"{where}#{len(self.tensors)}"
            # A copy of its own: safetensors refuses tensors that share storage.
            self.tensors[name] = tensor.detach().cpu().contiguous().clone()
            self._views[view] = name
            self._alive.append(tensor)  # its memory is not reused by a later tensor while this runs
        return self._views[view]

    def _frame(self, frame: Any, where: str) -> dict[str, Any]:
        import numpy as np
        import pandas as pd
        import torch

        if isinstance(frame.columns, pd.MultiIndex):
            raise TypeError(f"cannot store {where}: a table with several levels of columns")
        index = frame.index
        indexed = not (isinstance(index, pd.RangeIndex) and index.start == 0 and index.step == 1 and index.name is None)
        flat = frame.reset_index() if indexed else frame
        columns = []
        for number, name in enumerate(flat.columns):
            column = flat.iloc[:, number]
            if isinstance(column.dtype, np.dtype) and column.dtype.kind in "biuf" and column.dtype != np.uint64:
                values: Any = {"tensor": self._tensor(torch.from_numpy(column.to_numpy().copy()), _at(where, name))}
            else:
                values = {"values": [None if pd.isna(v) else self.encode(v, where) for v in column.astype(object)]}
            columns.append([self.encode(name, where), values, str(column.dtype)])
        names = [self.encode(n, where) for n in index.names] if indexed else None
        return {"columns": columns, "index": names, "columns_name": self.encode(frame.columns.name, where)}


class _Reader:
    """Rebuilds what `_Writer` wrote: objects by their class (only the package's own), tensors by name."""

    def __init__(self, tensors: Mapping[str, "Tensor"]) -> None:
        self.tensors = tensors
        self._objects: dict[int, Any] = {}

    def decode(self, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if "tensor" in node:
            if node["tensor"] not in self.tensors:
                raise ValueError(f"it names a tensor {node['tensor']!r} that it does not hold")
            return self.tensors[node["tensor"]]
        if "list" in node:
            return [self.decode(v) for v in node["list"]]
        if "tuple" in node:
            return tuple(self.decode(v) for v in node["tuple"])
        if "dict" in node:
            return {self.decode(k): self.decode(v) for k, v in node["dict"]}
        if "frame" in node:
            return self._frame(node["frame"])
        if "ref" in node:
            return self._objects[node["ref"]]
        if "choice" in node:
            choice = _stored_class(node["choice"])
            return choice.of(node["value"]) if hasattr(choice, "of") else choice(node["value"])
        kind = _stored_class(node["object"])
        fields = {name: self.decode(value) for name, value in node["fields"].items()}
        built = kind.from_fields(fields) if hasattr(kind, "from_fields") else kind(**fields)
        self._objects[node["id"]] = built
        return built

    def _frame(self, frame: dict[str, Any]) -> Any:
        import pandas as pd

        data = {}
        for number, (_, values, dtype) in enumerate(frame["columns"]):
            if "tensor" in values:
                data[number] = self.decode(values).numpy()
            else:
                data[number] = pd.Series([self.decode(v) for v in values["values"]], dtype=object).astype(dtype)
        table = pd.DataFrame(data)
        table.columns = pd.Index([self.decode(name) for name, _, _ in frame["columns"]])
        if frame["index"] is not None:
            names = [self.decode(n) for n in frame["index"]]
            table = table.set_index(list(table.columns[: len(names)]))
            table.index.names = names
        table.columns.name = self.decode(frame["columns_name"])
        return table


def _stored_class(location: str) -> type:
    """The class a file names: one of the package's own that is stored as an object, nothing else."""
    module, _, name = location.partition(":")
    if not module.startswith("contribution_lens."):
        raise ValueError(f"it names {location!r}, which is not a contribution_lens type")
    kind: Any = importlib.import_module(module)
    for part in name.split("."):
        kind = getattr(kind, part)
    stored = isinstance(kind, type) and (
        dataclasses.is_dataclass(kind) or hasattr(kind, "stored_fields") or issubclass(kind, enum.Enum)
    )
    if not stored:
        raise ValueError(f"it names {location!r}, which is not stored as an object")
    return kind


def save_result(path: str | os.PathLike, result: Any, *, example: str) -> Path:
    """Write ``result`` to one ``.safetensors`` file, atomically; `load_result` reads it back.

    The result is stored as the keyword arguments that rebuild it (`stored_fields`), recursively:
    tensors go into the file under the path where they sit (a view seen twice is written once),
    tables (pandas) column by column (numbers as tensors, the rest as JSON), and everything else,
    with the class of each object, into one JSON tree in the metadata. An object met twice (the
    layers several flows share) is written once and shared again when loaded. A folder is
    refused, naming a file in it (``example``) to give instead.

    Example:
        >>> import tempfile, torch
        >>> from contribution_lens.analyses.flow import FlowEdges
        >>> edges = FlowEdges(*[torch.arange(3)] * 3, *[torch.ones(3)] * 4)
        >>> path = save_result(tempfile.mkdtemp() + "/edges.safetensors", edges, example="edges.safetensors")
        >>> load_result(path, FlowEdges).weight.tolist()
        [1.0, 1.0, 1.0]
    """
    writer = _Writer()
    tree = writer.encode(result, "")
    kind = type(result).__name__
    metadata = {"tree": json.dumps(tree), "kind": kind}
    return save_tensors(path, writer.tensors, metadata, format=_result_format(kind), example=example)


def load_result(path: str | os.PathLike, kind: type[R], *, device: str | Any = "cpu") -> R:
    """The ``kind`` (a class) that `save_result` wrote to ``path``, its tensors on ``device``.

    A missing file, a folder, a truncated file, another kind of result, a file of an earlier
    layout or edited metadata is refused with an error that names the file.
    """
    name = kind.__name__
    tensors, metadata = load_tensors(path, format=_result_format(name), kind=name, device=device)
    with reading(path, f"a {name} written by {name}.save"):
        result = _Reader(tensors).decode(json.loads(metadata["tree"]))
        if not isinstance(result, kind):
            raise ValueError(f"it holds a {type(result).__name__}")
    return result


def _result_format(kind: str) -> str:
    return f"contribution_lens.{kind}/{RESULT_VERSION}"


class Saves:
    """``save(path)`` and ``load(path)`` of a result, through `save_result` and `load_result`.

    Every result of the package mixes this in (those saved as a folder of tables for people write
    the same file into it); the file is ``<snake_case kind>.safetensors`` in a folder's examples.
    """

    def save(self, path: str | os.PathLike) -> Path:
        """Write this result to one ``.safetensors`` file (atomically); ``type(self).load(path)`` reads it back."""
        return save_result(path, self, example=file_name(type(self)))

    @classmethod
    def load(cls: type[S], path: str | os.PathLike, device: str | Any = "cpu") -> S:
        """Read a file written by ``save``, its tensors on ``device``."""
        return load_result(path, cls, device=device)


def file_name(kind: type) -> str:
    """``flow.safetensors``, ``logit_attribution.safetensors``: the file a result of ``kind`` is saved to by default."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", kind.__name__).lower() + ".safetensors"
