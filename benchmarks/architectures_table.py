"""What contribution-lens does with every architecture TransformerLens's bridge supports: docs/architectures.md.

For each name of ``SUPPORTED_ARCHITECTURES`` it runs what ``tests/integration/test_architectures.py`` runs (the
helper ``tests/architectures.py``): build a tiny random checkpoint with transformers' own classes,
``cl.load_model`` it, and on success check on every layer that the weights sum to 1, that the
heads reconstruct the o-projection output, that the decomposition agrees with the float64
reference, and whether a pattern edit reaches the output. Offline; about three minutes on a
2-core CPU. The status it writes is what it observed; where that differs from what the test
expects (``architectures.EXPECTED``) it says so and exits with status 1.

    python benchmarks/architectures_table.py                 # writes docs/architectures.md
    python benchmarks/architectures_table.py LlamaForCausalLM --output -   # one row, to stdout
"""

import argparse
import importlib.metadata
import math
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES  # noqa: E402

import architectures  # noqa: E402
import contribution_lens as cl  # noqa: E402
from contribution_lens import loading  # noqa: E402

LATE_PATTERN = "pattern edits refused: the bridge fires hook_pattern after the attention output"


def _bound(value: float) -> str:
    """The power of ten at or above ``value``: a bound that reads the same on every machine."""
    return "0" if value <= 0 else f"1e{math.ceil(math.log10(value))}"


def observe(name: str, folder: Path) -> tuple[str, str]:
    """(status, note) of one architecture, as observed."""
    expected = architectures.EXPECTED[name]
    if expected.kind == "skipped":
        return "skipped", expected.reason
    try:
        if name == architectures.NATIVE:
            model, inputs = architectures.native_bridge(), architectures.native_tokens()
        else:
            model, inputs = cl.load_model(str(architectures.build(name, folder))), architectures.TEXT
    except loading.UnsupportedModelError as error:
        return "refused", str(error).split(": ", 1)[1]
    try:
        m = architectures.measure(model, inputs)
    except Exception as error:  # a check that cannot even run is a failure to report, not to hide
        return "FAILS", f"{type(error).__name__}: {error}".splitlines()[0]
    worst = max(m.sums, m.reconstruction, m.z, m.engine)
    ok = worst < 1e-5 and m.oracle < 1e-10 and (m.edited is None or m.edited < 1e-5)
    notes = [note for note in (expected.reason, LATE_PATTERN if m.edited is None else "") if note]
    return ("works" if ok else "FAILS"), f"largest error {_bound(worst)}" + "".join(f"; {note}" for note in notes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="architectures (default: all)")
    parser.add_argument("--output", default=str(ROOT / "docs" / "architectures.md"), help="file, or - for stdout")
    args = parser.parse_args()
    names = args.names or list(architectures.ARCHITECTURES)
    unknown = [name for name in names if name not in SUPPORTED_ARCHITECTURES]
    if unknown:
        parser.error(f"not in SUPPORTED_ARCHITECTURES: {', '.join(unknown)}")
    warnings.simplefilter("ignore")
    transformers.utils.logging.disable_progress_bar()
    rows, mismatches = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            status, note = observe(name, Path(scratch) / name)
            if status != architectures.EXPECTED[name].kind:
                mismatches.append(f"{name}: observed {status}, expected {architectures.EXPECTED[name].kind}")
            adapter_name = SUPPORTED_ARCHITECTURES[name].__name__.removesuffix("ArchitectureAdapter")
            rows.append((name, architectures.model_type(name) or "-", adapter_name, status, note))
            print(f"{status:8} {name}", file=sys.stderr, flush=True)
    text = render(rows)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    for line in mismatches:
        print(f"MISMATCH {line}", file=sys.stderr)
    return 1 if mismatches else 0


def _group(status: str, reason: str) -> str:
    if "has no class for model type" in reason:  # one model type each: one line for them all
        reason = (
            f"transformers {transformers.__version__} has no class for its model type (its code ships with the "
            "checkpoint, and load_model does not run a checkpoint's own code)"
        )
    return f"{status}: {reason}"


def render(rows: list[tuple[str, str, str, str, str]]) -> str:
    counts = Counter(row[3] for row in rows)
    lens = importlib.metadata.version("transformer-lens")
    reasons = Counter(_group(row[3], row[4]) for row in rows if row[3] in ("refused", "skipped"))
    lines = [
        "# Architectures",
        "",
        "<!-- Generated by `python benchmarks/architectures_table.py`; do not edit by hand. -->",
        "",
        f"Every architecture TransformerLens {lens}'s `TransformerBridge` lists in "
        f"`SUPPORTED_ARCHITECTURES`, as contribution-lens handles it with transformers {transformers.__version__} "
        f"and torch {torch.__version__}: {len(rows)} names, "
        + ", ".join(f"{counts[kind]} {kind}" for kind in ("works", "refused", "skipped", "FAILS") if counts[kind])
        + ".",
        "",
        "Each was built as a tiny random checkpoint with transformers' own classes (2 layers, d_model 64, "
        "4 query heads of 16 dims on 2 key/value heads where the family has GQA; `tests/architectures.py`), "
        "saved to a folder and loaded with `cl.load_model(folder)`. **works**: on every layer the weights sum "
        "to 1 (per query over heads and keys, and per head), `sum_h z^h W_O^h + b_O` reconstructs the "
        "o-projection output (`blocks.{l}.attn.o.hook_out`), `hook_z` is `pattern @ v`, and the float32 "
        "engine and the float64 decomposition agree with the float64 reference of `tests/reference.py`; "
        "*largest error* bounds the first four (relative, or absolute for the weights). A pattern edit "
        "(`map_layers(edit=...)`, used by the faithfulness and sink interventions) was checked to reach the "
        "o-projection output, or is refused where the bridge fires `hook_pattern` only after making that "
        "output. **refused**: `load_model` raises `UnsupportedModelError` with the reason shown. "
        "**skipped**: nothing could be built here. Tiny random models test the wiring (hooks, shapes, "
        "layouts), not a real checkpoint's numbers.",
        "",
        "| architecture | model type | TransformerLens adapter | status | reason / notes |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| `{name}` | `{kind}` | {adapter} | {status} | {note} |" for name, kind, adapter, status, note in rows]
    notes = Counter(note for row in rows if row[3] == "works" for note in row[4].split("; ")[1:])
    plain = sum(1 for row in rows if row[3] == "works" and "; " not in row[4])
    lines += ["", "## Notes on what works", "", f"- {plain} × no note (a text model, checked as is)"]
    lines += [f"- {count} × {note}" for note, count in notes.most_common()]
    lines += ["", "## Why refused or skipped", ""]
    lines += [f"- {count} × {reason}" for reason, count in reasons.most_common()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
