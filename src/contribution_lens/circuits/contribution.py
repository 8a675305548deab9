"""The ``contribution`` circuit method: the metric's change split exactly over edges in a stated linearisation.

**The linearised model** ``L``. Every attention pattern ``alpha`` and every norm's scale (pre-attention,
pre-MLP, post-attention, final, q and k norms) is frozen at its value in the clean pass; every MLP is
replaced by its first-order expansion at the clean pass (its Jacobian-vector product: an MLP passes
on a change of its input as its Jacobian at the clean input says, so MLPs keep their place in the
circuit); the metric is expanded to first order at the clean logits (exact for the logit
difference, which is linear in the logits). With patterns and norm scales frozen every head is a
linear map of its inputs (``o_i^h = sum_j alpha_ij^h N_1(x_j) W_V^h W_O^h``, the contribution
weights of the keys' components), and so ``L`` is affine in the embeddings. In ``L`` node ``u``'s
output moves by ``delta_u = J_u (e_r - e_o)`` when the embeddings move from the clean prompt's
``e_o`` to the counterfactual's ``e_r`` (a forward-mode derivative: one pass), and with
``g_i = dm_L/dx_i`` the gradient at input ``i`` (one backward pass, patterns and scales detached):

    t(u -> i) = mean_p sum_pos delta_u . g_i

is *exactly* the change of ``m_L`` when edge ``u -> i`` alone carries the counterfactual (``L`` is
affine). The terms of a v-edge are the upstream node's difference moved through the head's OV
circuit with the clean pattern, ``alpha_ij N_1(delta_u[j]) W_OV``, read by the metric through logit
attribution and every path through later heads and MLPs (``g_i``). They add up: every path from
the embeddings to the logits crosses a cut of the graph (the edges from nodes before a point in the
forward order to inputs after it) exactly once, so the terms of every cut sum to

    sum_{u -> i crossing the cut} t(u -> i) = mean_p m_L(counterfactual) - m(clean),

the edges out of the embeddings and the edges into the logits among them. Scores keep EAP's sign
(``m(patched) - m(clean)``); EAP is the same product with the true differences ``r_u - o_u`` and
the model's own gradient.

**q- and k-edges** carry nothing in ``L`` (the patterns are frozen). They are scored from the QK
split (`contribution_lens.qk`) instead: with the norm scales frozen, the score ``s_ij`` of a head is
a sum over the stream's components, and component ``u``'s key-side advantage ``A_ij^u`` (query
side likewise) says how much it makes key ``j`` win over the others. Weighted by how much the
metric cares about each score,

    t(u -> h<k>) = -mean_p sum_ij (dm_h/ds_ij) A_ij^u = -mean_p sum_pos o_u . dm_h/dx_{h<k>}

(equal because ``sum_j dm_h/ds_ij = 0`` under the softmax, and ``s`` is linear in the component
with scales frozen), where ``m_h`` is ``L`` with head ``h``'s own pattern live (a softmax of its
scores) and every other pattern frozen: the first-order change of the metric if ``u``'s part of
the head's keys (queries) were removed, every other head and MLP reading the change as ``L`` does.
That is in metric units like the v-edges, so the two rank together, but it removes the clean
component where a v-edge substitutes the counterfactual's difference. Every ``dm_h/dx_{h<k>}``
comes from ``L``'s own backward pass: a head's q and k inputs are read as leaves (a gradient kept,
none passed upstream), so its pattern answers its scores while the v-, MLP- and logits-edges see
``L`` unchanged. Under grouped-query attention a k-edge serves its group's heads and sums over
them. With Gemma 2's soft-capped scores the weighted advantages differ from the gradient form by
the cap's derivative; the gradient form is what is computed.

Cost: the embeddings of both prompts (passes stopped before the first block), then one
forward-mode pass of ``L`` on the clean prompts that is differentiable too (the tangents
``delta_u``, the clean outputs ``o_u`` and every ``g_i`` share it) and its backward pass; each
unembeds only the last position. Its products of activations and weights are computed apart
(`contribution_lens.circuits.tangents`). 4.1 and 4.5 forward-pass equivalents of CPU time (two runs) on Qwen2.5-0.5B
with 64 IOI prompts (docs/results.md, circuit cost).

**The path variant, ``contribution-ig``.** ``L``'s own change ``m_L(counterfactual) - m(clean)`` is not the
model's (`contribution_lens.circuits.linearisation` measures the gap), for two reasons: ``L`` is one
linearisation, at the clean pass, of a path that ends far from it, and it freezes patterns and norm
scales, so the change they carry reaches no edge but the QK split's. ``contribution-ig`` linearises
the model itself, nothing frozen, at the midpoints ``t_k = (k + 1/2) / K`` of the straight path
``e(t) = e_o + t (e_r - e_o)`` from the clean embeddings to the counterfactual's (``K`` = ``steps``,
the midpoint rule). At each point, with ``delta_u^k = d o_u / dt`` (a forward-mode pass) and
``g_i^k = dm/dx_i`` (its backward pass), every edge's term is ``delta_u^k . g_i^k``, q and k edges
included: their tangents move the patterns, which are live. By the chain rule the terms of every cut
add up at each point to ``dm/dt(t_k)``, so the averaged terms

    t(u -> i) = mean_p (1 / K) sum_k sum_pos delta_u^k . g_i^k

add up across every cut to ``(1 / K) sum_k dm/dt(t_k)``, the variant's own metric change (tested in
float64 against central differences of the plain model). It is the midpoint rule for
``m(counterfactual) - m(clean) = integral_0^1 dm/dt dt``, so its error falls as ``1 / K^2`` for a
smooth path (the per-edge terms are the path's integrated gradients split at the edge: the
"conductance" of Dhamdhere, Sundararajan and Yan 2018, read edge by edge). Its q and k terms then
substitute the counterfactual's change, as the v terms do, in place of the QK split's removal.
Cost: ``K`` forward-mode passes that are differentiable too, each with its backward pass: about ``4 K``
forward-pass equivalents a prompt (20 at the default 5 steps). Where a post-attention norm also scales
an attention output bias (`contribution_lens.adapter.hidden_bias_path`; no bundled model), the change
that live scale makes to the bias reaches no edge, and the cuts miss it.

Example:
    >>> import torch
    >>> import contribution_lens as cl
    >>> model = cl.load_model()
    >>> ids = torch.randint(100, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    >>> task = cl.Task("demo", ids, ids.flip(0), ids[:, 0], ids[:, 1], cl.Task.full_length(ids))
    >>> scores = cl.circuit_scores(model, task, method="contribution")
    >>> len(scores.edge_scores) == len(scores.graph.edges)
    True
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as forward_ad
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens.adapter import Model
from contribution_lens.circuits import interchange as ic
from contribution_lens.circuits.graph import Graph
from contribution_lens.circuits.registry import CircuitContext, CircuitMethod
from contribution_lens.circuits.tangents import TangentsApart
from contribution_lens.circuits.task import Task

COPIES = 5.0
"""``[writer batch pos d_model]`` tensors held at once: tangents, clean outputs, and the inputs' gradients."""
ATTENTION_SIDES = ("q", "k")
EMBEDDINGS = ("embed", "pos_embed")


@dataclass
class Tangent:
    """A forward-mode pass of ``L``: the embeddings carry the tangent ``shift`` and every writer's tangent is kept.

    ``shift[e]`` is the counterfactual's embedding minus the clean one (``e``: embed, pos_embed); the
    tangents are kept writers first, ``[writer batch pos d_model]``, as `interchange.Record` keeps outputs,
    at ``window``'s positions.
    """

    graph: Graph
    shift: Float[Tensor, "embedding batch pos d_model"]
    tangents: Tensor | None = None
    gradient: ic.Gradient | None = None
    """Where given, the pass is differentiable too and keeps its inputs there (``dm_L/dx_i`` by one backward pass)."""
    outputs: ic.Record | None = None
    """Where given, keeps every writer's clean output ``o_u`` (the pass's primal)."""
    window: slice = field(default_factory=lambda: ic.ALL)
    start: float = 0.0
    """Where on the path from the clean embeddings (0) to the counterfactual's (1) the pass runs."""

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        lo, hi = self.graph.writer_range(kind, layer)
        if self.tangents is None:
            batch, pos, _, d_model = out[:, self.window].shape
            self.tangents = out.new_zeros(len(self.graph.writers), batch, pos, d_model).detach()
        if self.outputs is not None:
            self.outputs.write(kind, layer, forward_ad.unpack_dual(out).primal)
        if kind in EMBEDDINGS:
            self.tangents[lo] = self.shift[lo][:, self.window]
            primal = forward_ad.unpack_dual(out).primal[:, :, 0].detach()
            # The pass runs at e_o + start (e_r - e_o): a correction of the clean embeddings, a leaf of its own.
            moved = torch.zeros_like(primal) if self.start == 0 else (self.start * self.shift[lo]).to(primal.dtype)
            moved.requires_grad_(self.gradient is not None)
            return forward_ad.make_dual(moved, self.shift[lo].to(moved.dtype))
        tangent = forward_ad.unpack_dual(out).tangent
        if tangent is not None:
            self.tangents[lo:hi] = tangent[:, self.window].detach().permute(2, 0, 1, 3).to(self.tangents.dtype)
        return None

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        return None if self.gradient is None else self.gradient.read(kind, layer, stream)


def linearised_differences(
    model: Model, task: Task, graph: Graph, rows: Tensor, *, start: float = 0.0, live: bool = False
) -> tuple[Float[Tensor, "writer batch pos d_model"], Float[Tensor, " batch"]]:
    """Every writer's tangent and each prompt's metric tangent along ``e_r - e_o`` at ``e_o + start (e_r - e_o)``.

    At ``start = 0`` without ``live`` these are ``L``'s: ``delta_u`` and ``m_L(counterfactual) - m(clean)``.
    ``live``: patterns and norm scales are not frozen (the model's own Jacobian there, `contribution_ig_scores`).
    The embeddings come from passes stopped before the first block; the tangents from one forward-mode pass.
    """
    with torch.no_grad(), forward_ad.dual_level():
        stream, value = _linearised_pass(model, task, graph, rows, gradient=False, start=start, live=live)
        tangent = forward_ad.unpack_dual(value).tangent
        difference = torch.zeros(len(rows)) if tangent is None else tangent.detach().cpu()
    assert stream.tangents is not None
    return stream.tangents, difference


def embedding_shift(
    model: Model, task: Task, graph: Graph, rows: Tensor
) -> Float[Tensor, "embedding batch pos d_model"]:
    """``e_r - e_o``: the counterfactual's embeddings minus the clean prompt's."""
    n = graph.n_embeddings
    return ic.embeddings(model, ic.tokens(task, rows, True), n) - ic.embeddings(model, ic.tokens(task, rows), n)


def _linearised_pass(
    model: Model,
    task: Task,
    graph: Graph,
    rows: Tensor,
    *,
    gradient: bool,
    window: slice = ic.ALL,
    start: float = 0.0,
    live: bool = False,
    shift: Tensor | None = None,
) -> tuple[Tangent, Tensor]:
    """The forward-mode pass of ``L`` (`Tangent`) and the prompts' metric, a dual tensor (call in a dual level).

    With ``gradient`` (and autograd on) the same pass is differentiable: its inputs are kept in
    ``stream.gradient`` for ``dm_L/dx_i`` and its clean outputs in ``stream.outputs``, so the
    tangents and every gradient share one forward pass. The patterns are then computed, not frozen:
    the q and k inputs are leaves carrying no tangent, so a pattern moves nothing but the gradient
    of its own head's q and k inputs (``dm_h/dx``, the module docstring). Tangents, outputs and
    inputs are kept at ``window``'s positions (`interchange.pieces`).

    ``start``: the pass runs at the embeddings ``e_o + start (e_r - e_o)``. ``live``: nothing is frozen
    and the q and k inputs are no leaves: tangents and gradients are the model's own there (no outputs kept).
    ``shift``: ``e_r - e_o`` where already computed (`embedding_shift`).
    """
    shift = embedding_shift(model, task, graph, rows) if shift is None else shift
    placeholder = torch.zeros(1, 1, graph.n_embeddings, 1, device=shift.device)
    leaves = () if live else ATTENTION_SIDES
    inputs = ic.Gradient(graph, placeholder, leaves=leaves, window=window) if gradient else None
    outputs = ic.Record(graph, window=window) if gradient and not live else None
    stream = Tangent(graph, shift, gradient=inputs, outputs=outputs, window=window, start=start)
    frozen = not live
    with TangentsApart():  # no dense zero tangent for any weight (`contribution_lens.circuits.tangents`)
        value = ic.metric_pass(model, task, rows, stream, freeze_norms=frozen, freeze_patterns=frozen and not gradient)
    return stream, value


def path_points(steps: int) -> list[float]:
    """The midpoints ``(k + 1/2) / steps`` of ``steps`` equal parts of the path from the clean prompt to the
    counterfactual: the midpoint rule, exact for a metric quadratic along the path.

    Example:
        >>> path_points(4)
        [0.125, 0.375, 0.625, 0.875]
    """
    return [(step + 0.5) / steps for step in range(steps)]


def attention_inputs(graph: Graph) -> Bool[Tensor, " input"]:
    """Whether each input is a head's q or k input (no effect in ``L``: scored by the QK split)."""
    return torch.tensor([name.endswith(("<q>", "<k>")) for name in graph.inputs])


def contribution_scores(model: Model, task: Task, context: CircuitContext) -> Float[Tensor, " edge"]:
    """The ``contribution`` edge scores (module docstring): exact terms of ``L``, q/k edges from the QK split."""
    graph = context.graph
    d_model = int(model.cfg.d_model)
    attention = attention_inputs(graph)
    scores = None
    for rows, window in ic.pieces(task, len(graph.writers), d_model, COPIES, context.memory):
        with torch.enable_grad(), forward_ad.dual_level():
            stream, value = _linearised_pass(model, task, graph, rows, gradient=True, window=window)
            value = forward_ad.unpack_dual(value).primal.sum()
        assert stream.tangents is not None and stream.gradient is not None and stream.outputs is not None
        outputs = stream.outputs.outputs
        assert outputs is not None
        found = ic.input_gradients(stream.gradient, value)
        del value
        scores = stream.tangents.new_zeros(graph.valid.shape) if scores is None else scores
        carried = [group for group in found if not bool(attention[group[0]])]
        ic.add_products(graph, carried, stream.tangents, scores)
        removed = scores.new_zeros(graph.valid.shape)  # sum o_u . dm_h/dx_i where i is a q or k input
        ic.add_products(
            graph, [group for group in found if bool(attention[group[0]])], outputs.to(scores.dtype), removed
        )
        scores -= removed
    assert scores is not None
    return ic.per_edge(graph, scores, len(task))


def contribution_ig_scores(model: Model, task: Task, context: CircuitContext) -> Float[Tensor, " edge"]:
    """The ``contribution-ig`` edge scores: the terms of the model linearised, nothing frozen, at ``context.steps``
    midpoints of the path from the clean embeddings to the counterfactual's, averaged (module docstring)."""
    graph = context.graph
    d_model = int(model.cfg.d_model)
    scores = None
    for rows, window in ic.pieces(task, len(graph.writers), d_model, COPIES, context.memory):
        shift = embedding_shift(model, task, graph, rows)
        for start in path_points(context.steps):
            with torch.enable_grad(), forward_ad.dual_level():
                stream, value = _linearised_pass(
                    model, task, graph, rows, gradient=True, window=window, start=start, live=True, shift=shift
                )
                value = forward_ad.unpack_dual(value).primal.sum()
            assert stream.tangents is not None and stream.gradient is not None
            found = ic.input_gradients(stream.gradient, value)
            del value
            scores = stream.tangents.new_zeros(graph.valid.shape) if scores is None else scores
            ic.add_products(graph, found, stream.tangents, scores)
    assert scores is not None
    return ic.per_edge(graph, scores, len(task) * context.steps)


def contribution_change(model: Model, task: Task, graph: Graph, rows: Tensor, steps: int) -> Float[Tensor, " batch"]:
    """``contribution``'s own metric change of each prompt, ``m_L(counterfactual) - m(clean)`` (``steps`` unused)."""
    return linearised_differences(model, task, graph, rows)[1]


def contribution_ig_change(model: Model, task: Task, graph: Graph, rows: Tensor, steps: int) -> Float[Tensor, " batch"]:
    """``contribution-ig``'s own metric change of each prompt: the mean over the path's ``steps`` midpoints of the
    metric's tangent along ``e_r - e_o`` (what the terms of every cut add up to)."""
    changes = [linearised_differences(model, task, graph, rows, start=t, live=True)[1] for t in path_points(steps)]
    return torch.stack(changes).mean(0)


@dataclass(frozen=True)
class OwnChange:
    """A method's own metric change per prompt, ``(model, task, graph, rows, steps) -> [batch]``, and whether it
    walks the path in ``steps`` points (else it is one linearisation at the clean pass)."""

    change: Callable[[Model, Task, Graph, Tensor, int], Tensor]
    path: bool = False


LINEARISED_CHANGES: dict[str, OwnChange] = {
    "contribution": OwnChange(contribution_change),
    "contribution-ig": OwnChange(contribution_ig_change, path=True),
}
"""The methods whose terms of every cut add up exactly to a metric change of their own, and that change:
what `contribution_lens.circuits.linearisation.linearisation_error` compares with the true one."""


METHODS = (
    CircuitMethod(
        "contribution",
        contribution_scores,
        "edge",
        "exact per-edge terms with patterns, norm scales frozen and MLPs linearised; q/k edges from the QK split",
        True,
    ),
    CircuitMethod(
        "contribution-ig",
        contribution_ig_scores,
        "edge",
        "exact per-edge terms of the model linearised (nothing frozen) at midpoints of the path, averaged",
        True,
    ),
)
