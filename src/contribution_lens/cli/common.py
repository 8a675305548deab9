"""What every command takes: the model, the output folder, the device and the dtype."""

import argparse
import os
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


def rank_device(device: str | None) -> str | None:
    """The device of this process: under ``torchrun`` a bare ``cuda`` is the rank's own GPU, ``cuda:LOCAL_RANK``.

    Example:
        >>> os.environ["LOCAL_RANK"] = "3"
        >>> rank_device("cuda"), rank_device("cuda:0"), rank_device("cpu")
        ('cuda:3', 'cuda:0', 'cpu')
        >>> del os.environ["LOCAL_RANK"]
    """
    local = os.environ.get("LOCAL_RANK")
    return f"cuda:{int(local)}" if device == "cuda" and local is not None else device


def load(args: argparse.Namespace) -> Any:

    from contribution_lens import loading

    device = rank_device(args.device)
    if device is not None and device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(device)  # NCCL's collectives (the ranks' barriers) run on the current device
    return loading.load_model(args.model, device=device, dtype=loading.check_dtype(args.dtype))


def written(out: Path, names: tuple[str, ...]) -> str:
    """``wrote OUT/a, b and c``."""
    listed = ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]
    return f"wrote {out}/{listed}"
