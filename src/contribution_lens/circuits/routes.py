"""Information flow routes (Ferrando & Voita 2024) as circuit methods: ALTI proximities, no counterfactual.

Information flow routes score how much each contribution to a sum of vectors makes up that sum,
with ALTI's Manhattan proximity (`contribution_lens.methods.alti.manhattan_proximity`):

    prox(c, x) = max(0, ||x||_1 - ||x - c||_1),        I(c | x) = prox(c, x) / sum_{c'} prox(c', x)

summed over the contributions ``c'`` to ``x`` (a bias is part of ``x`` but of no contribution, as
in ALTI). Here ``x`` is the residual stream an input reads, and its contributions are the
upstream nodes' outputs ``o_u`` (the paper splits each block's output into the block's input and
the block's additions; unrolled, that is the same stream written by every node before it).
Where no proximity is positive the importances are 0 (MIB's code divides 0 by 0 there).

**``information-flow-routes``**, MIB's (``get_scores_information_flow_routes`` in EAP-IG's
``attribute.py``): every position, no routing. Edge ``u -> i`` scores

    score(u -> i) = mean_p mean_{t <= last[p]} I(o_u[t] | x_i[t]),

the local importance at each real position averaged over the prompt's positions, then over the
prompts. A head's q, k and v inputs read the same stream, so they score alike (every head of the
layer, every key head). Scores are importances (non-negative, larger keeps), and MIB evaluates the
method with greedy selection from the logits (`contribution_lens.circuits.scoring.greedy_order`):
both are declared on the method (``orientation``, ``greedy``). One clean forward pass.

**``information-flow-routes-last``**, this package's earlier variant: the final position only, with
the importance routed down from the logits and plain top-n selection. The importance of edge
``u -> i`` at the final position ``t`` is local:

* into a head's q input, an MLP's input or the logits: ``I(o_u[t] | x[t])``;
* into a key head's k or v input: the head reads every key ``j`` with the clean pattern
  ``alpha_tj^h``, so ``sum_j alpha_tj^h I(o_u[j] | x[j])`` (the group's heads, weighted as below);
  routes have no q/k/v split, so a k-edge scores as its v-edge.

Each input's local importances sum to 1 over its upstream nodes (where any proximity is
positive). To rank edges across the graph, as the paper's top-down construction does from the
prediction, an edge's score is its local importance times its reader's importance ``N``:
``N(logits) = 1`` and ``N(u)`` the sum of ``u``'s outgoing scores into v inputs, MLPs and the
logits (a route follows what is written; q and k edges are scored and end there). Under
grouped-query attention a k or v input's score sums over its group's heads,
``sum_h N(h) sum_j alpha_tj^h I(o_u[j] | x[j])``.

Neither needs a counterfactual: the task's ``corrupted`` prompts are not read, and the scores are
non-negative (a size of importance, not a signed effect on the metric). One clean forward pass.

Example:
    >>> import torch
    >>> import contribution_lens as cl
    >>> model = cl.load_model()
    >>> ids = torch.randint(100, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    >>> task = cl.Task("demo", ids, ids.flip(0), ids[:, 0], ids[:, 1], cl.Task.full_length(ids))
    >>> scores = cl.circuit_scores(model, task, method="information-flow-routes")
    >>> bool((scores.edge_scores >= 0).all()), scores.orientation.name, scores.greedy
    (True, 'importance', True)
"""

from dataclasses import dataclass, field

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor

from contribution_lens.adapter import Model, circuit_pass
from contribution_lens.circuits import interchange as ic
from contribution_lens.circuits.graph import Graph
from contribution_lens.circuits.registry import IMPORTANCE, CircuitContext, CircuitMethod
from contribution_lens.circuits.task import Task
from contribution_lens.methods.alti import manhattan_proximity
from contribution_lens.methods.method import normalise_rows

COPIES = 2.0
"""``[batch pos writer d_model]`` tensors held at once: the outputs and one proximity's distances."""


@dataclass
class Reads:
    """Keeps every writer's output and the stream each layer's heads, MLP and the logits read."""

    graph: Graph
    record: ic.Record
    streams: dict[tuple[str, int], Tensor] = field(default_factory=dict)

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        return self.record.write(kind, layer, out)

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        if kind in ("q", "mlp", "logits"):
            self.streams[(kind, layer)] = stream.detach()
        return None


def local_importance(
    outputs: Float[Tensor, "batch pos writer d_model"], stream: Float[Tensor, "batch pos d_model"]
) -> Float[Tensor, "batch pos writer"]:
    """``I(o_u | x)`` at every position: the writers' normalised proximities to the stream they make up."""
    return normalise_rows(manhattan_proximity(outputs, stream))


def route_scores_of_batch(
    graph: Graph,
    outputs: Float[Tensor, "batch pos writer d_model"],
    streams: dict[tuple[str, int], Tensor],
    patterns: dict[int, Float[Tensor, "batch head query key"]],
    last: Int[Tensor, " batch"],
) -> Float[Tensor, "batch writer input"]:
    """Every edge's route score per prompt (the module docstring), from the logits down."""
    batch = outputs.shape[0]
    rows = torch.arange(batch, device=outputs.device)
    last = last.to(outputs.device)
    scores = outputs.new_zeros(batch, *graph.valid.shape)
    reached = outputs.new_zeros(batch, len(graph.writers))  # N(u), complete once every later input is scored

    def at_last(kind: str, layer: int, upstream: int) -> Tensor:
        return local_importance(outputs[rows, last, None, :upstream], streams[(kind, layer)][rows, last, None])[:, 0]

    lo, _ = graph.input_range("logits", 0)
    upstream = int(graph.upstream[lo])
    scores[:, :upstream, lo] = at_last("logits", 0, upstream)
    reached[:, :upstream] += scores[:, :upstream, lo]
    for layer in reversed(range(graph.n_layers)):
        lo, _ = graph.input_range("mlp", layer)
        upstream = int(graph.upstream[lo])
        mlp, _ = graph.writer_range("mlp", layer)
        scores[:, :upstream, lo] = reached[:, mlp, None] * at_last("mlp", layer, upstream)
        reached[:, :upstream] += scores[:, :upstream, lo]
        heads, _ = graph.writer_range("heads", layer)
        upstream = int(graph.upstream[graph.input_range("q", layer)[0]])
        weight = reached[:, heads : heads + graph.n_heads]  # N(h) of this layer's heads
        everywhere = local_importance(outputs[:, :, :upstream], streams[("q", layer)])  # [batch pos writer]
        q_lo, q_hi = graph.input_range("q", layer)
        scores[:, :upstream, q_lo:q_hi] = einops.einsum(weight, everywhere[rows, last], "b h, b u -> b u h")
        read = patterns[layer][rows, :, last].to(outputs.dtype)  # [batch head key]: alpha_tj^h
        by_group = einops.reduce(weight[:, :, None] * read, "b (g group) key -> b g key", "sum", g=graph.kv_inputs)
        kv = einops.einsum(by_group, everywhere, "b g key, b key u -> b u g")
        for side in "kv":
            s_lo, s_hi = graph.input_range(side, layer)
            scores[:, :upstream, s_lo:s_hi] = kv
        reached[:, :upstream] += kv.sum(-1)
    return scores


def _clean_pass(model: Model, task: Task, rows: Tensor, graph: Graph, patterns: dict[int, Tensor] | None) -> Reads:
    """One clean pass keeping every writer's output and the streams the inputs read (and the patterns, if asked).

    The logits' stream is read at every position before the unembedding, which reads the last position alone.
    """
    stream = Reads(graph, ic.Record(graph))
    with torch.inference_mode():
        circuit_pass(model, ic.tokens(task, rows), stream, patterns=patterns, last=task.last[rows])
    return stream


def route_scores(model: Model, task: Task, context: CircuitContext) -> Float[Tensor, " edge"]:
    """The ``information-flow-routes-last`` edge scores, averaged over the task's clean prompts."""
    graph = context.graph
    size = ic.batch_size(task, len(graph.writers), int(model.cfg.d_model), COPIES, context.memory)
    total = None
    for rows in ic.batches(task, size):
        patterns: dict[int, Tensor] = {}
        stream = _clean_pass(model, task, rows, graph, patterns)
        assert stream.record.outputs is not None
        outputs = einops.rearrange(stream.record.outputs, "writer b p d -> b p writer d")
        scores = route_scores_of_batch(graph, outputs, stream.streams, patterns, task.last[rows])
        total = scores.sum(0) if total is None else total + scores.sum(0)
    assert total is not None
    return ic.per_edge(graph, total, len(task))


def position_mean_scores_of_batch(
    graph: Graph,
    outputs: Float[Tensor, "batch pos writer d_model"],
    streams: dict[tuple[str, int], Tensor],
    last: Int[Tensor, " batch"],
) -> Float[Tensor, "writer input"]:
    """MIB's scores summed over the batch's prompts: each input's local importances, averaged over real positions.

    A layer's q, k and v inputs read one stream (``("q", layer)``) and take the same column.
    """
    positions = torch.arange(outputs.shape[1], device=outputs.device)
    lengths = (last.to(outputs.device) + 1).to(outputs.dtype)
    real = (positions[None, :] <= last.to(outputs.device)[:, None]).to(outputs.dtype)  # [batch pos]
    scores = outputs.new_zeros(graph.valid.shape)
    groups = [("logits", 0)] + [(kind, layer) for layer in range(graph.n_layers) for kind in ("q", "mlp")]
    for kind, layer in groups:
        start, end = graph.input_group(kind, layer)
        upstream = int(graph.upstream[start])
        importance = local_importance(outputs[:, :, :upstream], streams[(kind, layer)])  # [batch pos writer]
        per_prompt = einops.einsum(importance, real, "b p u, b p -> b u") / lengths[:, None]
        scores[:upstream, start:end] += per_prompt.sum(0)[:, None]
    return scores


def mib_route_scores(model: Model, task: Task, context: CircuitContext) -> Float[Tensor, " edge"]:
    """MIB's ``information-flow-routes`` edge scores: local importances averaged over positions, then prompts."""
    graph = context.graph
    size = ic.batch_size(task, len(graph.writers), int(model.cfg.d_model), COPIES, context.memory)
    total = None
    for rows in ic.batches(task, size):
        stream = _clean_pass(model, task, rows, graph, None)
        assert stream.record.outputs is not None
        outputs = einops.rearrange(stream.record.outputs, "writer b p d -> b p writer d")
        scores = position_mean_scores_of_batch(graph, outputs, stream.streams, task.last[rows])
        total = scores if total is None else total + scores
    assert total is not None
    return ic.per_edge(graph, total, len(task))


METHODS = (
    CircuitMethod(
        "information-flow-routes",
        mib_route_scores,
        "edge",
        "MIB's information flow routes: ALTI proximities of each node's output to the stream its reader reads, "
        "averaged over every position (Ferrando & Voita); greedy selection; clean pass only, no counterfactual",
        True,
        orientation=IMPORTANCE,
        greedy=True,
    ),
    CircuitMethod(
        "information-flow-routes-last",
        route_scores,
        "edge",
        "ALTI proximities at the final position, routed from the logits (this package's earlier variant); "
        "top-n selection; clean pass only, no counterfactual",
        True,
        orientation=IMPORTANCE,
    ),
)
