"""The package's circuit methods: EAP, EAP-IG, activation patching and a random control.

With ``r_u`` and ``o_u`` node ``u``'s output in the counterfactual and the clean pass and
``x_i`` the input ``i`` reads (a head's q, k or v input apart, `contribution_lens.circuits.graph`):

* ``eap`` (Syed et al. 2023): ``score(u -> i) = mean_p sum_pos (r_u - o_u) . dm/dx_i``, the
  gradient at the clean pass: the first-order change of the metric when edge ``u -> i`` carries
  the counterfactual. One counterfactual pass, one clean pass with its backward pass.
* ``eap-ig`` (Hanna et al. 2024, the "inputs" variant of MIB's code): the same with ``dm/dx_i``
  averaged over ``k = 0 .. steps - 1`` passes whose embeddings are ``e_r + (k / steps)(e_o - e_r)``
  (MIB's default ``steps = 5``).
* ``activation-patching`` (node level): ``score(u) = mean_p m(u patched) - m(clean)``, one
  patched pass per head or MLP: the exact effect each node has alone, the oracle node scores are
  compared with. Up to a node's layer its pass is the clean pass: the MLPs there take the clean
  pass's recorded outputs instead of running (`interchange.NodePatch`).
* ``random``: independent standard normal scores (a control).
"""

import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens.adapter import Model
from contribution_lens.circuits import interchange as ic
from contribution_lens.circuits.registry import CircuitContext, CircuitMethod
from contribution_lens.circuits.task import Task

GRADIENT_COPIES = 4.0
"""``[batch pos writer d_model]`` tensors a gradient method holds at once (differences, outputs, saved inputs)."""


def _d_model(model: Model) -> int:
    return int(model.cfg.d_model)


def _gradient_pass(model: Model, task: Task, rows: Tensor, stream: ic.Gradient) -> Tensor:
    with torch.enable_grad():
        return ic.metric_pass(model, task, rows, stream).sum()


def eap(model: Model, task: Task, context: CircuitContext) -> Float[Tensor, " edge"]:
    """Edge attribution patching: gradient x activation difference at the clean pass."""
    graph = context.graph
    scores, delta = None, None
    for rows, window in ic.pieces(task, len(graph.writers), _d_model(model), GRADIENT_COPIES, context.memory):
        delta, _ = ic.record(model, task, graph, rows, corrupted=True, window=window, storage=delta)
        # The clean pass turns the counterfactual's outputs into the differences as it writes its own.
        stream = ic.Gradient(graph, delta, 1.0, ic.Difference(graph, delta, window), window=window)
        value = _gradient_pass(model, task, rows, stream)
        scores = delta.new_zeros(graph.valid.shape) if scores is None else scores
        ic.gradient_scores(graph, stream, value, delta, scores)
    assert scores is not None
    return ic.per_edge(graph, scores, len(task))


def eap_ig(model: Model, task: Task, context: CircuitContext) -> Float[Tensor, " edge"]:
    """EAP with integrated gradients along the input embeddings (counterfactual to clean, left Riemann sum)."""
    graph = context.graph
    scores, delta = None, None
    for rows, window in ic.pieces(task, len(graph.writers), _d_model(model), GRADIENT_COPIES, context.memory):
        delta, _ = ic.record(model, task, graph, rows, corrupted=True, window=window, storage=delta)
        clean, _ = ic.record(model, task, graph, rows, corrupted=False, window=window)
        with torch.inference_mode():  # both were recorded in it
            delta -= clean
        del clean  # not kept for the next batch: the gradient passes hold their own tensors meanwhile
        # The interpolation moves every position's embeddings: the counterfactual's, whole.
        start = ic.embeddings(model, ic.tokens(task, rows, corrupted=True), graph.n_embeddings)
        scores = delta.new_zeros(graph.valid.shape) if scores is None else scores
        for step in range(context.steps):
            stream = ic.Gradient(graph, start, step / context.steps, window=window)
            value = _gradient_pass(model, task, rows, stream)
            ic.gradient_scores(graph, stream, value, delta, scores)
    assert scores is not None
    return ic.per_edge(graph, scores, len(task) * context.steps)


def activation_patching(model: Model, task: Task, context: CircuitContext) -> Float[Tensor, " component"]:
    """Each head's and MLP's exact effect alone: ``m(its output patched) - m(clean)``, averaged over prompts."""
    graph = context.graph
    first = graph.n_embeddings
    totals = torch.zeros(len(graph.components), dtype=torch.float64)
    size = ic.batch_size(task, len(graph.writers), _d_model(model), 2.5, context.memory)
    for rows in ic.batches(task, size):
        corrupted, _ = ic.record(model, task, graph, rows, corrupted=True)
        # The clean outputs too: a node's pass takes every MLP before the node's layer from them (`NodePatch`).
        outputs, clean = ic.record(model, task, graph, rows, corrupted=False)
        for index in range(len(graph.components)):
            patched = torch.zeros(len(graph.writers), dtype=torch.bool, device=corrupted.device)
            patched[first + index] = True
            stream = ic.NodePatch(graph, corrupted, patched, outputs)
            effect = ic.patched_metric(model, task, rows, stream) - clean
            totals[index] += effect.double().sum().cpu()
    return (totals / len(task)).float()


def random_scores(model: Model, task: Task, context: CircuitContext) -> Float[Tensor, " edge"]:
    """Standard normal scores, one an edge, from ``context.seed``: a control that knows nothing."""
    generator = torch.Generator().manual_seed(context.seed)
    return torch.randn(len(context.graph.edges), generator=generator)


METHODS = (
    CircuitMethod("eap", eap, "edge", "gradient x activation difference at the clean pass (Syed et al.)", True),
    CircuitMethod("eap-ig", eap_ig, "edge", "EAP with integrated gradients over input embeddings (Hanna et al.)", True),
    CircuitMethod(
        "activation-patching", activation_patching, "node", "each node's exact effect patched alone (oracle)", True
    ),
    CircuitMethod("random", random_scores, "edge", "standard normal scores (control)", True),
)
