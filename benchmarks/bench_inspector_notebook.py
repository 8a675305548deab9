"""Size of a notebook that shows inspectors, and what its HTML exports show, for 2 and 4 inspectors.

Each notebook loads the bundled SmolLM2-135M, displays ``n`` inspectors of a short text (every
layer, 16-token windows) and is run top to bottom with no browser (nbclient), as
``jupyter nbconvert --execute`` runs it; the stills are then kaleido's (``pip install kaleido``).
Printed per notebook: its size, the copies of plotly.js in it, the stills and their bytes, and
for nbconvert's HTML export, sanitized (JupyterLab's default) and not, the page's size, its PNG
images and whether plotly.js source or a ``<script`` appears as text. Run:
``python benchmarks/bench_inspector_notebook.py`` (the environment's ``PYTHONPATH`` is the
kernel's, so pointing it at another checkout's ``src`` measures that version).
"""

import os
import re
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbconvert import HTMLExporter

SETUP = """import contribution_lens as cl
model = cl.load_model()
text = "The cat sat on the mat. The dog sat on the rug. The cat and the dog sat together on the mat."
"""


def notebook(n: int) -> nbformat.NotebookNode:
    cells = [nbformat.v4.new_code_cell(SETUP)]
    cells += [
        nbformat.v4.new_code_cell(f"inspector_{i} = cl.inspect(model, text, layer={i}, tokens=16)\ninspector_{i}")
        for i in range(n)
    ]
    node = nbformat.v4.new_notebook(cells=cells)
    node.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return node


def main() -> None:
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    for n in (2, 4):
        node = notebook(n)
        started = time.perf_counter()
        NotebookClient(node, timeout=600, kernel_name="python3").execute()
        seconds = time.perf_counter() - started
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "inspectors.ipynb"
            nbformat.write(node, path)
            text = path.read_text(encoding="utf-8")
        outputs = [out for cell in node.cells for out in cell.get("outputs", [])]
        stills = [out for out in outputs if "contribution_lens" in out.get("metadata", {})]
        pngs = sum(len(out.data["image/png"]) for out in stills if "image/png" in out.data)
        copies = len(re.findall(r"plotly[.]js v[0-9]", text))
        print(
            f"{n} inspectors: notebook {len(text.encode()) / 1e6:.2f} MB, plotly.js copies {copies}, "
            f"stills {len(stills)} ({pngs / 1e3:.0f} kB of base64 PNG), run in {seconds:.0f} s"
        )
        for sanitize in (True, False):
            page, _ = HTMLExporter(sanitize_html=sanitize).from_notebook_node(node)
            shown = re.sub(r"<script.*?</script>", "", page, flags=re.S)
            images = page.count('src="data:image/png;base64,')
            as_text = bool(re.search(r"plotly[.]js v[0-9]", shown))
            print(
                f"  nbconvert --to html, sanitized={sanitize}: {len(page.encode()) / 1e6:.2f} MB, {images} PNG "
                f"images, plotly.js source as text: {as_text}, escaped <script as text: {'&lt;script' in page}"
            )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
