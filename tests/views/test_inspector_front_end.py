"""The inspector's front-end without a browser: its maths against the Python side's, its shape, its types.

The page decodes and combines what the library sends with JavaScript twins of Python functions
(``dequantise``, ``combine``/``combine_cells``, ``decodeCompact``/``decode_compact``,
``hideSink``/``hide_sink``, ``viewFactors``/``view_factors``, ``windowStarts``/``window_starts``...).
Here the Python side writes payloads with the values it computes from them (the golden files),
and ``node --test`` (``inspector_golden.test.mjs``) checks the assembled module, exactly as the
widget and the page load it, against them. Each check is shown able to fail: a mutated copy of
one JavaScript function makes its check, and it, fail.
"""

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import contribution_lens as cl
from conftest import tiny_bridge, tiny_encoder
from contribution_lens import qk
from contribution_lens.drawing import plot
from contribution_lens.views.inspector import codecs, compact, page, payload, state, steps, still, why, windows
from contribution_lens.views.inspector.compute import compute_windows
from contribution_lens.views.inspector.exports import opening_view
from contribution_lens.views.inspector.figure import outside_view, view_factors

NODE = shutil.which("node")
NO_NODE = "needs Node.js for node --test (Debian: apt-get install nodejs)"
GOLDEN_TEST = Path(__file__).with_name("inspector_golden.test.mjs")
STATIC = Path(page.__file__).parent / "static"


def cells(grid: np.ndarray, window: windows.Window) -> list[float | None]:
    """A ``[query key]`` grid's displayable cells, row-major, NaN as None (JSON's null)."""
    return [None if np.isnan(x) else float(x) for x in np.asarray(grid, dtype=np.float64)[window.mask]]


def numbers(values: np.ndarray) -> list[float]:
    return [float(x) for x in np.asarray(values, dtype=np.float64).ravel()]


def view_cases(sent: dict, window: windows.Window, n_heads: int) -> list[dict]:
    """Every kind of view of one payload (all heads, a head, its KV group; the sink shown or hidden) and its factors."""
    out = []
    for head in (-1, 0, n_heads - 1):
        for group_kv in (False, True) if head >= 0 else (False,):
            for hide_sink in (False, True):
                for scope in cl.SCOPES:
                    chosen = {"head": head, "scope": scope, "group_kv": group_kv, "hide_sink": hide_sink}
                    grids = view_factors(sent, window, **chosen)
                    outside = outside_view(sent, window, **chosen)
                    state = {"head": "all" if head < 0 else head, "group_kv": group_kv, "hide_sink": hide_sink}
                    out.append({"state": state, "scope": scope, "factors": {f: cells(grids[f], window) for f in grids},
                                "outside": {f: [None if np.isnan(x) else float(x) for x in v]
                                            for f, v in outside.items()}})  # fmt: skip
    return out


def combine_case(arrays: dict[str, np.ndarray], window: windows.Window, kv_groups: list[list[int]]) -> dict:
    """Per-head arrays (as the page decodes them) and `payload.combine_cells` of them, all heads and by KV group."""
    query_of, key_of = np.nonzero(window.mask)
    n_heads = arrays["attention"].shape[0]
    expected = {}
    for scope in cl.SCOPES:
        output = (
            arrays["output_norm_intra"]
            if scope == "intra"
            else np.broadcast_to(arrays["output_norm_inter"], (n_heads, len(window.queries)))
        )
        out = output[:, query_of]
        relative_norm = np.divide(arrays["value_norm"][:, key_of], out, out=np.zeros_like(out), where=out > 0)
        for prefix, n_groups in (("all_", 1), ("group_", len(kv_groups))):
            combined = payload.combine_cells(arrays["attention"], relative_norm, arrays[f"cosine_{scope}"], n_groups)
            expected[prefix + "attention"] = numbers(combined["attention"])
            for factor in ("relative_norm", "cosine", "contribution"):
                expected[f"{prefix}{factor}_{scope}"] = numbers(combined[factor])
            expected[f"{prefix}total_{scope}"] = numbers(
                arrays[f"total_{scope}"].reshape(n_groups, -1, len(window.queries)).sum(1)
            )
    arrays_sent = {name: numbers(values) for name, values in arrays.items()}
    return {"arrays": arrays_sent, "groups": kv_groups, "expected": expected}


def layer_case(name: str, model, ids: torch.Tensor, start: int, tokens: int) -> dict:
    """One model's layer in a window: its fine and compact payloads, and what the Python side computes of them."""
    batch = cl.to_token_batch(model, ids)
    n = batch.tokens.shape[1]
    window = windows.token_window(n, start=start, tokens=tokens, causal=cl.adapter.is_causal_model(model))
    fine = compute_windows(model, batch, [1], [window])[1][window.key]
    packed = compute_windows(model, batch, [1], [window], compact=True)[1][window.key]
    fine, packed = {**fine, "key": "1"}, {**packed, "key": "1"}
    labels = [windows.token_label(i, str(i)) for i in range(n)]
    n_heads = int(model.cfg.n_heads)
    meta = payload.meta(labels, window, [1], n_heads, {}, kv_groups=fine["kv_groups"], compact=True)
    decoded = compact.decode_compact(packed, window)
    raw = compact.unpack_compact(packed)
    exact = {
        name: np.asarray(raw[name], dtype=np.float64) for name in payload.PER_QUERY | {"value_norm"} if name in raw
    }
    exact = {
        name: values if name == "output_norm_inter" else values.reshape(n_heads, -1) for name, values in exact.items()
    }
    per_head = {
        **exact,
        "attention": decoded["attention"],
        **{f"cosine_{s}": decoded[f"cosine_{s}"] for s in cl.SCOPES},
    }
    return {
        "name": name,
        "meta": meta,
        "payload": fine,
        "compact": packed,
        "dequantised": {name: numbers(codecs.decode(fine[name], codec)) for name, codec in fine["codecs"].items()},
        "cells": {"count": window.cells, "mask": window.mask.ravel().tolist()},
        "views": view_cases(fine, window, n_heads),
        "decoded_compact": {name: numbers(values) for name, values in decoded.items()},
        "combine": combine_case(per_head, window, fine["kv_groups"]),
    }


def hide_sink_case() -> dict:
    """`plot.hide_sink` of a grid whose second row is all but all sink (nothing left: NaN), shares signed."""
    window = windows.token_window(6, start=3, tokens=3)  # keys 0, 3, 4, 5
    rng = np.random.default_rng(0)
    grid = np.where(window.mask, rng.normal(size=window.mask.shape), np.nan)
    grid[1] = np.where(window.mask[1], 1e-9, np.nan)  # the sink holds the row's total but 2e-9: nothing left
    grid[1, 0] = 0.75
    totals = np.array([1.5, 0.75 + 2e-9, -0.5])
    hidden = {name: np.where(np.isnan(grid), np.nan, plot.hide_sink(np.nan_to_num(grid), S))
              for name, S in (("attention", np.ones(3)), ("contribution", totals))}  # fmt: skip
    meta = {"queries": window.queries, "keys": window.keys, "causal": True}
    expected = {name: cells(values, window) for name, values in hidden.items()}
    return {"meta": meta, "values": cells(grid, window), "totals": totals.tolist(), "expected": expected}


def steps_case() -> dict:
    """`steps.steps_payload` of two steps, and the terms it sends (float32), as the prediction view decodes them."""
    results = []
    for position, scale in ((1, 0.125), (2, -0.5)):
        attention = torch.arange(2 * 3 * 3, dtype=torch.float32).reshape(2, 3, 3) * scale
        attention[..., position + 1 :] = 0  # no term from a key after the explained position
        results.append(cl.LogitAttribution(
            tokens=torch.tensor([5, 6, 7]), str_tokens=["a", "b", "c"], position=position, target=7, target_token="c",
            foil=None, foil_token=None, logit=float(attention.sum()), attention=attention,
            attention_bias=torch.zeros(2), post_norm_bias=torch.zeros(2), mlp=torch.zeros(2), embed=0.0,
        ))  # fmt: skip
    rollout = torch.tensor([0.25, 0.5, 0.25])
    sent = steps.steps_payload(steps.Steps(tuple(results), (None, rollout)), ["0:a", "1:b", "2:c"])
    expected = [
        {
            "heads": numbers(r.by_head().to_numpy().astype(np.float32)),
            "keys": numbers(r.by_key().to_numpy().astype(np.float32)),
            "rollout": None if k == 0 else numbers(rollout[: r.visible].numpy()),
        }
        for k, r in enumerate(results)
    ]
    return {"sent": sent, "expected": expected}


def window_cases() -> list[dict]:
    """The widget's window menu: `windows.window_starts` (odd and even sizes, a text shorter than one window),
    and the window shown offered even where it is off the menu."""
    out = []
    for n, tokens, current in ((15, 8, 0), (15, 7, 3), (128, 128, 0), (10, 3, 7), (1, 1, 0), (40, 16, 5), (9, 64, 0)):
        starts = sorted(set(windows.window_starts(n, tokens)) | {current})
        out.append({"n": n, "tokens": tokens, "current": current,
                    "expected": [[s, min(n, s + tokens) - 1] for s in starts]})  # fmt: skip
    return out


def label_cases() -> list[dict]:
    tokens = ["plain", "\n", "a\tb", "\r\n", " x\\n", "\\t\t"]
    return [{"token": t, "label": windows.token_label(i, t)} for i, t in enumerate(tokens)]


def half_case() -> dict:
    values = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 6.1e-5, 5.96e-8, 1e-6, 0.1, 3.14159])
    return {
        "sent": codecs.encode(values, "half"),
        "expected": numbers(codecs.decode(codecs.encode(values, "half"), "half")),
    }


def why_case() -> dict:
    """The why panel's rows (`why.why_row`) of a tiny model's split, and what the bars must be: the top terms then
    the rest, adding up to ``log alpha + H``; each component's head (`qk.component_layer_head`); the key drawn."""
    model = tiny_bridge("gqa", biases=True)
    split = cl.qk_attribution(model, torch.arange(7), 1, 2, query=6)
    row = why.why_row(split, 2, 6, top=3)
    heads = {name: list(qk.component_layer_head(name)) for name in (*split.key_components, *split.query_components)}
    heads = {name: where if where[1] is not None else None for name, where in heads.items()}
    alpha = split.pattern[0, 0].double().numpy()
    return {
        "row": row,
        "bars": [
            {
                "names": [*side["names"], why.OTHER],
                "total": float(split.log_alpha_plus_entropy(head=2, query=6)[j]),
            }
            for j, side in zip(row["keys"], row["key_side"], strict=True)
        ],
        "heads": heads,
        "keys": {"clicked 3": [3, 3], "none": [-1, int(alpha.argmax())], "off the row": [40, int(alpha.argmax())]},
    }


OFF_DEFAULT = {"layer": 2, "head": 3, "factor": "cosine", "scope": "intra", "query": 5, "view": "text",
               "hide_sink": True, "group_kv": True, "step": 1}  # fmt: skip
"""A value off its default of every setting a page's link names, on the page of `settings_case`."""


def settings_case() -> dict:
    """The view state's description as the Python side sends it (a page's meta), and a view off every default.

    The front-end must read every setting the table names and name none it lacks: the view `OFF_DEFAULT`
    written as a link and read back is itself, whatever settings the table holds.
    """
    assert set(OFF_DEFAULT) == set(state.LINKED), "a setting a link names has no value off its default here"
    defaults = {s.name: s.default for s in state.SETTINGS}
    window = windows.token_window(8, start=3, tokens=3, causal=True)
    initial = opening_view(defaults, head="all", query=window.queries[-1])
    about = payload.meta([f"{i}:t" for i in range(8)], window, [0, 1, 2], 4, initial, kv_groups=[[0, 1], [2, 3]])
    plain = "#" + "&".join(f"{s.name}={about['initial'][s.name]}" for s in state.SETTINGS if s.link == "always")
    return {
        "meta": about,
        "steps": {"steps": [{"position": 4}, {"position": 5}]},
        "names": list(state.NAMES),
        "linked": list(state.LINKED),
        "toggles": [s.name for s in state.SETTINGS if s.kind is bool],
        "labels": [s.label for s in state.SETTINGS if s.kind is bool],
        "off_default": OFF_DEFAULT,
        "plain": plain,
    }


def still_case() -> dict:
    """The still of a view as the kernel writes it (`still.bundle`, `still.caption`): a widget without a kernel
    writes the same (``ownStill``), with and without its drawing."""
    base = {s.name: s.default for s in state.SETTINGS} | {"layer": 3, "query": 7}
    states = [base, base | {"head": 2, "view": "text", "factor": "cosine", "scope": "intra"},
              base | {"view": "prediction", "step": -1}, base | {"view": "prediction", "step": 4}]  # fmt: skip
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n....").decode()
    drawn = still.bundle(base64.b64decode(png), 300, states[1], drawn_by="browser", widget="w1")
    undrawn = still.bundle(None, None, states[2], widget="w1")
    return {
        "captions": [{"state": s, "caption": still.caption(s)} for s in states],
        "drawn": {"state": states[1], "png": png, "width": 300, "data": drawn[0], "metadata": drawn[1]},
        "undrawn": {"state": states[2], "data": undrawn[0], "metadata": undrawn[1]},
    }


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    """A folder of golden files (what the Python side computes) and the front-end's module as the page loads it."""
    folder = tmp_path_factory.mktemp("golden")
    ids = torch.randint(0, 50, (1, 14), generator=torch.Generator().manual_seed(4))
    layers = [
        layer_case("gqa, a window late in the text (sink key)", tiny_bridge("gqa", biases=True), ids, 5, 6),
        layer_case("mha, the first window", tiny_bridge("mha"), ids, 0, 7),
        layer_case("encoder, every pair", tiny_encoder("mha"), ids[:, :8], 0, 8),
    ]
    cases = {"layers": layers, "hide_sink": hide_sink_case(), "steps": steps_case(), "windows": window_cases(),
             "labels": label_cases(), "half": half_case(), "why": why_case(), "settings": settings_case(),
             "still": still_case()}  # fmt: skip
    (folder / "golden.json").write_text(json.dumps(cases), encoding="utf-8")
    (folder / "inspector.mjs").write_text(page.module(), encoding="utf-8")
    return folder


def node_test(folder: Path) -> tuple[int, set[str], set[str], str]:
    """``node --test`` of the golden checks against ``folder``: exit code, checks passed, checks failed, output."""
    result = subprocess.run(
        [NODE, "--test", "--test-reporter=tap", str(GOLDEN_TEST)],
        env={"CL_GOLDEN": str(folder), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    # TAP: one "ok N - name" or "not ok N - name" line a check; older Node adds one for the file, indenting the rest.
    verdicts = re.findall(r"^ *(not )?ok \d+ - (.+)$", result.stdout, re.MULTILINE)
    passed = {name for failing, name in verdicts if not failing and not name.endswith(".mjs")}
    failed = {name for failing, name in verdicts if failing and not name.endswith(".mjs")}
    return result.returncode, passed, failed, result.stdout + result.stderr


CHECKS = {"dequantise", "cellIndex", "windowStarts", "escapeToken", "combine", "decodeCompact", "hideSink",
          "viewFactors", "shownFactors", "outsideShares", "decodeSteps", "droppedFragment", "why", "writeStill",
          "drawnState", "settings", "ownStill"}  # fmt: skip


@pytest.mark.skipif(NODE is None, reason=NO_NODE)
def test_the_front_end_computes_what_the_python_side_computes(golden) -> None:
    code, passed, failed, output = node_test(golden)
    assert code == 0 and not failed, output
    assert passed == CHECKS, output


MUTATIONS = [
    ("dequantise", "values[i] = s * s;", "values[i] = s;"),
    ("dequantise", "2 ** (exponent - 15) * (1 + fraction / 1024);", "2 ** (exponent - 15);"),
    ("cellIndex", "meta.keys[ki] <= meta.queries[qi]", "meta.keys[ki] < meta.queries[qi]"),
    ("windowStarts", "Math.max(1, Math.floor(size / 2))", "Math.max(1, Math.ceil(size / 2))"),
    ("escapeToken", '.replaceAll("\\r", "\\\\r")', ""),
    ("combine", "sa / heads.length", "sa"),
    ("combine", "[g * cells + c] = sa > 0 ? cosSum / sa : 0;", "[g * cells + c] = cosSum;"),
    ("decodeCompact", "dot * qs[h * nq + qi] * ks[h * nk + ki];", "dot * qs[h * nq + qi];"),
    ("hideSink", "(f[name][c] * S) / rest", "f[name][c] / rest"),
    ("hideSink", "Math.abs(rest) <= 1e-6 * Math.max(1, Math.abs(S))", "false"),
    ("viewFactors", "out.attention[c] * rn * out.cosine[c];", "rn * out.cosine[c];"),
    ("shownFactors", 'return a["all_total_" + scope];', 'return a["all_total_inter"];'),
    ("shownFactors", "index: groupOf(meta, state.head) };", "index: /** @type {number} */ (state.head) };"),
    ("outsideShares", "out.attention[qi] /= heads.length;", ""),
    ("outsideShares", "(out[name][qi] * S) / left;", "out[name][qi];"),
    ("decodeSteps", "keys: dequantise(step.keys, exact)", "keys: dequantise(step.heads, exact)"),
    ("droppedFragment", "return !names(own) && names(outer)", "return names(outer)"),
    ("droppedFragment", "(name) => settings.includes(name)", "() => true"),
    ("settings", 'return setting.type === "bool" ? (reading', 'return setting.type === "int" ? (reading'),
    ("settings", '(s) => s.link === "always" || (values', '(s) => s.link === "changed" || (values'),
    ("settings", '.filter((setting) => setting.link !== "never");', ";"),
    ("ownStill", 'const shown = state.view === "text" ? "text view, " : "";', 'const shown = "";'),
    ("ownStill", 'drawn_by: drawn ? "browser" : null', 'drawn_by: "browser"'),
    ("writeStill", "names.every((name) => JSON.stringify(one[name]) === JSON.stringify(other[name]))", "true"),
    ("writeStill", "if (keepView && sameView(", "if (!keepView && sameView("),
    ("why", "values: side.values.concat(side.other)", "values: side.values.concat(0)"),
    ("why", "const match = /^L(\\d+)H(\\d+)$/.exec(name);", "const match = /^L(\\d+)H?(\\d*)/.exec(name);"),
    ("why", "if ((a ?? 0) > (row.alpha[best] ?? 0)) best = n;", "if ((a ?? 0) < (row.alpha[best] ?? 0)) best = n;"),
]
"""For each golden check, a break of its function (the text replaced, once, in the module) that it must catch."""


@pytest.mark.skipif(NODE is None, reason=NO_NODE)
@pytest.mark.parametrize(
    ("check", "original", "broken"), MUTATIONS, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(MUTATIONS)]
)
def test_each_golden_check_fails_when_its_function_breaks(golden, tmp_path, check, original, broken) -> None:
    module = (golden / "inspector.mjs").read_text(encoding="utf-8")
    assert module.count(original) == 1, f"the mutation's target is not one place in the module: {original}"
    (tmp_path / "golden.json").symlink_to(golden / "golden.json")
    (tmp_path / "inspector.mjs").write_text(module.replace(original, broken), encoding="utf-8")
    code, _, failed, output = node_test(tmp_path)
    assert code != 0 and check in failed, output


# --- the module's shape: one ES module of small files, typed ---------------------------------------


def test_the_widget_and_the_page_load_one_module_of_every_file() -> None:
    files = sorted(path.name for path in STATIC.glob("*.js"))
    assert sorted(page.MODULES) == [name for name in files if name != "types.js"], "a file the module leaves out"
    module = page.module()
    assert not re.search(r"^\s*import\s", module, re.MULTILINE), "an import the assembly did not remove"
    assert module.count("export default") == 1 and module.rstrip().endswith("export default { render };")
    for name in files:
        assert (STATIC / name).read_text(encoding="utf-8").startswith("// @ts-check\n"), name
    widget = cl.views.inspector.Inspector._esm
    assert widget == module and module in cl.inspect(tiny_bridge("mha"), torch.arange(5)).render_html()


def function_lengths() -> dict[str, int]:
    """Every top-level function of the front-end and its length in lines (to its closing brace at column 0)."""
    lengths = {}
    for path in sorted(STATIC.glob("*.js")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            found = re.match(r"(?:export )?(?:async )?function (\w+)", line)
            if found:
                end = next(j for j in range(i, len(lines)) if lines[j] == "}")
                lengths[f"{path.name}:{found.group(1)}"] = end - i + 1
    return lengths


def test_no_front_end_function_is_longer_than_sixty_lines() -> None:
    lengths = function_lengths()
    assert len(lengths) > 40 and "view.js:mount" in lengths
    assert {name: n for name, n in lengths.items() if n > 60} == {}


def test_the_jsdoc_types_check(tmp_path) -> None:
    """TypeScript's checker reads the JSDoc types (``// @ts-check``); skipped where it is not installed."""
    root = Path(__file__).resolve().parents[2]
    tsc = shutil.which("tsc") or next((str(p) for p in [root / "node_modules" / ".bin" / "tsc"] if p.is_file()), None)
    if tsc is None or NODE is None:
        pytest.skip("needs TypeScript's checker: npm ci (package.json pins typescript), or tsc on the PATH")
    result = subprocess.run([tsc, "-p", str(root / "tsconfig.json")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # The checker is not idle: a type error in a copy of the module is found.
    broken = tmp_path / "static"
    shutil.copytree(STATIC, broken)
    text = (
        (broken / "windows.js")
        .read_text(encoding="utf-8")
        .replace("return { index, cells: c };", 'return { index, cells: "c" };')
    )
    (broken / "windows.js").write_text(text, encoding="utf-8")
    config = {"extends": str(root / "tsconfig.json"), "include": [str(broken / "*.js")]}
    (tmp_path / "tsconfig.json").write_text(json.dumps(config), encoding="utf-8")
    result = subprocess.run([tsc, "-p", str(tmp_path / "tsconfig.json")], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "windows.js" in result.stdout, result.stdout
