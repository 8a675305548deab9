"""What every command takes: the model, the output folder, the device and the dtype."""

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contribution_lens._settings import option
from contribution_lens.cli import checks

DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class ModelArgs:
    """The model a command loads and where it writes."""

    model: str = option(checks.BUNDLED, "bundled name, Hugging Face id or checkpoint folder")
    out: str | None = option(None, "output folder (created; one run at a time)")
    device: str | None = option(None, "cpu, cuda, cuda:1, ... (default: TransformerLens chooses)")
    dtype: str = option("float32", "weights' dtype", choices=DTYPES)


def check(args: argparse.Namespace) -> None:
    """The output folder first (cheap), then the model's config and the device (they import torch)."""
    args.out = checks.out_folder("--out", args.out)
    args.model = checks.model("--model", args.model)
    args.device = checks.device("--device", args.device)


def load(args: argparse.Namespace) -> Any:

    from contribution_lens import loading

    return loading.load_model(args.model, device=args.device, dtype=loading.check_dtype(args.dtype))


def written(out: Path, names: tuple[str, ...]) -> str:
    """``wrote OUT/a, b and c``."""
    listed = ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]
    return f"wrote {out}/{listed}"
