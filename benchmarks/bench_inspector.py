"""Size and build time of the inspector and of a token heatmap for a 512-token text.

The inspector embeds every (layer, head or all heads, factor/scope) heatmap, so its size grows
with layers x (heads + 1) x 7 x max_tokens^2. Run: ``python benchmarks/bench_inspector.py``.
"""

import json
import tempfile
import time
from pathlib import Path

import contribution_lens as cl

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "fineweb_edu" / "sample-10BT_first150.jsonl"
TEXT = (
    json.loads(SHARED.read_text().splitlines()[0])["text"]
    if SHARED.is_file()
    else " ".join(["The quick brown fox jumps over the lazy dog."] * 80)
)


def main() -> None:
    model = cl.load_model()
    tokens = cl.to_token_batch(model, TEXT).tokens[:, :512]
    print(f"text of {tokens.shape[1]} tokens, bundled SmolLM2-135M (30 layers, 9 heads)")
    print("| figure | build s | HTML MB |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for max_tokens in (12, 20, 32):
            start = time.perf_counter()
            figure = cl.inspect(model, tokens, max_tokens=max_tokens)
            built = time.perf_counter() - start
            path = Path(folder) / f"inspect{max_tokens}.html"
            figure.write_html(path, include_plotlyjs=True)
            print(f"| inspect, all layers, max_tokens={max_tokens} | {built:.1f} | {path.stat().st_size / 1e6:.1f} |")
        start = time.perf_counter()
        geometry = cl.attention_geometry(model, tokens, layers=[12])
        figure = cl.plot.token_heatmap(geometry, layer=12, head=0)
        built = time.perf_counter() - start
        path = Path(folder) / "heatmap.html"
        figure.write_html(path, include_plotlyjs=True)
        print(f"| token_heatmap, one head, 512x512 | {built:.1f} | {path.stat().st_size / 1e6:.1f} |")


if __name__ == "__main__":
    main()
