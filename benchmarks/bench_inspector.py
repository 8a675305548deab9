"""Size and speed of the inspector on the bundled SmolLM2-135M (30 layers, 9 heads), CPU.

For 64, 128, 256 and 512 tokens: the static page with every layer and the whole text as its
token window (total size, size beyond plotly.js, payload bytes per displayable cell counting the
attention plus three factors in two scopes for every layer, head and causal pair, build time),
and the widget (first payload, with its default 128-token window; time to switch layer, which
runs the model; head, factor and scope switches run in the front-end only, from the payload
already sent). Run: ``python benchmarks/bench_inspector.py``.
"""

import json
import tempfile
import time
from pathlib import Path

import plotly.offline

import contribution_lens as cl

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "fineweb_edu" / "sample-10BT_first150.jsonl"
TEXT = (
    json.loads(SHARED.read_text().splitlines()[0])["text"]
    if SHARED.is_file()
    else " ".join(["The quick brown fox jumps over the lazy dog."] * 80)
)
PLOTLY_BYTES = len(plotly.offline.get_plotlyjs().encode())


def main() -> None:
    model = cl.load_model()
    all_tokens = cl.to_token_batch(model, TEXT).tokens
    print(f"bundled SmolLM2-135M, CPU; plotly.js is {PLOTLY_BYTES / 1e6:.2f} MB, embedded once per page")
    print("| tokens | page MB | page MB beyond plotly.js | bytes / displayable cell | page build s "
          "| widget first payload KB | widget layer switch s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for n in (64, 128, 256, 512):
            ids = all_tokens[:, :n]
            inspector = cl.inspect(model, ids, layer=0)
            first = len(json.dumps({"meta": inspector.meta, "payload": inspector.payload}).encode())
            switches = []
            for layer in (15, 29, 7):
                began = time.perf_counter()
                inspector.layer = layer
                switches.append(time.perf_counter() - began)
            began = time.perf_counter()
            path = inspector.write_html(Path(folder) / f"inspect{n}.html", tokens=n)
            built = time.perf_counter() - began
            size = path.stat().st_size
            cells = 30 * 9 * (n * (n + 1) // 2) * 7
            print(
                f"| {n} | {size / 1e6:.1f} | {(size - PLOTLY_BYTES) / 1e6:.2f} | {(size - PLOTLY_BYTES) / cells:.3f} "
                f"| {built:.1f} | {first / 1e3:.0f} | {sum(switches) / len(switches):.2f} |"
            )
            path.unlink()


if __name__ == "__main__":
    main()
