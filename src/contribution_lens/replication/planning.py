"""What a replication will cost, before anything runs and without reading a weight.

The model is a skeleton (`contribution_lens.loading.load_skeleton`: its config and tokenizer on the
meta device), so the data are cut exactly as the run will cut them and the faithfulness runs' own
planner (`contribution_lens.faithfulness.runner.plan_units`) counts their passes, less what an
interrupted run in ``out`` already holds. Time is estimated from floating-point work:

    t = sum_parts  c_part * passes_part * sum_u (2 P T_u + 4 L d_attn sum_s n_s^2) / F,

with ``P`` the matrix weights a token meets (unembedding included), ``L`` layers, ``d_attn = n_heads
d_head``, ``T_u`` a unit's tokens, ``n_s`` its sequences' lengths, ``F`` the floating-point rate of
this device measured on a matrix product of the model's width in its dtype, and ``c_part`` what a pass
of that part costs over a plain forward at rate ``F`` (`COST`: measured on SmolLM2-135M on a 2-core CPU
and on ... see the docs). The multiple-choice removal run is counted as if every task were above
chance (only those that are run).
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contribution_lens.analyses.sink_claims import FILES as SINK_FILES
from contribution_lens.faithfulness import data as text_data
from contribution_lens.faithfulness import runner
from contribution_lens.faithfulness.settings import DataSettings, task_name
from contribution_lens.replication.settings import SIZES, Size, choice_settings, clean_settings, text_settings

COST: dict[str, float] = {"score": 8.0, "masked": 2.5, "opening": 4.0, "sink_analysis": 60.0, "sink_pass": 5.0}
"""Cost of one pass of each kind over a plain forward at the device's matrix-product rate ``F``."""


@dataclass(frozen=True)
class PartPlan:
    """One part's work: passes and the floating-point work they carry."""

    name: str
    passes: int
    flops: float
    """Estimated floating-point operations, cost factors included."""


@dataclass(frozen=True)
class ReplicationPlan:
    """Passes and estimated time of each part (`plan`)."""

    parts: tuple[PartPlan, ...]
    rate: float
    """Measured floating-point rate of the device, in FLOP/s."""
    device: str

    @property
    def passes(self) -> int:
        return sum(part.passes for part in self.parts)

    @property
    def seconds(self) -> float:
        return sum(part.flops for part in self.parts) / self.rate

    def describe(self) -> str:
        lines = [
            f"{part.name}: {part.passes} forward passes, about {part.flops / self.rate / 60:.1f} min"
            for part in self.parts
        ]
        lines.append(
            f"in all {self.passes} passes, estimated {self.seconds / 60:.1f} min on {self.device} "
            f"({self.rate / 1e9:.0f} GFLOP/s measured on a matrix product; one process)"
        )
        return "\n".join(lines)


def token_flops(model: Any, lengths: list[int]) -> float:
    """Floating-point work of one plain forward over sequences of ``lengths`` tokens."""
    cfg = model.cfg
    vocab_shapes = {int(cfg.d_vocab), int(getattr(cfg, "d_vocab_out", cfg.d_vocab))}
    matrices = sum(
        p.numel() for p in model.parameters() if p.ndim >= 2 and not vocab_shapes & set(p.shape[:2])
    )  # embeddings and the unembedding are counted once below
    per_token = 2 * (matrices + cfg.d_model * cfg.d_vocab)
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.d_head * sum(n * n for n in lengths)
    return float(per_token * sum(lengths) + attention)


def measured_rate(device: str | torch.device | None, dtype: torch.dtype, width: int) -> float:
    """FLOP/s of a ``[2048, width] x [width, 4 width]`` matrix product on ``device`` (best of 5, after a warm-up)."""
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a = torch.randn(2048, width, device=target, dtype=dtype)
    b = torch.randn(width, 4 * width, device=target, dtype=dtype)
    best = float("inf")
    for attempt in range(6):
        if target.type == "cuda":
            torch.cuda.synchronize(target)
        start = time.perf_counter()
        (a @ b).sum().item()
        if attempt:  # the first product starts the thread pool or the kernels
            best = min(best, time.perf_counter() - start)
    return 2 * 2048 * width * 4 * width / best


def _faithfulness_part(
    name: str, skeleton: Any, data: DataSettings | None, settings: Any, folder: Path
) -> PartPlan | None:
    """The part's passes, less those ``folder`` holds; None where no set of its kind was given (it does not run)."""
    if data is None:
        return None
    units = runner.build_units(skeleton, data)
    done = runner.finished(folder)
    layers = list(range(skeleton.cfg.n_layers))
    work = runner.plan_units(skeleton, units, data, settings, done, layers=layers)
    flops = 0.0
    for item in work:
        forward = token_flops(skeleton, [len(t) for t in item.unit.tokens])
        flops += forward * (COST["score"] + (item.passes - 1) * COST["masked"])
    return PartPlan(name, sum(item.passes for item in work), flops)


def plan(
    skeleton: Any,
    data: DataSettings,
    out: str | Path,
    *,
    size: Size | str = "quick",
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> ReplicationPlan:
    """Passes and estimated time of `contribution_lens.replication.run` (what is left of it in ``out``)."""
    from contribution_lens.replication.runner import OPENING, Parts

    size = SIZES[size] if isinstance(size, str) else size
    out = Path(out)
    parts = Parts(data, size)
    runs = [
        _faithfulness_part("text faithfulness", skeleton, parts.text, text_settings(size), out / "text"),
        _faithfulness_part("multiple-choice clean accuracy", skeleton, parts.clean, clean_settings(),
                           out / "choice-clean"),
        _faithfulness_part("multiple-choice removal (tasks above chance only)", skeleton,
                           parts.choice([task_name(s) for s in data.choice]), choice_settings(parts.choice_ratios),
                           out / "choice"),
    ]  # fmt: skip
    found = [part for part in runs if part is not None]
    if data.lm:
        chunks = text_data.text_chunks(
            skeleton, data.lm, length=data.chunk_length, max_chunks=parts.sink_chunks, prepend_bos=data.prepend_bos
        )
        one = token_flops(skeleton, [chunks.shape[1]])
        done = _opening_done(out / OPENING)
        left = [i for i in range(chunks.shape[0]) if i not in done]
        found.append(PartPlan("opening case (layer summaries)", len(left), one * len(left) * COST["opening"]))
        if not (out / "sinks" / SINK_FILES["study"]).is_file():
            batches = -(-chunks.shape[0] // data.batch_size)
            flops = one * chunks.shape[0] * (COST["sink_analysis"] + 4 * COST["sink_pass"])
            found.append(PartPlan("sink study", 1 + 4 * batches, flops))
    rate = measured_rate(device, dtype, int(skeleton.cfg.d_model))
    shown = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return ReplicationPlan(tuple(found), rate, shown)


def _opening_done(path: Path) -> set[int]:
    import json

    if not path.is_file():
        return set()
    return {json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}
