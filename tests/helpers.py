"""Helpers shared by several test files: small inputs and a method run the way the harnesses run it."""

import ast
import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import einops
import pytest
import torch

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens import adapter, faithfulness
from contribution_lens.methods import ScoreContext, get_method

TEXT = "The cat sat on the mat because it was warm."

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
NO_CHROMIUM = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
)
"""Headless, with no network use of its own: this machine's closed network refuses Chromium's background calls."""
NEEDS_CHROMIUM = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason=NO_CHROMIUM)
"""The skip marker of every test that drives Chromium and its driver (the ``browser`` fixture is in conftest.py)."""


def docstring_ids(tree: ast.AST) -> set[int]:
    """``id`` of every docstring's node in ``tree`` (module, class, function): what a scan of the code's strings
    leaves out."""
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def chromium_driver(profile: Path):
    """Selenium's Chrome on Debian's Chromium and chromedriver: 1400 x 1000, a fresh profile, console logs kept."""
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, "--window-size=1400,1000", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)


def tiny_batch(model) -> adapter.TokenBatch:
    """Two texts, the second right-padded, so padding is exercised everywhere."""
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2, 8], [4, 6, 11, 13, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
    return adapter.to_token_batch(model, tokens, attention_mask=mask)


def method_scores(model, batch, name: str, layers: list[int]) -> dict[int, torch.Tensor]:
    """A registered method's raw scores, run the way the harnesses run it."""
    method = get_method(name)
    prepared = method.prepare(model, batch, layers) if method.prepare is not None else None
    context = ScoreContext(model=model, prepared=prepared)
    result = cl.map_layers(
        model, batch, lambda layer: method.score_fn(layer, context), layers=layers, capture=method.capture
    )
    return dict(result.items())


IDS = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))


ROOT = Path(__file__).resolve().parents[1]
DOC_PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
"""What a reader is shown: the README and the documentation site's pages."""


def docs_block(marker: str) -> str:
    """The one ``python`` code block of the README or of a page in ``docs/`` that contains ``marker``.

    A block that moves between pages is still found; a marker found in no block, or in several,
    fails here, naming the pages, instead of testing some other example.
    """
    found = [
        (page.relative_to(ROOT), block.split("```")[0])
        for page in DOC_PAGES
        for block in page.read_text(encoding="utf-8").split("```python\n")[1:]
        if marker in block.split("```")[0]
    ]
    assert len(found) == 1, f"{marker!r} is in {len(found)} python blocks of the docs: {[str(p) for p, _ in found]}"
    return found[0][1]


def run_block(block: str, namespace: dict) -> list:
    """Execute a documentation block statement by statement; the values of its bare expressions, in order.

    What a notebook cell would show for each line such as ``g.layer_summary()``, so a test can check
    that the comment beside it tells the truth.
    """
    import ast

    values = []
    for statement in ast.parse(block).body:
        if isinstance(statement, ast.Expr):
            values.append(eval(compile(ast.Expression(statement.value), "<docs>", "eval"), namespace))
        else:
            exec(compile(ast.Module([statement], type_ignores=[]), "<docs>", "exec"), namespace)
    return values


def tiny_clean(protocol: faithfulness.Settings, lengths=(8, 5)):
    model = tiny_bridge("gqa", biases=True)
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 50, (n,), generator=generator) for n in lengths]
    batch = adapter.pad_rows(model, rows)
    return model, batch, faithfulness.clean_run(model, batch, protocol)


SHAPES = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}


def random_layer(variant: str, *, batch: int = 2, pos: int = 7, d_head: int = 5, d_model: int = 12, seed: int = 0):
    n_heads, n_kv = SHAPES[variant]
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, n_heads, pos, pos, generator=g)
    causal = torch.ones(pos, pos, dtype=torch.bool).tril()
    pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    v = torch.randn(batch, pos, n_kv, d_head, generator=g)
    W_O = torch.randn(n_heads, d_head, d_model, generator=g)
    return pattern, v, W_O


def tokens(batch: int = 2, pos: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (batch, pos), generator=torch.Generator().manual_seed(seed))


G = torch.Generator().manual_seed(0)


SCORES = torch.randn(1, 2, 4, 4, generator=G)


PATTERN = SCORES.masked_fill(torch.ones(4, 4).triu(1).bool(), -torch.inf).softmax(-1)


V = torch.randn(1, 4, 2, 3, generator=G)


W_O = torch.randn(2, 3, 5, generator=G)


def authors_inputs(model, batch, layers: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """What the authors' code reads at each of ``layers``, from one forward pass and the model's own modules.

    ``value_layer`` is the value projection applied to its input here (its weight and ``b_V``),
    not ``hook_v``; key/value heads are repeated over their query heads (GQA), which the
    authors' code, written for BERT, does not have. Batch of one, as their code.
    """
    relative = {
        "hidden": "hook_resid_pre",
        "probs": "attn.hook_pattern",
        "v_in": "attn.v.hook_in",
        "pre_ln": "ln1.hook_in",
        "post_ln": "ln1.hook_out",
        "mid": "hook_resid_mid",
    }
    caught: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in layers}
    hooks = [
        (name, lambda t, hook, layer=layer, key=key: caught[layer].__setitem__(key, t.detach().double()))
        for layer in layers
        for key, suffix in relative.items()
        if (name := f"blocks.{layer}.{suffix}") in model.hook_dict
    ]
    adapter.forward(model, batch, hooks)
    for layer in layers:
        got, attn = caught[layer], model.blocks[layer].attn
        v_proj, o_proj = attn.v.original_component, attn.o.original_component
        n_heads = got["probs"].shape[1]
        weight = v_proj.weight.detach().double()
        values = got["v_in"] @ weight.T + (0 if v_proj.bias is None else v_proj.bias.detach().double())
        values = einops.rearrange(values, "b s (kv d) -> b kv s d", d=o_proj.weight.shape[1] // n_heads)
        got["values"] = values.repeat_interleave(n_heads // values.shape[1], dim=1)
        got["dense_weight"] = o_proj.weight.detach()
        got["dense_bias"] = None if o_proj.bias is None else o_proj.bias.detach()
    return caught


@contextlib.contextmanager
def jupyter_running(app: str, root: Path, home: Path, *options: str, env: dict[str, str] | None = None):
    """``jupyter {app}`` (``lab`` or ``server``) serving ``root`` on a free port with a fresh token and an empty user
    config under ``home``: yields ``{"url", "token", "root"}`` once it answers, stops it (and its kernels) after.

    One start-up for every test file that needs a running Jupyter: JupyterLab's and the server's exports are
    tested as a user meets them, through the server's own endpoints.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    environment = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    environment.update(env or {})
    log_path = home / f"{app}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "jupyter", app, "--allow-root", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", *options],
            cwd=root, env=environment, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(120):
                try:
                    urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)
            else:
                pytest.fail(f"jupyter {app} did not start: " + log_path.read_text()[-2000:])
            yield {"url": url, "token": token, "root": root}
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:  # a kernel still starting (a notebook reopened) holds it up
                process.kill()
                process.wait(30)
