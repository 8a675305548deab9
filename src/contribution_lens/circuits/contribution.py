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

    t(u -> h<k>) = -mean_p sum_ij (dm/ds_ij) A_ij^u = -mean_p sum_pos o_u . dm/dx_{h<k>}

(equal because ``sum_j dm/ds_ij = 0`` under the softmax, and ``s`` is linear in the component with
scales frozen), with ``dm/ds`` the gradient of the clean pass with the norm scales frozen and the
patterns live. That is the first-order change of the metric if ``u``'s part of the head's keys
(queries) were removed: in metric units like the v-edges, so the two rank together, but it
removes the clean component where a v-edge substitutes the counterfactual's difference. Under
grouped-query attention a k-edge serves its group's heads and sums over them. With Gemma 2's
soft-capped scores the weighted advantages differ from the gradient form by the cap's derivative;
the gradient form is what is computed.

Cost: the embeddings of both prompts (passes stopped before the first block), one forward-mode
pass of ``L`` that is differentiable too (the tangents and ``g_i`` share it) with its backward
pass, and one pass with live patterns with its backward pass (the q- and k-edges); each unembeds
only the last position. About five passes' work: 8.2 forward-pass equivalents of CPU time on
Qwen2.5-0.5B with 64 IOI prompts (docs/results.md, circuit cost).

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

from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as forward_ad
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens.adapter import Model, embedding_pass
from contribution_lens.circuits import interchange as ic
from contribution_lens.circuits.graph import Graph
from contribution_lens.circuits.registry import CircuitContext, CircuitMethod, register_circuit_method
from contribution_lens.circuits.task import Task

COPIES = 5.0
"""``[writer batch pos d_model]`` tensors held at once: tangents, clean outputs, scores' inputs and their gradients."""
EMBEDDINGS = ("embed", "pos_embed")


@dataclass
class Tangent:
    """A forward-mode pass of ``L``: the embeddings carry the tangent ``shift`` and every writer's tangent is kept.

    ``shift[e]`` is the counterfactual's embedding minus the clean one (``e``: embed, pos_embed); the
    tangents are kept writers first, ``[writer batch pos d_model]``, as `interchange.Record` keeps outputs.
    """

    graph: Graph
    shift: Float[Tensor, "embedding batch pos d_model"]
    tangents: Tensor | None = None
    gradient: ic.Gradient | None = None
    """Where given, the pass is differentiable too and keeps its inputs there (``dm_L/dx_i`` by one backward pass)."""

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        lo, hi = self.graph.writer_range(kind, layer)
        if self.tangents is None:
            batch, pos, _, d_model = out.shape
            self.tangents = out.new_zeros(len(self.graph.writers), batch, pos, d_model).detach()
        if kind in EMBEDDINGS:
            self.tangents[lo] = self.shift[lo]
            zero = torch.zeros_like(forward_ad.unpack_dual(out).primal[:, :, 0].detach())
            zero.requires_grad_(self.gradient is not None)
            return forward_ad.make_dual(zero, self.shift[lo].to(zero.dtype))
        tangent = forward_ad.unpack_dual(out).tangent
        if tangent is not None:
            self.tangents[lo:hi] = tangent.detach().permute(2, 0, 1, 3).to(self.tangents.dtype)
        return None

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        return None if self.gradient is None else self.gradient.read(kind, layer, stream)


def linearised_differences(
    model: Model, task: Task, graph: Graph, rows: Tensor
) -> tuple[Float[Tensor, "writer batch pos d_model"], Float[Tensor, " batch"]]:
    """Every writer's ``delta_u`` in ``L`` and each prompt's ``m_L(counterfactual) - m(clean)``.

    The embeddings come from passes stopped before the first block; the tangents from one
    forward-mode pass on the clean prompts with patterns and norm scales frozen.
    """
    with torch.no_grad(), forward_ad.dual_level():
        stream, value = _linearised_pass(model, task, graph, rows, gradient=False)
        tangent = forward_ad.unpack_dual(value).tangent
        difference = torch.zeros(len(rows)) if tangent is None else tangent.detach().cpu()
    assert stream.tangents is not None
    return stream.tangents, difference


def _linearised_pass(model: Model, task: Task, graph: Graph, rows: Tensor, *, gradient: bool) -> tuple[Tangent, Tensor]:
    """The forward-mode pass of ``L`` (`Tangent`) and the prompts' metric, a dual tensor (call in a dual level).

    With ``gradient`` (and autograd on) the same pass is differentiable: its inputs are kept in
    ``stream.gradient`` for ``dm_L/dx_i``, so the tangents and the gradient share one forward pass.
    """
    n = graph.n_embeddings
    shift = _embeddings(model, ic.tokens(task, rows, True), n) - _embeddings(model, ic.tokens(task, rows), n)
    placeholder = torch.zeros(1, 1, n, 1, device=shift.device)
    stream = Tangent(graph, shift, gradient=ic.Gradient(graph, placeholder) if gradient else None)
    value = ic.metric_pass(model, task, rows, stream, freeze_norms=True, freeze_patterns=True)
    return stream, value


@dataclass
class _Embeddings:
    """Keeps the embeddings' outputs, ``[embedding batch pos d_model]`` in the graph's writer order."""

    outputs: list[Tensor | None]

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        self.outputs[EMBEDDINGS.index(kind)] = out.detach()[:, :, 0]
        return None

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        return None


def _embeddings(model: Model, tokens: Tensor, n: int) -> Float[Tensor, "embedding batch pos d_model"]:
    """The embeddings of ``tokens`` alone (a pass stopped before the first block)."""
    stream = _Embeddings([None] * n)
    with torch.inference_mode():
        embedding_pass(model, tokens, stream)
    return torch.stack([x for x in stream.outputs if x is not None])  # out of inference mode: a normal tensor


def _live_gradient(model: Model, task: Task, graph: Graph, rows: Tensor) -> tuple[ic.Gradient, Tensor]:
    """A clean pass with norm scales frozen and patterns live: its inputs, outputs (``o_u``) and summed metric."""
    placeholder = torch.zeros(1, 1, graph.n_embeddings, 1, device=_device(model))
    stream = ic.Gradient(graph, placeholder, 1.0, ic.Record(graph))
    with torch.enable_grad():
        value = ic.metric_pass(model, task, rows, stream, freeze_norms=True)
        return stream, value.sum()


def _device(model: Model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def attention_inputs(graph: Graph) -> Bool[Tensor, " input"]:
    """Whether each input is a head's q or k input (no effect in ``L``: scored by the QK split)."""
    return torch.tensor([name.endswith(("<q>", "<k>")) for name in graph.inputs])


def contribution_scores(model: Model, task: Task, context: CircuitContext) -> Float[Tensor, " edge"]:
    """The ``contribution`` edge scores (module docstring): exact terms of ``L``, q/k edges from the QK split."""
    graph = context.graph
    d_model = int(model.cfg.d_model)
    size = ic.batch_size(task, len(graph.writers), d_model, COPIES, context.memory)
    attention = attention_inputs(graph)
    scores = None
    for rows in ic.batches(task, size):
        with torch.enable_grad(), forward_ad.dual_level():
            linearised, value = _linearised_pass(model, task, graph, rows, gradient=True)
            value = forward_ad.unpack_dual(value).primal.sum()
        assert linearised.tangents is not None and linearised.gradient is not None
        scores = linearised.tangents.new_zeros(graph.valid.shape) if scores is None else scores
        linear = linearised.tangents.new_zeros(graph.valid.shape)
        ic.gradient_scores(graph, linearised.gradient, value, linearised.tangents, linear)
        del linearised, value
        removed = linear.new_zeros(graph.valid.shape)  # sum o_u . dm/dx_i, only where i is a q or k input
        stream, value = _live_gradient(model, task, graph, rows)
        assert stream.clean is not None and stream.clean.outputs is not None
        ic.gradient_scores(graph, stream, value, stream.clean.outputs.to(linear.dtype), removed, only=attention)
        mask = attention.to(linear.device)[None, :]
        scores += torch.where(mask, -removed, linear)
    assert scores is not None
    return ic.per_edge(graph, scores, len(task))


METHODS = (
    CircuitMethod(
        "contribution",
        contribution_scores,
        "edge",
        "exact per-edge terms with patterns, norm scales frozen and MLPs linearised; q/k edges from the QK split",
        True,
    ),
)
for _method in METHODS:
    register_circuit_method(_method)
