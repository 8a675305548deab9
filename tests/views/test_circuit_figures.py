"""The circuits' figures (`contribution_lens.drawing.circuit_figures`): the drawn traces' data and hover text."""

import pandas as pd
import plotly.colors
import plotly.graph_objects as go
import pytest

from contribution_lens.drawing.circuit_figures import INPUTS, circuit_figure, faithfulness_figure, node_position

N_LAYERS, N_HEADS = 2, 3

NODES = pd.DataFrame(
    {
        "node": ["embed", "L0H0", "L0H2", "L0.mlp", "L1H1", "L1.mlp", "logits"],
        "score": [0.0, 0.8, -0.3, 0.2, 1.5, -0.1, 0.0],
    }
)
EDGES = pd.DataFrame(
    [
        ("embed", "L0H0", "v", 0.5),
        ("embed", "L0H2", "k", -0.25),
        ("L0H0", "L1H1", "q", 1.0),
        ("L0H2", "L1H1", "k", -2.0),
        ("L0H0", "L1H1", "v", 0.1),
        ("L0.mlp", "L1.mlp", "", 0.4),
        ("L1H1", "logits", "", 1.5),
    ],
    columns=["upstream", "downstream", "input", "score"],
)


def lines(figure: go.Figure) -> list[go.Scatter]:
    """The edges' line traces (one per edge)."""
    return [t for t in figure.data if t.mode == "lines" and t.x[0] is not None]


def hover(figure: go.Figure) -> dict[str, go.Scatter]:
    return {t.name: t for t in figure.data if t.name.startswith("edges")}


def rgb(colour: str) -> tuple[float, ...]:
    return plotly.colors.unlabel_rgb(colour)


def test_node_positions_go_bottom_up() -> None:
    place = lambda node: node_position(node, n_layers=N_LAYERS, n_heads=N_HEADS)  # noqa: E731
    heights = [place(node)[1] for node in ["embed", "L0H2", "L0.mlp", "L1H0", "L1.mlp", "logits"]]
    assert heights == sorted(heights) and len(set(heights)) == len(heights)
    assert [place(f"L1H{h}")[0] for h in range(3)] == [0.0, 1.0, 2.0]
    assert place("pos_embed")[1] == place("embed")[1] == 0.0


def test_circuit_figure_draws_each_given_edge_once_with_its_hover_text() -> None:
    figure = circuit_figure(NODES, EDGES, n_layers=N_LAYERS, n_heads=N_HEADS, title="IOI")
    assert len(lines(figure)) == len(EDGES)
    texts = [text for trace in hover(figure).values() for text in trace.hovertext]
    assert sorted(texts) == sorted(
        [
            "embed → L0H0 (v)<br>score=0.5",
            "embed → L0H2 (k)<br>score=-0.25",
            "L0H0 → L1H1 (q)<br>score=1",
            "L0H2 → L1H1 (k)<br>score=-2",
            "L0H0 → L1H1 (v)<br>score=0.1",
            "L0.mlp → L1.mlp<br>score=0.4",
            "L1H1 → logits<br>score=1.5",
        ]
    )
    assert figure.layout.annotations[0].text.startswith("IOI: 7 edges")
    # The nodes: every one given, with its score in its hover text, coloured on a scale centred at 0.
    nodes = next(t for t in figure.data if t.name == "nodes")
    assert list(nodes.customdata) == list(NODES["node"])
    assert list(nodes.text) == ["embed", "H0", "H2", "mlp", "H1", "mlp", "logits"]  # each row's tick names its layer
    assert "L1H1<br>score=1.5" in nodes.hovertext and nodes.marker.cmid == 0
    assert nodes.marker.cmin == -nodes.marker.cmax == -1.5


def test_edges_are_sized_by_score_coloured_by_sign_and_dashed_by_input() -> None:
    figure = circuit_figure(NODES, EDGES, n_layers=N_LAYERS, n_heads=N_HEADS)
    drawn = {(t.name, t.line.dash): t for t in lines(figure)}
    strongest = drawn[("L0H2 → L1H1", INPUTS["k"])]
    assert strongest.line.width == 8.0 and strongest is lines(figure)[-1]  # the largest |score|, drawn last (on top)
    weakest = drawn[("L0H0 → L1H1", INPUTS["v"])]
    assert weakest.line.width == pytest.approx(0.5 + 7.5 * 0.1 / 2.0, abs=0.01)
    # Diverging colours centred at 0: red for +, blue for −, paler the smaller |score|.
    red, _, blue = rgb(drawn[("L0H0 → L1H1", INPUTS["q"])].line.color)
    assert red > blue
    red, _, blue = rgb(strongest.line.color)
    assert blue > red
    assert rgb(weakest.line.color)[1] > rgb(drawn[("L0H0 → L1H1", INPUTS["q"])].line.color)[1]
    # q, k and v of one head end at three different points under it.
    ends = {t.line.dash: (t.x[1], t.y[1]) for t in lines(figure) if t.name == "L0H0 → L1H1" or t.name == "L0H2 → L1H1"}
    assert len(set(ends.values())) == 3 and all(
        y < node_position("L1H1", n_layers=2, n_heads=3)[1] for _, y in ends.values()
    )
    # One legend entry per input kind drawn, named for it, that shows and hides its edges.
    legend = [t for t in figure.data if t.showlegend is not False and t.x == (None,)]
    assert [t.name for t in legend] == [
        "into a head's query (q)",
        "into a head's key (k)",
        "into a head's value (v)",
        "into an MLP or the logits",
    ]
    assert [t.line.dash for t in legend] == list(INPUTS.values())
    assert {t.legendgroup for t in lines(figure)} == set(INPUTS)


def test_a_pruned_circuit_draws_only_its_edges() -> None:
    top = EDGES.loc[EDGES["score"].abs().nlargest(2).index]
    figure = circuit_figure(NODES.iloc[:0], top, n_layers=N_LAYERS, n_heads=N_HEADS)
    assert {t.name for t in lines(figure)} == {"L0H2 → L1H1", "L1H1 → logits"}
    nodes = next(t for t in figure.data if t.name == "nodes")
    assert sorted(nodes.customdata) == ["L0H2", "L1H1", "logits"]  # the ends of the edges, without scores
    assert all(text.endswith("score: none") for text in nodes.hovertext)
    assert [t.name for t in figure.data if t.x == (None,)] == ["into a head's key (k)", "into an MLP or the logits"]


@pytest.mark.usefixtures("as_a_user")
@pytest.mark.parametrize(
    ("nodes", "edges", "keywords", "message"),
    [
        (NODES.drop(columns="score"), EDGES, {}, "nodes lacks the column(s) score"),
        (NODES, EDGES.drop(columns="input"), {}, "edges lacks the column(s) input"),
        (NODES, EDGES, {"n_heads": 0}, "n_heads must be a positive integer, got 0"),
        (NODES, EDGES, {"n_layers": 1}, "node 'L1H1' is not a node of a 1-layer model with 3 heads"),
        (NODES, EDGES.assign(input="q"), {}, "edges: the input of L0.mlp → L1.mlp is 'q'; expected '' (one input)"),
        (NODES, EDGES.assign(input=""), {}, "edges: the input of embed → L0H0 is ''; expected 'q', 'k' or 'v'"),
        (pd.DataFrame({"node": ["L0.attn"], "score": [1.0]}), EDGES, {}, "node 'L0.attn' is not a node"),
    ],
    ids=["nodes columns", "edges columns", "n_heads", "head outside", "q into an mlp", "no input into a head", "name"],
)
def test_circuit_figure_refuses_bad_tables(nodes, edges, keywords, message) -> None:
    with pytest.raises(ValueError) as error:
        circuit_figure(nodes, edges, **({"n_layers": N_LAYERS, "n_heads": N_HEADS} | keywords))
    assert message in str(error.value)


CURVES = pd.DataFrame(
    [
        (method, fraction, f, f - 0.1, f + 0.1)
        for method, scale in (("eap", 1.0), ("random", 0.3))
        for fraction, f in ((0.001, 0.1 * scale), (0.01, 0.4 * scale), (0.1, 0.8 * scale), (1.0, 1.0))
    ],
    columns=["method", "fraction", "faithfulness", "low", "high"],
)


def test_faithfulness_figure_draws_each_method_with_its_band_on_a_log_axis() -> None:
    figure = faithfulness_figure(CURVES.sample(frac=1.0, random_state=0))  # any row order
    assert figure.layout.xaxis.type == "log"
    curves = {t.name: t for t in figure.data if t.mode == "lines+markers"}
    assert set(curves) == {"eap", "random"}
    assert list(curves["eap"].x) == [0.001, 0.01, 0.1, 1.0]
    assert list(curves["random"].y) == pytest.approx([0.03, 0.12, 0.24, 1.0])
    assert curves["eap"].hovertext[1] == "eap<br>1 % kept<br>faithfulness=0.400 [0.300, 0.500]"
    for method, trace in curves.items():
        upper, lower = (t for t in figure.data if t.name == f"{method} (interval)")
        assert lower.fill == "tonexty" and lower.x == trace.x
        assert list(upper.y) == pytest.approx([y + 0.1 for y in trace.y])
        assert list(lower.y) == pytest.approx([y - 0.1 for y in trace.y])
        assert lower.fillcolor.endswith("0.2)") and upper.legendgroup == lower.legendgroup == method
    whole = next(t for t in figure.data if t.name == "whole model")
    assert list(whole.y) == [1.0, 1.0]


@pytest.mark.usefixtures("as_a_user")
def test_faithfulness_figure_refuses_bad_tables() -> None:
    with pytest.raises(ValueError, match="table lacks the column"):
        faithfulness_figure(CURVES.drop(columns="low"))
    with pytest.raises(ValueError, match=r"table: every fraction must lie in \(0, 1\], got \[0.0"):
        faithfulness_figure(CURVES.assign(fraction=0.0))
    with pytest.raises(TypeError, match="table must be a pandas DataFrame"):
        faithfulness_figure(CURVES.to_dict())


def test_only_the_layers_that_hold_a_node_have_a_row_and_the_title_counts_edges_and_lines() -> None:
    # Failed before: every layer of the model had a row (1,590 px for a circuit in layers 0, 13-29 of SmolLM2), and a
    # circuit of 40 edges was titled "40 edges ...: 60 edges" without saying why.
    nodes = pd.DataFrame({"node": ["embed", "L3H1", "L3H2", "L7.mlp", "logits"], "score": [0.1, 0.5, 0.4, -0.2, 0.0]})
    edges = pd.DataFrame(
        [("embed", "L3H1", "k", 0.3, "embed->L3KV0<k>"), ("embed", "L3H2", "k", 0.3, "embed->L3KV0<k>"),
         ("L3H1", "L7.mlp", "", 0.2, "L3H1->L7.mlp"), ("L7.mlp", "logits", "", -0.4, "L7.mlp->logits")],
        columns=["upstream", "downstream", "input", "score", "edge"],
    )  # fmt: skip
    figure = circuit_figure(nodes, edges, n_layers=12, n_heads=4, title="A circuit")
    assert list(figure.layout.yaxis.ticktext) == ["embed", "L3", "L7 mlp", "logits"]  # L7 holds no head
    nodes_drawn = next(t for t in figure.data if t.name == "nodes")
    heights = dict(zip(nodes_drawn.customdata, nodes_drawn.y, strict=True))
    assert heights == {"embed": 0.0, "L3H1": 1.0, "L3H2": 1.0, "L7.mlp": 2.5, "logits": 3.0}
    assert figure.layout.height < 450  # four rows, not twelve
    title = figure.layout.annotations[0].text
    assert title.replace("<br>", " ").startswith("A circuit: 3 edges drawn as 4 lines (an edge into a key or value")
    assert all(len(line) <= 46 for line in title.split("<br>")), title
    # Without the edge column, the lines are the edges.
    assert circuit_figure(nodes, edges.drop(columns="edge"), n_layers=12, n_heads=4, title="T").layout.annotations[
        0
    ].text == ("T: 4 edges")
