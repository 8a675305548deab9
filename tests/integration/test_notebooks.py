"""The course in notebooks/: what a teacher hands out and what a reader gets.

Static checks read the notebooks as committed (prose, exercises, public names). The executed
check runs each notebook once, top to bottom (this file is the notebooks' only executor: pytest
does not collect notebooks/ with nbmake), then exports it to HTML with `cl.views.export_notebook`
(nbconvert's HTML, MathJax beside the page, widgets' static fallbacks) and checks that every
figure is in the page, that no output carries a warning and that every figure is followed by a
"What to notice" paragraph; headless Chromium then checks what a reader of the page sees
offline: formulas typeset (no raw ``$...$``), no progress bar stuck at "0%", every figure drawn,
the inspector's view where a cell shows an inspector. The same executed notebook is then exported
the way JupyterLab 4.6's *Save and Export Notebook As › HTML* does by default (sanitized): every
figure an image, no script source as text, no raw tags in the prose. The executed notebooks and
both HTML pages are kept under ``test-artifacts/notebooks/``.
"""

import json
import re
import time
from pathlib import Path

import nbformat
import pytest

import contribution_lens as cl
from conftest import ARTIFACTS
from helpers import CHROMEDRIVER, CHROMIUM, NEEDS_CHROMIUM, jupyter_running

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
IDS = [path.stem for path in NOTEBOOKS]
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
MIN_WORDS = 600
MAX_SECONDS = 300  # "under five minutes each" on a 2-core CPU
NOTICE = "**What to notice.**"


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def prose_words(notebook: nbformat.NotebookNode) -> int:
    """Words of markdown prose: display maths, inline code spans and HTML tags do not count."""
    words = 0
    for cell in notebook.cells:
        if cell.cell_type != "markdown":
            continue
        text = re.sub(r"\$\$.*?\$\$", " ", cell.source, flags=re.S)
        text = re.sub(r"<[^>]+>", " ", text)
        words += len(re.findall(r"[A-Za-z][A-Za-z'’-]*", text))
    return words


def is_solution(cell: nbformat.NotebookNode) -> bool:
    return cell.cell_type == "code" and "solution" in cell.metadata.get("tags", [])


def test_the_course_has_eleven_lessons_in_order() -> None:
    assert [path.name[:3] for path in NOTEBOOKS] == [f"{i:02d}_" for i in range(1, 12)], IDS


def test_the_readmes_course_table_lists_every_lesson_with_its_time() -> None:
    """The table a teacher reads first (README, included in the site's course page) matches the notebooks."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\d\d_\w+)` \|.*\| (\d+) min \|$", readme, flags=re.M)
    assert [name for name, _ in rows] == IDS, f"the README's course table lists {rows}, the notebooks are {IDS}"
    for name, minutes in rows:
        opening = read(NOTEBOOK_DIR / f"{name}.ipynb").cells[0].source
        stated = re.search(r"\*\*Time\.\*\* about (\d+) minutes", opening)
        assert stated and stated.group(1) == minutes, f"{name}: the README says {minutes} min, the notebook {stated}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_opens_with_what_it_teaches_and_how_long(path: Path) -> None:
    first = read(path).cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), f"{path.name} opens without a title"
    assert "**What you will learn.**" in first.source, f"{path.name}: the opening cell does not say what it teaches"
    assert re.search(r"\*\*Time\.\*\* about \d+ minutes", first.source), f"{path.name}: no time in the opening cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_explains_in_prose(path: Path) -> None:
    words = prose_words(read(path))
    assert words >= MIN_WORDS, f"{path.name} holds {words} words of prose, fewer than {MIN_WORDS}"


@pytest.mark.parametrize("path", NOTEBOOKS[1:], ids=IDS[1:])
def test_exercises_each_have_a_collapsed_solution(path: Path) -> None:
    cells = read(path).cells
    exercises = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and c.source.startswith("### Exercise")]
    assert len(exercises) >= 2, f"{path.name} has {len(exercises)} exercises, fewer than 2"
    for i in exercises:
        solution = cells[i + 1] if i + 1 < len(cells) else None
        title = cells[i].source.splitlines()[0]
        assert solution is not None and is_solution(solution), f"{path.name}: {title!r} is not followed by a solution"
        assert solution.metadata.get("jupyter", {}).get("source_hidden"), f"{path.name}: {title!r} solution is shown"
        assert "assert " in solution.source, f"{path.name}: {title!r} solution checks nothing"
    orphans = [cells[i].id for i, c in enumerate(cells) if is_solution(c) and i - 1 not in exercises]
    assert not orphans, f"{path.name}: solution cells {orphans} follow no '### Exercise' cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_uses_public_names_only(path: Path) -> None:
    code = "\n".join(c.source for c in read(path).cells if c.cell_type == "code")
    private = re.findall(r"\b(?:cl|contribution_lens|evaluation|faithfulness|data|plot|sinks)\._\w+", code)
    private += re.findall(r"from contribution_lens[\w.]* import .*\b_\w+", code)
    private += re.findall(r"contribution_lens\.\w*\._", code)
    assert not private, f"{path.name} uses private names: {private}"


def is_figure(output: nbformat.NotebookNode) -> bool:
    """A plotly figure: its MIME bundle, or the HTML that `cl.plot.use_in_notebook` makes plotly write."""
    data = output.get("data", {})
    return PLOTLY_MIME in data or 'class="plotly-graph-div"' in data.get("text/html", "")


def is_widget(output: nbformat.NotebookNode) -> bool:
    """A widget (the inspector, a progress bar)."""
    return WIDGET_VIEW in output.get("data", {})


def still_of(output: nbformat.NotebookNode) -> dict | None:
    """The view an inspector's still records (what a reopened notebook and an export show), or None."""
    return output.get("metadata", {}).get("contribution_lens", {}).get("still")


INSPECTOR_VIEWS = {
    "06_inspecting_heads": {
        "06-06": ({"view": "heatmap", "layer": 16, "head": 0, "factor": "attention", "scope": "inter"},
                  ["layer 16, head 0", "*attention*"]),
    },
    "09_explaining_a_prediction": {
        "9e1a65d5": ({"view": "prediction", "step": 0}, ["` Paris`'s heads heatmap"]),
        "7c33e6f2": ({"view": "heatmap", "layer": 23, "head": 4, "factor": "contribution", "scope": "inter", "step": 0},
                     ["L23H4", "*inter*"]),
    },
}  # fmt: skip
"""For each lesson that displays an inspector: per cell, the view its prose describes and the words saying so."""


def inspector_problems(name: str, notebook: nbformat.NotebookNode) -> list[str]:
    """Where an executed lesson's inspector shows (in its still: what an export shows) another view than its prose."""
    expected = INSPECTOR_VIEWS.get(name, {})
    problems = []
    for i, cell in enumerate(notebook.cells):
        stills = [still_of(out) for out in cell.get("outputs", []) if still_of(out) is not None]
        if not stills:
            continue
        if cell.id not in expected:
            problems.append(f"cell {cell.id} shows an inspector that INSPECTOR_VIEWS does not describe")
            continue
        view, words = expected[cell.id]
        for still in stills:
            wrong = {key: (value, still.get(key)) for key, value in view.items() if still.get(key) != value}
            if wrong:
                problems.append(f"cell {cell.id}: the inspector shows {wrong} (described, shown)")
        notice = notebook.cells[i + 1].source if i + 1 < len(notebook.cells) else ""
        problems += [f"the prose after cell {cell.id} does not say {w!r}" for w in words if w not in notice]
    shown = {cell.id for cell in notebook.cells if any(still_of(out) for out in cell.get("outputs", []))}
    problems += [f"cell {cell_id} shows no inspector" for cell_id in sorted(set(expected) - shown)]
    return problems


def test_inspector_problems_names_a_view_the_prose_does_not_describe() -> None:
    still = {"view": "heatmap", "layer": 27, "head": 7, "factor": "contribution", "scope": "inter", "step": 1}
    shown = nbformat.v4.new_output(
        "display_data", data={"text/plain": ""}, metadata={"contribution_lens": {"still": still}}
    )
    cells = [
        nbformat.v4.new_code_cell("inspector", id="9e1a65d5", outputs=[shown]),
        nbformat.v4.new_markdown_cell("**What to notice.** ` Paris`'s heads heatmap", id="note"),
        nbformat.v4.new_code_cell("other", id="other", outputs=[shown]),
    ]
    problems = inspector_problems("09_explaining_a_prediction", nbformat.v4.new_notebook(cells=cells))
    assert problems == [
        "cell 9e1a65d5: the inspector shows {'view': ('prediction', 'heatmap'), 'step': (0, 1)} (described, shown)",
        "cell other shows an inspector that INSPECTOR_VIEWS does not describe",
        "cell 7c33e6f2 shows no inspector",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_lesson_that_displays_an_inspector_says_which_view(path: Path) -> None:
    code = [c.source for c in read(path).cells if c.cell_type == "code" and not is_solution(c)]
    displays = any("cl.inspect(" in source for source in code)
    assert displays == (path.stem in INSPECTOR_VIEWS), (
        f"{path.name}: add the views of its inspectors to INSPECTOR_VIEWS"
    )


def figure_cells(notebook: nbformat.NotebookNode) -> list[int]:
    """Cells that draw a figure of their own (a widget's fallback is not one: the prose around it explains it)."""
    return [
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and any(is_figure(out) and not is_widget(out) for out in cell.get("outputs", []))
    ]


def warnings_in(notebook: nbformat.NotebookNode) -> list[str]:
    found = []
    for cell in notebook.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream" and out.name == "stderr" and "Warning" in out.text:
                found.append(f"cell {cell.id}: {out.text.strip()[:300]}")
            if out.output_type == "error":
                found.append(f"cell {cell.id}: {out.ename}: {out.evalue}")
    return found


def execute(path: Path) -> tuple[nbformat.NotebookNode, float, dict]:
    """The executed notebook, its time, and the values its prose quotes (`QUOTED`), read in its kernel at its end."""
    from nbclient import NotebookClient

    notebook = read(path)
    quoted = QUOTED.get(path.stem, {})
    if quoted:  # one cell more, read and removed: what the prose quotes, as the lesson's own objects hold it
        notebook.cells.append(nbformat.v4.new_code_cell(probe(quoted), id="quoted-values"))
    started = time.perf_counter()
    NotebookClient(
        notebook, timeout=MAX_SECONDS, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    seconds = time.perf_counter() - started
    values: dict = {}
    if quoted:
        cell = notebook.cells.pop()
        values = json.loads("".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream"))
    return notebook, seconds, values


# --- the numbers the prose quotes, read from the executed lesson --------------------------------------------

QUOTED: dict[str, dict[str, list[tuple[str, str]]]] = {
    "11_finding_a_circuit": {
        "11-03": [
            ("accuracy {:.1f} on the 16 prompts", "report.accuracy"),
            ("a mean logit difference of about {:.1f}", "report.mean"),
            ("interval of about [{:.1f}, {:.1f}]", "(report.low, report.high)"),
        ],
        "11-05": [
            (
                "The graph has {} nodes, {} inputs and {:,} edges",
                "(len(graph.nodes), len(graph.inputs), len(graph.edges))",
            ),
            ("hold about {:.2f} of the total", "top_share"),
            (
                "The largest of all, `{}` (about {:+.2f}), runs from a late head",
                "(ranked.iloc[0]['edge'], ranked.iloc[0]['score'])",
            ),
            (
                "The next two are positive, `{}` (about {:+.2f}) and `{}` (about {:+.2f})",
                "(ranked.iloc[1]['edge'], ranked.iloc[1]['score'], ranked.iloc[2]['edge'], ranked.iloc[2]['score'])",
            ),
            ("`{}` (about {:+.2f}) enters the value input", "(ranked.iloc[4]['edge'], ranked.iloc[4]['score'])"),
            ("Last in the table, `{}` (about {:+.2f})", "(ranked.iloc[7]['edge'], ranked.iloc[7]['score'])"),
        ],
        "11-07": [
            (
                "the clean logit difference is about {:.2f} and the counterfactual's about {:.2f}",
                "(live.clean.mean(), live.corrupted.mean())",
            ),
            ("swing of about {:.2f}", "live.clean.mean() - live.corrupted.mean()"),
            (
                "Its smallest circuit, {:.0f} edges chosen and {:.0f} left after pruning, already recovers about "
                "{:.2f}",
                "tuple(live.table.set_index(['selection', 'fraction']).loc[('absolute', 0.001), ['chosen', 'edges', "
                "'faithfulness']])",
            ),
            (
                "1 % of the edges recovers about {:.2f} and 10 % about {:.2f}",
                "tuple(saved.loc['eap', 'evaluation', 'absolute'].loc[[0.01, 0.1]])",
            ),
            (
                "recovers three quarters is {:.0f} % of the edges",
                "100 * saved.loc['eap', 'evaluation', 'absolute'].pipe(lambda f: f[f >= 0.75].index.min())",
            ),
            (
                "Its CMD is about {:.3f} (95 % interval about [{:.3f}, {:.3f}])",
                "tuple(areas.loc[('eap', 'evaluation'), ['cmd', 'cmd_low', 'cmd_high']])",
            ),
            ("even half of the edges recover only about {:.2f}", "saved.loc['eap', 'evaluation', 'signed', 0.5]"),
            (
                "Its CPR, about {:.2f} ([{:.2f}, {:.2f}]), is *below* the random control's, about {:.2f} ([{:.2f}, "
                "{:.2f}])",
                "(*areas.loc[('eap', 'evaluation'), ['cpr', 'cpr_low', 'cpr_high']], *areas.loc[('random', "
                "'evaluation'), ['cpr', 'cpr_low', 'cpr_high']])",
            ),
            (
                "they recover up to about {:.2f} of the logit difference (at {:.0f} % of the edges)",
                "(saved.loc['eap-ig', 'evaluation', 'signed'].max(), 100 * saved.loc['eap-ig', 'evaluation', "
                "'signed'].idxmax())",
            ),
            (
                "its CPR is about {:.2f} ([{:.2f}, {:.2f}])",
                "tuple(areas.loc[('eap-ig', 'evaluation'), ['cpr', 'cpr_low', 'cpr_high']])",
            ),
            ("as closely as EAP: CMD about {:.3f}", "areas.loc[('eap-ig', 'evaluation'), 'cmd']"),
            (
                "CMD about {:.2f}. Its CPR of about {:.2f} comes from its signed half, which recovers about {:.2f}",
                "(areas.loc[('random', 'evaluation'), 'cmd'], areas.loc[('random', 'evaluation'), 'cpr'], "
                "saved.loc['random', 'evaluation', 'signed', 0.5])",
            ),
            (
                "about {:.2f} at the smallest and {:.2f} at 1 % (against {:.2f} and {:.2f} on the evaluation prompts)",
                "(*saved.loc['eap', 'scoring', 'absolute'].loc[[0.001, 0.01]], *saved.loc['eap', 'evaluation', "
                "'absolute'].loc[[0.001, 0.01]])",
            ),
            (
                "(CMD about {:.3f} against {:.3f})",
                "(areas.loc[('eap', 'scoring'), 'cmd'], areas.loc[('eap', 'evaluation'), 'cmd'])",
            ),
        ],
        "11-07b": [
            (
                "EAP's signed 1 % circuit, {} edges before pruning, recovers about {:.2f}",
                '(len(hub_checks["EAP\'s signed 1 %"].edges), round(hub_results["EAP\'s signed 1 %"].faithfulness, 2)'
                " + 0.0)",
            ),
            (
                "With the one edge `{}` added it recovers about {:.2f} (interval about [{:.2f}, {:.2f}])",
                "(hub, hub_results[f'the same and {hub}'].faithfulness, *hub_results[f'the same and {hub}'].interval)",
            ),
            (
                "EAP scores that edge about {:+.2f} and EAP-IG about {:+.2f}",
                "(hub_scores['EAP'], hub_scores['EAP-IG'])",
            ),
            (
                "its signed 1 % circuit, which keeps the edge, recovers about {:.2f} ([{:.2f}, {:.2f}])",
                '(hub_results["EAP-IG\'s signed 1 %"].faithfulness, *hub_results["EAP-IG\'s signed 1 %"].interval)',
            ),
            ("out of the graph's {:,}", "len(graph.edges)"),
        ],
        "11-09": [
            (
                "recover only about {:.2f} of the logit difference on the evaluation prompts (interval about [{:.2f}, "
                "{:.2f}])",
                "(drawn_result.faithfulness, *drawn_result.interval)",
            ),
            ("as the curve said ({:.2f} for its smallest circuit)", "live.faithfulness[1, 0]"),
            ("The figure draws {} lines for the 40 edges", "len(figure_edges)"),
        ],
        "11-11": [
            (
                "{} writes the most, about {:.2f}, and it does so *through the S keys* (about {:.2f}; about "
                "{:.2f} through the IO key)",
                "(writers.index[0], *writers.iloc[0][['logit difference', 'through the S keys', 'through the IO "
                "key']])",
            ),
            ("it puts about {:.2f} of its attention on the subject", "writers.iloc[0]['attention to S']"),
            (
                "{} writes about {:.2f} while attending to neither name (about {:.2f} of its attention on S)",
                "(writers.index[1], *writers.iloc[1][['logit difference', 'attention to S']])",
            ),
            (
                "{} writes about {:.2f} in all, about {:.2f} through the IO key alone, and puts about {:.2f} "
                "of its attention on the",
                "tuple(head_row(mover_layer, mover_head)[k] for k in ('head', 'logit difference', 'through the "
                "IO key', 'attention to IO'))",
            ),
            (
                "Two heads write against the answer, {} (about {:.2f}) and {} (about {:.2f})",
                "(negative[0], writers.loc[negative[0], 'logit difference'], negative[1], "
                "writers.loc[negative[1], 'logit difference'])",
            ),
            (
                "{} looks at the indirect object too (about {:.2f} of its attention) and writes against it "
                "through the IO key (about {:.2f})",
                "(lambda n: (n, writers.loc[n, 'attention to IO'], writers.loc[n, 'through the IO "
                "key']))(max(negative, key=lambda n: writers.loc[n, 'attention to IO']))",
            ),
            ("no head below layer 20 writes more than about {:.2f} either way", "terms[0, :20].abs().max()"),
        ],
        "11-13": [
            (
                "keeps only between about {:.2f} and {:.2f} of the logit difference",
                "writer_checks['the three answer writers'].interval",
            ),
            ("$f$ between about {:.2f} and {:.2f}", "writer_checks['the two negative writers'].interval"),
            (
                "three other late heads ({}) leave it where it was, about {:.3f} (interval [{:.3f}, {:.3f}])",
                "(', '.join(others), writer_checks['three other heads of layers 20-29'].faithfulness, "
                "*writer_checks['three other heads of layers 20-29'].interval)",
            ),
            ("For the name mover {} at the last position", "mover"),
        ],
        "11-15": [
            ("The name mover is {} (the largest", "mover"),
            (
                "The largest query-side advantage at the IO key is {}'s, about {:.2f}, ahead of {} (about "
                "{:.2f}) and {} (about {:.2f})",
                "tuple(x for name in query_side.index[:3] for x in (name, query_side[name]))",
            ),
            (
                "{} puts about {:.2f} of its attention, from the last position, on the subject: it reads S and "
                "writes into the end's stream what makes {}'s",
                "(inhibitors[0], head_row(*map(int, inhibitors[0][1:].split('H')))['attention to S'], mover)",
            ),
            ("into {}'s query input carry the counterfactual", "mover"),
        ],
        "11-17": [
            (
                "into {}'s query input lowers the faithfulness to about {:.2f} (interval about [{:.2f}, {:.2f}])",
                "(mover, query_results['edges inhibitors -> mover<q> patched'].faithfulness, "
                "*query_results['edges inhibitors -> mover<q> patched'].interval)",
            ),
            (
                "costs more, about {:.2f} ([{:.2f}, {:.2f}])",
                "(query_results['the inhibitors patched (nodes)'].faithfulness, *query_results['the inhibitors "
                "patched (nodes)'].interval)",
            ),
            (
                "leaves it at about {:.2f} ([{:.2f}, {:.2f}])",
                "(query_results['three other edges into mover<q> patched'].faithfulness, *query_results['three "
                "other edges into mover<q> patched'].interval)",
            ),
            ("The S-inhibition head {} attends", "inhibitor"),
        ],
        "11-19": [
            (
                "{} first (about {:.2f}), then {} (about {:.2f}), {} (about {:.2f}), {} (about {:.2f}) and {} "
                "(about {:.2f})",
                "tuple(x for name in key_side.index[:5] for x in (name, key_side[name]))",
            ),
            (
                "{} attends to the token after S1 (about {:.2f} of its attention): an **induction head**",
                "(induction_head, key_table.loc[induction_head, 'attention S2 -> S1+1 (induction)'])",
            ),
            (
                "{} does too, more weakly (about {:.2f})",
                "(lambda c: (c.index[1], c.iloc[1]))(key_table['attention S2 -> S1+1 (induction)'].sort_values("
                "ascending=False))",
            ),
            (
                "(the most, {}, about {:.2f})",
                "(duplicate_head, key_table.loc[duplicate_head, 'attention S2 -> S1 (duplicate token)'])",
            ),
            ("the key input of {}'s group", "inhibitor"),
        ],
        "11-21": [
            (
                "leaves the faithfulness at about {:.3f} (interval about [{:.3f}, {:.3f}])",
                "(key_results[f'edges -> {key_input} patched'].faithfulness, *key_results[f'edges -> {key_input} "
                "patched'].interval)",
            ),
            (
                "value input carry more: patched, they lower it to about {:.3f} ([{:.3f}, {:.3f}])",
                "(key_results[f'edges -> {value_input} patched'].faithfulness, *key_results[f'edges -> "
                "{value_input} patched'].interval)",
            ),
            (
                "cost more, about {:.2f} ([{:.2f}, {:.2f}])",
                "(key_results['the key-side heads patched (nodes)'].faithfulness, *key_results['the key-side "
                "heads patched (nodes)'].interval)",
            ),
            ("a name mover, {}, three quarters", "mover"),
            (
                "a negative name mover, {}, which attends to the indirect object and writes against it, and "
                "another negative writer, {},",
                "tuple(sorted(negative, key=lambda n: -writers.loc[n, 'attention to IO']))",
            ),
            ("an S-inhibition head, {}, attending", "inhibitor"),
            ("an induction head, {}. Three things differ", "induction_head"),
            ("The largest direct writer, {}, is not", "writers.index[0]"),
            (
                "EAP's circuits need {:.0f} % of the {:,} edges",
                "(100 * saved.loc['eap', 'evaluation', 'absolute'].pipe(lambda f: f[f >= 0.75].index.min()), "
                "len(graph.edges))",
            ),
        ],
        "11-21a": [
            ("(the curve's smallest, which read {:.2f})", "live.faithfulness[1, 0]"),
        ],
    },
}
"""For each lesson whose prose quotes what its cells compute: per markdown cell, each phrase that quotes a result (a
format string) and the expression, evaluated in the lesson's kernel once it has run, whose value it quotes (a
tuple for several fields). A lesson opts in by declaring its quotes here; a lesson that declares none is not
checked. In a lesson that does, every decimal number, grouped integer and head or MLP name of every markdown cell
(outside code and formulas) must lie in such a phrase, and every phrase must read as the values give it: a change
that moves a number fails here, naming the cell, what it says and what the lesson computed."""
QUOTE = re.compile(r"(?<![\w.])-?\d+\.\d+|(?<![\w.,])\d{1,3}(?:,\d{3})+(?![\d,])|\bL\d+(?:H\d+|\.mlp)\b")
"""What counts as a quoted result in prose: 0.87, -1.60, 70,651, L23H0, L18.mlp (a share such as "10 %" is a size the
lesson chooses, and a count such as "4 prompts" one it sets)."""


def probe(quoted: dict[str, list[tuple[str, str]]]) -> str:
    """The code of the cell that prints, as JSON, every expression `QUOTED` names for one lesson."""
    expressions = sorted({expression for phrases in quoted.values() for _, expression in phrases})
    return (
        "import json as _json\n\n"
        "def _plain(value):\n"
        "    if isinstance(value, (tuple, list)):\n"
        "        return [_plain(v) for v in value]\n"
        "    return value.item() if hasattr(value, 'item') else value\n\n"
        f"print(_json.dumps({{e: _plain(eval(e)) for e in {expressions!r}}}))"
    )


def unquoted_spans(source: str) -> list[tuple[int, int]]:
    """The spans of ``source`` that quote nothing: code (`...`) and formulas ($...$, $$...$$)."""
    return [m.span() for m in re.finditer(r"`[^`]*`|\$\$.+?\$\$|\$[^$]+\$", source, flags=re.S)]


def quoted_problems(name: str, notebook: nbformat.NotebookNode, values: dict) -> list[str]:
    """Where a lesson's prose quotes a number its cells do not give, or quotes one that `QUOTED` does not read.

    Only a lesson that declares its quotes in `QUOTED` is checked: one that declares none has opted out.
    """
    if name not in QUOTED:
        return []
    quoted = QUOTED[name]
    problems = []
    for cell in notebook.cells:
        if cell.cell_type != "markdown":
            continue
        covered = []
        for phrase, expression in quoted.get(cell.id, []):
            value = values[expression]
            said = phrase.format(*value) if isinstance(value, list) else phrase.format(value)
            start = cell.source.find(said)
            if start < 0:
                problems.append(f"cell {cell.id} does not say {said!r} ({expression} = {value})")
            else:
                covered.append((start, start + len(said)))
        skipped = unquoted_spans(cell.source)
        for match in QUOTE.finditer(cell.source):
            start, end = match.span()
            if not any(a <= start and end <= b for a, b in [*skipped, *covered]):
                problems.append(f"cell {cell.id} quotes {match.group(0)!r}, which QUOTED does not read from the lesson")
    return problems


def test_quoted_problems_names_a_number_the_lesson_does_not_give() -> None:
    cells = [nbformat.v4.new_markdown_cell("The CPR is about 0.87, and L23H0 writes 0.71 (`fraction=0.001`).", id="a")]
    notebook = nbformat.v4.new_notebook(cells=cells)
    QUOTED["demo"] = {"a": [("CPR is about {:.2f}", "curve.cpr"), ("{} writes {:.2f}", "(mover, term)")]}
    try:
        assert quoted_problems("demo", notebook, {"curve.cpr": 0.871, "(mover, term)": ["L23H0", 0.714]}) == []
        assert quoted_problems("demo", notebook, {"curve.cpr": 0.85, "(mover, term)": ["L23H0", 0.714]}) == [
            "cell a does not say 'CPR is about 0.85' (curve.cpr = 0.85)",
            "cell a quotes '0.87', which QUOTED does not read from the lesson",
        ]
        QUOTED["demo"] = {"a": [("CPR is about {:.2f}", "curve.cpr")]}
        assert quoted_problems("demo", notebook, {"curve.cpr": 0.871}) == [
            "cell a quotes 'L23H0', which QUOTED does not read from the lesson",
            "cell a quotes '0.71', which QUOTED does not read from the lesson",
        ]
        # A lesson that declares an entry, even an empty one, is checked in every markdown cell ...
        QUOTED["demo"] = {}
        assert quoted_problems("demo", notebook, {}) == [
            "cell a quotes '0.87', which QUOTED does not read from the lesson",
            "cell a quotes 'L23H0', which QUOTED does not read from the lesson",
            "cell a quotes '0.71', which QUOTED does not read from the lesson",
        ]
    finally:
        del QUOTED["demo"]
    # ... and one that declares none (lessons 01-10) has not opted in: its prose is not checked.
    assert "demo" not in QUOTED and quoted_problems("demo", notebook, {}) == []


def export_problems(notebook: nbformat.NotebookNode, html: str) -> list[str]:
    """What a reader of the executed notebook or of its HTML export would miss or be warned about."""
    problems = [f"warning or error in {found}" for found in warnings_in(notebook)]
    figures = figure_cells(notebook)
    if not figures:
        problems.append("no figure")
    for i in figures:
        cell_id = notebook.cells[i].id
        after = notebook.cells[i + 1] if i + 1 < len(notebook.cells) else None
        if after is None or after.cell_type != "markdown" or not after.source.startswith(NOTICE):
            problems.append(f"the figure of cell {cell_id} is not followed by a {NOTICE!r} paragraph")
        elif not re.search(r"\d", after.source):
            problems.append(f"the notice after cell {cell_id} names no number")
    n_figures = sum(is_figure(out) for cell in notebook.cells for out in cell.get("outputs", []))
    divs = re.findall(r'<div class="plotly-graph-div" id="([\w-]+)"', html)
    drawn = [div for div in divs if re.search(rf'Plotly\.newPlot\(\s*"{div}",\s*\[\{{', html)]
    if len(drawn) != n_figures:
        problems.append(f"{n_figures} figures, {len(drawn)} drawn with data in the HTML")
    if len(re.findall(r"plotly\.js v\d", html)) != 1:
        problems.append("plotly.js is not embedded exactly once in the HTML")
    if re.search(r"<script[^>]+src=[\"'][^\"']*plot\.ly", html):
        problems.append("the HTML loads plotly.js from a CDN")
    return problems


def test_export_problems_names_what_a_reader_would_miss() -> None:
    figure = nbformat.v4.new_output(
        "display_data", data={"text/html": '<div class="plotly-graph-div" id="abc"></div>', "text/plain": ""}
    )
    warning = nbformat.v4.new_output("stream", name="stderr", text="UserWarning: something\n")
    cells = [
        nbformat.v4.new_code_cell("figure", id="fig", outputs=[figure]),
        nbformat.v4.new_markdown_cell("**What to notice.** nothing countable", id="note"),
        nbformat.v4.new_code_cell("warn", id="warn", outputs=[warning, figure]),
        nbformat.v4.new_code_cell("after", id="after"),
    ]
    problems = export_problems(nbformat.v4.new_notebook(cells=cells), html="<p>no plots</p>")
    assert problems == [
        "warning or error in cell warn: UserWarning: something",
        "the notice after cell fig names no number",
        "the figure of cell warn is not followed by a '**What to notice.**' paragraph",
        "2 figures, 0 drawn with data in the HTML",
        "plotly.js is not embedded exactly once in the HTML",
    ]


# What a reader sees, read from the page once MathJax has finished: markdown text outside code and
# typeset maths, MathJax's output and error elements, progress bars' text, the inspector's figure.
SEEN = """
const hub = window.MathJax && MathJax.Hub;
if (!hub || hub.queue.pending || hub.queue.running || !document.querySelector('.jp-MarkdownCell')) return null;
const prose = [...document.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown')].map(cell => {
    const copy = cell.cloneNode(true);
    copy.querySelectorAll('code, pre, script, .MathJax, .MathJax_Display, .MathJax_Preview').forEach(e => e.remove());
    return copy.innerText;
}).join('\\n');
const plots = [...document.querySelectorAll('.js-plotly-plot')];
return {
    prose: prose,
    formulas: document.querySelectorAll('.MathJax').length,
    tex: document.querySelectorAll('script[type^="math/tex"]').length,
    errors: document.querySelectorAll('.MathJax .merror, .MathJax_Display .merror').length
        + (document.body.innerText.includes('Math Processing Error') ? 1 : 0),
    outputs: [...document.querySelectorAll('.jp-OutputArea')].map(e => e.innerText).join('\\n'),
    plots: plots.length,
    drawn: plots.filter(gd => gd.querySelector('.main-svg') && gd.data && gd.data.length).length,
    inspectors: [...document.querySelectorAll('.jp-CodeCell')].filter(cell =>
        [...cell.querySelectorAll('img[src^="data:image/png"]')].some(img => img.complete && img.naturalWidth > 300)
    ).map(cell => cell.id),
};
"""
RAW_TEX = re.compile(r"\$[^$\n]+\$|\\(?:frac|sum|alpha|lVert|langle|tilde)\b")
STUCK_BAR = re.compile(r"(?:^|\s)0%(?:\||\s)")  # tqdm's first frame: "Loading weights:   0%|   | 0/272"


def seen_in_browser(browser, page: Path) -> dict:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(page.resolve().as_uri())
    return WebDriverWait(browser, 120, poll_frequency=0.5).until(lambda b: b.execute_script(SEEN))


def reader_problems(seen: dict, *, figures: int, inspectors: list[str]) -> list[str]:
    """What a reader of the exported page would miss, from `SEEN`."""
    problems = []
    if seen["formulas"] < seen["tex"] or seen["errors"]:
        problems.append(f"{seen['tex']} formulas, {seen['formulas']} typeset, {seen['errors']} with errors")
    raw = RAW_TEX.findall(seen["prose"])
    if raw:
        problems.append(f"raw TeX left in the prose: {raw[:3]}")
    stuck = [line for line in seen["outputs"].splitlines() if STUCK_BAR.search(line)]
    if stuck:
        problems.append(f"a progress bar stuck at 0%: {stuck[:2]}")
    if seen["drawn"] != figures or seen["plots"] != figures:
        problems.append(f"{figures} figures, {seen['plots']} plot areas, {seen['drawn']} drawn with data")
    if sorted(seen["inspectors"]) != sorted(f"cell-id={i}" for i in inspectors):
        problems.append(f"inspector figures in {seen['inspectors']}, expected in cells {inspectors}")
    return problems


def inspector_cells(notebook: nbformat.NotebookNode) -> list[str]:
    """Cells showing an inspector's still drawn as an image."""
    return [
        cell.id
        for cell in notebook.cells
        if any(still_of(out) and "image/png" in out.get("data", {}) for out in cell.get("outputs", []))
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One Jupyter server for every lesson's export, as installed (its extensions as `jupyter_server_config.d` enables
    them), with an empty user config: ``{"url", "token", "root"}``."""
    pytest.importorskip("jupyter_server", reason="needs jupyter_server (the dev extras)")
    root, home = tmp_path_factory.mktemp("served"), tmp_path_factory.mktemp("server-home")
    with jupyter_running("server", root, home) as running:
        yield running


def server_export(server: dict, notebook: nbformat.NotebookNode, name: str) -> str:
    """The page JupyterLab 4.6's *File › Save and Export Notebook As › HTML* downloads from a running server.

    JupyterLab asks "Sanitize HTML output" (ticked) and sends
    ``/nbconvert/html/PATH?download=true&sanitize_html=true``: the server exports with its own config, which
    the package's server extension (`contribution_lens.views.server_extension`) sets when the server starts.
    """
    import urllib.request

    nbformat.write(notebook, server["root"] / f"{name}.ipynb")
    address = f"{server['url']}/nbconvert/html/{name}.ipynb?download=true&sanitize_html=true&token={server['token']}"
    with urllib.request.urlopen(address, timeout=300) as answer:
        return answer.read().decode("utf-8")


def nbconvert_export(notebook: nbformat.NotebookNode, filters: dict | None = None) -> str:
    """nbconvert's sanitized HTML export in this process, with ``filters`` (none: nbconvert's own): for the checks'
    own test, which needs a page whose faults are known."""
    from nbconvert.exporters import get_exporter
    from traitlets.config import Config

    config = Config({"HTMLExporter": {"filters": filters or {}}})
    exporter = get_exporter("html", config=config)(config=config)
    exporter.sanitize_html = True
    page, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"name": "lesson"}})
    return page


RAW_TAG = re.compile(r"&lt;/?(p|h[1-6]|div|span|img|br|hr|a|script|style|table|tr|td|th|ul|ol|li|strong|em)\b")
SCRIPT_TEXT = ("Plotly.newPlot", "plotly.js v", "window.PlotlyConfig", "&lt;script")
CSS_TEXT = re.compile(r"\.dataframe\s+(?:tbody|thead)|vertical-align:\s*(?:top|middle)")
"""A DataFrame's style element printed as text (nbconvert's own filter escapes it)."""
MARKDOWN_MATH = re.compile(r"\$\$.+?\$\$|(?<![\\$])\$(?![\s$])[^$]+?(?<![\s\\])\$(?!\d)", flags=re.S)


def sanitized_problems(notebook: nbformat.NotebookNode, page: str) -> list[str]:
    """What a reader of JupyterLab's default (sanitized) export would miss: figures, prose, tables, formulas offline."""
    problems = []
    figures = [out for cell in notebook.cells for out in cell.get("outputs", []) if is_figure(out)]
    stills = [out for cell in notebook.cells for out in cell.get("outputs", []) if still_of(out)]
    without = sum("image/png" not in out.get("data", {}) for out in figures)
    if without:
        problems.append(f"{without} of {len(figures)} figures carry no image/png")
    images = len(re.findall(r'<img[^>]+src="data:image/png;base64,', page))
    if images < len(figures) + len(stills):
        problems.append(f"{images} images in the page, {len(figures)} figures and {len(stills)} stills")
    # A script element is not shown (the export keeps the widgets' state in one, the inspector's front-end
    # source included); script source escaped into the page's text is. The page's own styles are not text either.
    shown = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.S)
    problems += [f"script text in the page: {text!r}" for text in SCRIPT_TEXT if text in shown]
    if CSS_TEXT.search(shown):
        problems.append(f"CSS as text in the page: {CSS_TEXT.search(shown).group(0)!r}")
    prose = re.sub(r"<(code|pre)\b.*?</\1>", " ", shown, flags=re.S)  # a tag written as code is code
    raw = RAW_TAG.findall(prose)
    if raw:
        problems.append(f"raw tags in the page: {sorted(set(raw))[:5]}")
    # A table keeps its labels: every DataFrame output's header cells are header cells in the page.
    tables = [out.get("data", {}).get("text/html", "") for cell in notebook.cells for out in cell.get("outputs", [])]
    labels = sum(html.count("<th") for html in tables if "dataframe" in html)
    if prose.count("<th") < labels:
        problems.append(f"{labels} table labels in the outputs, {prose.count('<th')} in the page")
    # Formulas readable offline: drawn as MathML (no script, no network), none left as TeX in the prose.
    sources = "\n".join(re.sub(r"`[^`]*`", " ", c.source) for c in notebook.cells if c.cell_type == "markdown")
    formulas = len(MARKDOWN_MATH.findall(sources))
    text = re.sub(r"<math\b.*?</math>", " ", prose, flags=re.S)
    tex = RAW_TEX.findall(re.sub(r"<[^>]+>", " ", text))
    if formulas and (prose.count("<math") < formulas or tex):
        problems.append(f"{formulas} formulas, {prose.count('<math')} drawn offline, TeX left: {tex[:3]}")
    return problems


def test_sanitized_problems_names_what_a_reader_would_miss() -> None:
    html_figure = nbformat.v4.new_output(
        "display_data",
        data={"text/html": '<div class="plotly-graph-div" id="a"></div><script>Plotly.newPlot()</script>'},
    )
    cells = [
        nbformat.v4.new_markdown_cell("# Title\n\nA paragraph with `<div>` as code and $c_{ij}$."),
        nbformat.v4.new_code_cell("figure", outputs=[html_figure]),
    ]
    ours = {"clean_html": "contribution_lens.views.export.clean_html"}
    notebook = nbformat.v4.new_notebook(cells=cells)
    assert sanitized_problems(notebook, nbconvert_export(notebook, ours)) == [
        "1 of 1 figures carry no image/png",
        "0 images in the page, 1 figures and 0 stills",
    ]
    prose = nbformat.v4.new_notebook(cells=cells[:1])
    assert sanitized_problems(prose, nbconvert_export(prose, ours)) == []
    # The widgets' state travels in a script element, which no reader sees: not a problem.
    state = '<script type="application/vnd.jupyter.widget-state+json">{"_esm": "Plotly.newPlot(node)"}</script>'
    assert sanitized_problems(prose, nbconvert_export(prose, ours).replace("</body>", state + "</body>")) == []
    # nbconvert's own filter escapes every paragraph and heading, and leaves the formula for a MathJax from a CDN.
    assert sanitized_problems(prose, nbconvert_export(prose)) == [
        "raw tags in the page: ['h1', 'p']",
        "1 formulas, 0 drawn offline, TeX left: ['$c_{ij}$']",
    ]
    table = nbformat.v4.new_output("display_data", data={"text/html": pd_table_html()})
    framed = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("table", outputs=[table])])
    assert sanitized_problems(framed, nbconvert_export(framed, ours)) == []
    assert sanitized_problems(framed, nbconvert_export(framed))[0].startswith("CSS as text in the page")


def pd_table_html() -> str:
    """A DataFrame's HTML output, its style element and header cells included."""
    import pandas as pd

    return pd.DataFrame({"faithfulness": [0.5]}, index=["eap"])._repr_html_()


@pytest.mark.slow
def test_jupyterlabs_own_export_through_a_running_server_reads_as_the_notebook(server) -> None:
    # Failed before: the package installed a config file in jupyter_server_config.d, which a server reads only to
    # enable extensions: its export (the request JupyterLab sends) escaped every paragraph, heading and table.
    cells = [
        nbformat.v4.new_markdown_cell("# Export\n\nThe weights $c_{ij}$ sum to 1:\n\n$$\\sum_j c_{ij} = 1$$"),
        nbformat.v4.new_code_cell("table", outputs=[nbformat.v4.new_output("display_data",
                                                                           data={"text/html": pd_table_html()})]),
    ]  # fmt: skip
    notebook = nbformat.v4.new_notebook(cells=cells)
    page = server_export(server, notebook, "probe")
    assert not sanitized_problems(notebook, page), sanitized_problems(notebook, page)
    assert '<h1 id="Export">' in page and page.count("<math") == 2 and "<th>faithfulness</th>" in page


def export(notebook: nbformat.NotebookNode, name: str) -> tuple[Path, str]:
    target = cl.views.export_notebook(notebook, ARTIFACTS / "notebooks" / f"{name}.html")
    return target, target.read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.browser
@NEEDS_CHROMIUM
def test_an_exported_notebook_shows_formulas_finished_bars_and_the_inspectors_view(browser) -> None:
    from nbclient import NotebookClient

    cells = [
        nbformat.v4.new_markdown_cell(
            "# Export\n\nInline $c_{ij} = \\alpha_{ij}$, displayed:\n\n$$\\sum_j c_{ij} = 1$$", id="maths"
        ),
        nbformat.v4.new_code_cell(
            "import contribution_lens as cl\n\ncl.plot.use_in_notebook()\nmodel = cl.load_model()"
        ),
        nbformat.v4.new_code_cell(
            "from tqdm.auto import tqdm\n\nfor _ in tqdm(range(3), desc='work'):\n    pass", id="bar"
        ),
        nbformat.v4.new_code_cell(
            "inspector = cl.inspect(model, 'The cat sat on the mat.', layer=3, head=2)\ninspector", id="inspector"
        ),
        nbformat.v4.new_code_cell("inspector.factor = 'attention'\ninspector", id="changed"),
    ]
    notebook = nbformat.v4.new_notebook(cells=cells)
    NotebookClient(notebook, timeout=MAX_SECONDS, kernel_name="python3").execute()
    assert not warnings_in(notebook)
    page, html = export(notebook, "export_check")
    assert "mathjax/MathJax.js" in html and not re.search(r"<script[^>]+src=[\"']https?://", html)
    seen = seen_in_browser(browser, page)
    assert not reader_problems(seen, figures=0, inspectors=["inspector", "changed"]), reader_problems(
        seen, figures=0, inspectors=["inspector", "changed"]
    )
    assert seen["formulas"] == seen["tex"] == 2
    assert re.search(r"work: 100% 3/3", seen["outputs"]), "the bar's last frame is not in the page"
    assert "Loading weights" not in seen["outputs"]
    # Both cells show the one widget: the still of each is its last view (attention), one PNG per output.
    stills = [still_of(out) for cell in notebook.cells for out in cell.get("outputs", []) if still_of(out)]
    assert [(s["factor"], s["layer"], s["head"]) for s in stills] == [("attention", 3, 2)] * 2
    assert len(re.findall(r'<img[^>]+src="data:image/png;base64,', html)) == 2 and "plotly.js v" not in html


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_and_exports_with_every_figure(path: Path, request, server) -> None:
    notebook, seconds, values = execute(path)
    nbformat.write(notebook, (ARTIFACTS / "notebooks").mkdir(parents=True, exist_ok=True) or
                   ARTIFACTS / "notebooks" / f"{path.stem}.executed.ipynb")  # fmt: skip
    page, html = export(notebook, path.stem)
    assert not export_problems(notebook, html), f"{path.name}: {export_problems(notebook, html)}"
    # JupyterLab's default export of the same executed notebook, from a running server: sanitized, every figure an
    # image, the prose's tags, tables and formulas as a reader sees them offline.
    sanitized = server_export(server, notebook, path.stem)
    (ARTIFACTS / "notebooks" / f"{path.stem}.jupyterlab.html").write_text(sanitized, encoding="utf-8")
    assert not sanitized_problems(notebook, sanitized), f"{path.name}: {sanitized_problems(notebook, sanitized)}"
    assert not inspector_problems(path.stem, notebook), f"{path.name}: {inspector_problems(path.stem, notebook)}"
    assert not quoted_problems(path.stem, notebook, values), (
        f"{path.name}: {quoted_problems(path.stem, notebook, values)}"
    )
    if CHROMIUM is not None and CHROMEDRIVER is not None:
        figures = sum(is_figure(out) for cell in notebook.cells for out in cell.get("outputs", []))
        seen = seen_in_browser(request.getfixturevalue("browser"), page)
        problems = reader_problems(seen, figures=figures, inspectors=inspector_cells(notebook))
        assert not problems, f"{path.name} exported: {problems}"
    assert seconds < MAX_SECONDS, f"{path.name} took {seconds:.0f} s, more than {MAX_SECONDS} s"
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("the exported page was not opened: needs Debian's chromium and chromium-driver")
