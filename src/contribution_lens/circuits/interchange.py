"""Interchange passes: what a circuit keeps clean and what it patches with the counterfactual.

A circuit ``C`` is a set of edges. In its patched pass, every input ``i`` of a node reads

    x_i = s_i + sum_{u -> i not in C} (r_u - o_u),

where ``s_i`` is the residual stream this pass carries where ``i`` reads it, ``o_u`` is node
``u``'s output in this pass and ``r_u`` its output in the counterfactual (corrupted) pass: each
edge left out carries the counterfactual's activation, each kept edge the pass's own (MIB's
interchange intervention). Keeping every edge gives the clean pass; keeping none, the
counterfactual's. The differences ``r_u - o_u`` are held in float32 for one batch of prompts,
whose size a memory budget sets (`batch_size`), writers first (``[writer batch pos d_model]``):
the writers upstream of an input are then one contiguous block, read by one matrix product.

An MLP, or a layer's heads, whose output cannot differ from the counterfactual's or cannot reach
the logits through kept edges (`active_writers`) need not be computed: with ``skip_idle`` the pass
takes the recorded output (`Interchange.supplies`). The adapter then skips an MLP's products; idle
heads read the stream as it is (no per-head inputs: no sums of differences, no per-head norms and
projections).

The same passes serve the gradient methods: `Gradient` reads every input as ``s_i`` itself and
keeps those tensors, so ``dm/dx_i`` is the gradient at each input (the q, k, v inputs of a head
apart), and `NodePatch` replaces whole nodes' outputs (activation patching).
"""

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens.adapter import Model, circuit_pass, embedding_pass
from contribution_lens.circuits.graph import Graph
from contribution_lens.circuits.task import Task

MetricFn = Callable[[Float[Tensor, "batch d_vocab"], Int[Tensor, " batch"], Int[Tensor, " batch"]], Tensor]


def _logit_diff(logits: Tensor, answer: Tensor, foil: Tensor) -> Tensor:
    return logits.gather(1, answer[:, None])[:, 0] - logits.gather(1, foil[:, None])[:, 0]


def _prob(logits: Tensor, answer: Tensor, foil: Tensor) -> Tensor:
    return logits.softmax(-1).gather(1, answer[:, None])[:, 0]


METRICS: dict[str, MetricFn] = {"logit_diff": _logit_diff, "probability": _prob}
"""Per-prompt metrics a circuit pass reads at the last position (`Task`'s names): the logit difference
answer - foil, or the answer's probability. Not ``kl``: it compares a run with the clean run's whole
distribution, which a patched pass does not hold."""

TWO_LOGITS = frozenset({"logit_diff"})
"""The metrics that read the answer's and the foil's logits alone: a pass unembeds only those two columns."""


def check_metric(task: Task) -> MetricFn:
    if task.metric not in METRICS:
        raise ValueError(
            f"task.metric: circuits read {' or '.join(METRICS)} at the last position, not {task.metric!r} "
            "(use task.with_metric('logit_diff'))"
        )
    return METRICS[task.metric]


def metric(task: Task, logits: Float[Tensor, "batch pos d_vocab"], rows: Int[Tensor, " batch"]) -> Tensor:
    """The task's metric of each prompt in ``rows`` (float32), read at its last real position."""
    device = logits.device
    return _metric(task, logits[torch.arange(len(rows), device=device), task.last[rows].to(device)], rows)


def _metric(task: Task, at_last: Float[Tensor, "batch d_vocab"], rows: Int[Tensor, " batch"]) -> Tensor:
    at_last = at_last if at_last.dtype == torch.float64 else at_last.float()
    device = at_last.device
    return check_metric(task)(at_last, task.answer[rows].to(device), task.foil[rows].to(device))


def metric_pass(model: Model, task: Task, rows: Int[Tensor, " batch"], stream: Any, **options: Any) -> Tensor:
    """The metric of the prompts ``rows`` in one circuit pass through ``stream`` (``options``: `circuit_pass`'s).

    Only each prompt's last real position is unembedded (`circuit_pass`'s ``last``), and of it only
    the answer's and the foil's logits where the metric reads no other (`TWO_LOGITS`).
    ``corrupted=True`` runs the counterfactual prompts. A stream on MIB's graph (``stream.graph``
    counted ``"mib"``) runs an ungrouped pass: every query head its own keys and values.
    """
    corrupted = options.pop("corrupted", False)
    graph = getattr(stream, "graph", None)
    options.setdefault("ungroup", isinstance(graph, Graph) and graph.counting == "mib")
    last = task.last[rows]
    read = check_metric(task)
    columns = torch.stack([task.answer[rows], task.foil[rows]], 1) if task.metric in TWO_LOGITS else None
    logits = circuit_pass(model, tokens(task, rows, corrupted), stream, last=last, columns=columns, **options)
    if columns is not None:  # the two columns alone (float32 at least): the answer's, then the foil's
        first = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        return read(logits[:, 0], first, first + 1)
    if logits.shape[1] == 1:  # unembedded at ``last`` alone
        return _metric(task, logits[:, 0], rows)
    return metric(task, logits, rows)


class Null:
    """A stream that changes nothing: the model's own pass."""

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        return None

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        return None


ALL = slice(None)
"""Every position: the window of a pass that holds a whole batch of prompts."""


@dataclass
class Record:
    """Keeps every writer's output ``[writer batch pos d_model]`` (detached, float32 at least) at ``window``."""

    graph: Graph
    outputs: Tensor | None = None
    window: slice = field(default_factory=lambda: ALL)
    storage: Tensor | None = None
    """An earlier batch's outputs, whose memory this pass's may take (`reused`)."""
    written: int = 0
    """Writers written so far: every one by the end of a pass, or `record` refuses its outputs."""

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        out = out[:, self.window]
        if self.outputs is None:
            batch, pos, _, d_model = out.shape
            # Not zeroed: every writer's rows are written before `record` hands them over (it counts them).
            self.outputs = reused(self.storage, (len(self.graph.writers), batch, pos, d_model), out)
        lo, hi = self.graph.writer_range(kind, layer)
        self.outputs[lo:hi] = out.detach().permute(2, 0, 1, 3)
        self.written += hi - lo
        return None

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        return None


@dataclass
class Difference:
    """Turns the counterfactual's outputs ``r_u`` into ``r_u - o_u`` in place as this pass writes ``o_u``.

    The clean outputs are never held: one ``[writer batch pos d_model]`` tensor instead of three.
    """

    graph: Graph
    delta: Float[Tensor, "writer batch pos d_model"]
    window: slice = field(default_factory=lambda: ALL)

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        lo, hi = self.graph.writer_range(kind, layer)
        # ``delta`` was recorded in inference mode: it may be changed in place only there.
        with torch.inference_mode():
            self.delta[lo:hi] -= out[:, self.window].detach().permute(2, 0, 1, 3)
        return None

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        return None


@dataclass
class Interchange:
    """The patched pass of a circuit: ``patch[u, i]`` is 1 where edge ``u -> i`` carries the counterfactual.

    ``delta`` starts as the counterfactual's outputs; each write subtracts this pass's, leaving
    ``r_u - o_u`` by the time any input downstream reads it. With ``corrupted`` (the
    counterfactual's outputs, left as they are) ``delta`` is only where the differences go, so
    passes of several circuits share one recording and one tensor to write in, copying nothing.
    ``patch`` may hold any weights (``t`` patches a fraction ``t`` of the difference: the EAP
    tests' finite differences).
    """

    graph: Graph
    delta: Float[Tensor, "writer batch pos d_model"]
    patch: Float[Tensor, "writer input"]
    skip_unpatched: bool = True
    share_identical: bool = True
    corrupted: Float[Tensor, "writer batch pos d_model"] | None = None
    _group: tuple[tuple[int, int], Tensor | None] = ((-1, -1), None)
    _total: Tensor | None = None
    _mlp: tuple[int, Tensor | None] = (-1, None)
    """The layer whose MLP input's early sum (`_early`) is held, and that sum (None: nothing patched)."""
    buffers: dict[Any, Tensor] = field(default_factory=dict)
    """Memory the sums are written in: passes of one batch given the same dict reuse it."""
    skip_idle: bool = False
    """Whether an MLP or a layer's heads that are not `active_writers` take the counterfactual's output instead of
    their own (`supplies`): exact only where ``delta`` (or ``corrupted``) holds a counterfactual pass's real outputs."""
    _idle: frozenset[tuple[str, int]] = frozenset()
    """The writers ``(kind, layer)`` this pass supplies (`idle_writers`)."""

    def __post_init__(self) -> None:
        if self.skip_idle:
            self._idle = idle_writers(self.graph, self.patch)

    def supplies(self, kind: str, layer: int) -> bool:
        """Whether this stream writes the output of ``kind`` (``"heads"``, ``"mlp"``) at ``layer`` itself: the
        model's own output there is replaced, so its inputs need not be read per node."""
        return (kind, layer) in self._idle

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        lo, hi = self.graph.writer_range(kind, layer)
        source = self.delta if self.corrupted is None else self.corrupted
        out = out.detach().permute(2, 0, 1, 3)
        if self.supplies(kind, layer):
            # The counterfactual's output in place of whatever the model wrote: no difference to carry.
            correction = (source[lo:hi] - out).sum(0)
            self.delta[lo:hi].zero_()
            return correction
        torch.sub(source[lo:hi], out, out=self.delta[lo:hi])
        total = self.delta[lo:hi].sum(0)
        self._total = total if self._total is None else self._total + total
        return None

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        writer = "heads" if kind in ("q", "k", "v") else kind
        if writer == "mlp" and self.supplies(writer, layer):
            return None  # its output is the counterfactual's whatever it reads
        if kind == "mlp" and self._mlp[0] == layer:
            return self._mlp_input(layer, stream)
        start, end = self.graph.input_group(kind, layer)
        if self._group[0] != (start, end):  # a layer's q, k and v inputs are computed together, once
            upstream = int(self.graph.upstream[start])
            # Idle heads read nothing of their own: only their MLP's early sum is computed with them.
            own = start if writer == "heads" and self.supplies(writer, layer) else end
            self._group = (
                (start, end),
                self._inputs(self.patch[:upstream, start:own], stream, self._early(kind, layer)),
            )
        group = self._group[1]
        lo, hi = self.graph.input_range(kind, layer)
        return None if group is None else group[:, :, lo - start : hi - start]

    def replaces(self, layer: int) -> bool:
        """Whether `read` of layer ``layer``'s q, k and v inputs hands each head inputs of its own.

        Known before the pass, and the same for the three (they are read as one group): the model's own
        projections of the stream there are then never used, and the adapter skips them.
        """
        if self.supplies("heads", layer):
            return False
        patched = self._attention_patch(layer)
        return not self._shared(patched) and (not self.skip_unpatched or bool(patched.any()))

    def _attention_patch(self, layer: int) -> Tensor:
        """The weights of the edges into layer ``layer``'s q, k and v inputs ``[upstream input]``."""
        start, end = self.graph.input_group("q", layer)
        return self.patch[: int(self.graph.upstream[start]), start:end]

    def _shared(self, patched: Tensor) -> bool:
        """Whether the q, k and v inputs of ``patched`` (`_attention_patch`) are read as one (`read_shared`)."""
        return self.share_identical and bool((patched == patched[:, :1]).all())

    def read_shared(self, layer: int, stream: Tensor) -> Tensor | None:
        """Layer ``layer``'s one attention input where all its q, k and v inputs are the same, else None.

        Then the model's own norm and projections compute them from it (no per-head inputs).
        """
        start, end = self.graph.input_group("q", layer)
        patched = self._attention_patch(layer)
        if self.supplies("heads", layer) or not self._shared(patched):
            return None
        shared = self._inputs(patched[:, :1], stream, self._early("q", layer))
        self._group = ((start, end), None)  # the q, k and v reads then keep the model's own computation
        return None if shared is None else shared[:, :, 0]

    def _early(self, kind: str, layer: int) -> tuple[int, Tensor] | None:
        """The MLP input's layer and weights over the writers before it, read with its attention's inputs.

        Those writers' differences are then read once a layer, not twice: the MLP's own read adds only
        its layer's heads (`_mlp_input`).
        """
        if kind not in ("q", "k", "v") or self.supplies("mlp", layer):
            return None
        column = self.graph.input_range("mlp", layer)[0]
        return layer, self.patch[: self.graph.layer_start(layer), column : column + 1]

    def _inputs(self, patched: Tensor, stream: Tensor, early: tuple[int, Tensor] | None = None) -> Tensor | None:
        """``s + sum_u P[u, i] delta_u``, or ``s + sum_u delta_u - sum_u (1 - P[u, i]) delta_u`` when fewer are kept.

        The writers upstream are exactly those written so far, whose differences' sum is kept as
        they are written: a small circuit then costs its kept edges, a large one its patched edges.
        ``early`` (`_early`): one more column, the MLP's sum over these writers, held for its read
        (without ``s``).
        """
        weights, group_size = self._columns(patched, None if early is None else early[1])
        if early is not None:
            self._mlp = (early[0], None)
        if weights is None:
            return None  # every edge into these inputs is kept: the model's own computation is the same
        batch, pos, d_model = stream.shape
        out = self._buffer("inputs", (batch * pos, weights.shape[1], d_model)).view(batch, pos, -1, d_model)
        kept = 1 - weights
        rows_patched = torch.nonzero(weights.any(1))[:, 0]
        rows_kept = torch.nonzero(kept.any(1))[:, 0]
        if len(rows_kept) < len(rows_patched) and self._total is not None:
            self._sum(rows_kept, kept, out).neg_().add_(self._total[:, :, None])
        else:
            self._sum(rows_patched, weights, out)
        if early is not None and weights.shape[1] > group_size:
            self._mlp = (early[0], out[:, :, -1:])
        return out[:, :, :group_size].add_(stream[:, :, None]) if group_size else None

    def _columns(self, patched: Tensor, early: Tensor | None) -> tuple[Tensor | None, int]:
        """The weights of the columns one product computes, and how many of them are the group's own (the first).

        A column none of whose edges is patched is left out (unless ``skip_unpatched`` is off): the
        model computes that input itself.
        """
        wanted = [
            (weights.to(self.delta.dtype), own)
            for weights, own in ((patched, True), (early, False))
            if weights is not None and (not self.skip_unpatched or bool(weights.any()))
        ]
        if not wanted:
            return None, 0
        group_size = patched.shape[1] if wanted[0][1] else 0
        return torch.cat([weights for weights, _ in wanted], 1), group_size

    def _mlp_input(self, layer: int, stream: Tensor) -> Tensor | None:
        """The MLP's input: its early sum over the writers before ``layer`` plus its own layer's heads' part."""
        _, early = self._mlp
        self._mlp = (-1, None)
        lo, hi = self.graph.writer_range("heads", layer)
        column = self.graph.input_range("mlp", layer)[0]
        heads = self.patch[lo:hi, column].to(self.delta.dtype)
        patched = not self.skip_unpatched or bool(heads.any())
        if early is None and not patched:
            return None  # every edge into this input is kept
        batch, pos, d_model = stream.shape
        out = self._buffer("mlp", (batch, pos, 1, d_model))
        if patched:  # a layer's heads are a few contiguous rows: read whole, no gather
            torch.matmul(heads[None], self.delta[lo:hi].reshape(hi - lo, -1), out=out.view(1, -1))
            out.add_(stream[:, :, None])
        else:
            out.copy_(stream[:, :, None])
        return out if early is None else out.add_(early)

    def _buffer(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """Memory this pass keeps for ``name`` at ``shape``: a layer's inputs are read by its own hooks
        before the next layer's are made, and a fresh tensor of this size costs, on a CPU, as much in
        page faults as the product that fills it."""
        key = (name, shape)
        if self.buffers.get(key) is None:
            self.buffers[key] = self.delta.new_empty(shape)
        return self.buffers[key]

    def _sum(self, rows: Tensor, weights: Tensor, out: Tensor) -> Tensor:
        """``sum_u weights[u, i] delta_u`` over ``rows`` into ``out`` ``[batch pos input d_model]``.

        Unless every row is needed (then the contiguous block is read as it is), the rows are gathered
        a few positions at a time, each block multiplied while it is still in cache: gathering them
        whole first writes them out and reads them back through memory, twice the product's own
        traffic. On a CPU a product over a block in cache is also faster than one over the rows in
        place: at 90 % of the rows it is still the cheaper.
        """
        upstream, batch, pos, d_model = self.delta[: weights.shape[0]].shape
        flat = out.view(batch * pos, -1, d_model)
        if len(rows) == upstream:
            _moved(self.delta[:upstream], weights, flat)
            return out
        delta = self.delta[:upstream].view(upstream, batch * pos, d_model)
        row_bytes = max(1, len(rows) * d_model * self.delta.element_size())
        # A GPU has no such cache to keep a block in: it gathers the rows in one go.
        step = batch * pos if self.delta.is_cuda else min(batch * pos, max(1, GATHER_BYTES // row_bytes))
        held = self.buffers.get("gather")
        if held is None or held.numel() < len(rows) * step * d_model or held.dtype != self.delta.dtype:
            # The largest gather so far: the memory is taken once a batch, not once a layer.
            held = self.buffers["gather"] = self.delta.new_empty(len(rows) * step * d_model)
        chosen = weights[rows].T.contiguous()
        for start in range(0, batch * pos, step):
            block = delta[:, start : start + step]
            gathered = held[: len(rows) * block.shape[1] * d_model].view(len(rows), block.shape[1], d_model)
            torch.index_select(block, 0, rows, out=gathered)
            torch.matmul(chosen, gathered.transpose(0, 1), out=flat[start : start + step])
        return out


def active_writers(graph: Graph, patch: Float[Tensor, "writer input"]) -> Bool[Tensor, " writer"]:
    """The writers whose output in ``patch``'s pass can differ from the counterfactual's and reach the logits.

    An edge carries a writer's own output where ``patch < 1``. A writer is *live* where such an
    edge joins it to an embedding through live writers (else every input it reads is the
    counterfactual's, and so is its output), and *useful* where such edges lead on to the logits
    (else the logits read only its counterfactual output). Any other writer may take the
    counterfactual's output instead of computing its own, and no metric changes. A layer's heads
    count as one: a post-attention norm's scale mixes their outputs. Not where that norm also
    scales an output bias (`contribution_lens.adapter.hidden_bias_path`): that term reaches every
    later input with no edge to carry it.

    Example:
        >>> g = Graph(n_layers=2, n_heads=1, n_kv_heads=1, pos_embed=False)
        >>> patch = g.valid.float()  # every edge patched
        >>> for edge in ("embed->L0H0<v>", "L0H0->L1.mlp", "L1.mlp->logits"):
        ...     u, i = g.edge_index[0][g.edge_ids[edge]], g.edge_index[1][g.edge_ids[edge]]
        ...     patch[u, i] = 0
        >>> [name for name, on in zip(g.writers, active_writers(g, patch).tolist()) if on]
        ['embed', 'L0H0', 'L1.mlp']
    """
    kept = graph.valid & (patch.cpu() < 1)
    live = torch.zeros(len(graph.writers), dtype=torch.bool)
    live[: graph.n_embeddings] = True
    for layer in range(graph.n_layers):
        start, end = graph.input_group("q", layer)
        lo, hi = graph.writer_range("heads", layer)
        live[lo:hi] = bool((kept[:, start:end] & live[:, None]).any())
        live[hi] = bool((kept[:, graph.input_range("mlp", layer)[0]] & live).any())
    useful = torch.zeros(len(graph.writers), dtype=torch.bool)
    reads = torch.zeros(len(graph.inputs), dtype=torch.bool)  # the inputs of useful writers, and the logits'
    reads[graph.input_range("logits", 0)[0]] = True
    for layer in reversed(range(graph.n_layers)):
        lo, hi = graph.writer_range("heads", layer)
        useful[hi] = bool((kept[hi] & reads).any())
        reads[graph.input_range("mlp", layer)[0]] |= useful[hi]
        useful[lo:hi] = bool((kept[lo:hi] & reads).any())
        start, end = graph.input_group("q", layer)
        reads[start:end] |= useful[lo]
    useful[: graph.n_embeddings] = True
    return live & useful


def idle_writers(graph: Graph, patch: Float[Tensor, "writer input"]) -> frozenset[tuple[str, int]]:
    """The MLPs and layers' heads, ``(kind, layer)``, that are not among the `active_writers` of ``patch``'s pass.

    Example:
        >>> g = Graph(n_layers=2, n_heads=1, n_kv_heads=1, pos_embed=False)
        >>> patch = g.valid.float()
        >>> patch[g.edge_index[0][g.edge_ids["embed->logits"]], g.edge_index[1][g.edge_ids["embed->logits"]]] = 0
        >>> sorted(idle_writers(g, patch))  # only the direct path is kept: every block is idle
        [('heads', 0), ('heads', 1), ('mlp', 0), ('mlp', 1)]
    """
    active = active_writers(graph, patch)
    return frozenset(
        (kind, layer)
        for layer in range(graph.n_layers)
        for kind in ("heads", "mlp")
        if not bool(active[graph.writer_range(kind, layer)[0]])
    )


GATHER_BYTES = 4 * 2**20
"""Bytes of differences a CPU gathers at a time: a block the product reads again while it is in cache."""


@dataclass
class NodePatch:
    """Replaces the outputs of the ``patched`` writers by the counterfactual's where they join the stream.

    ``clean`` (the clean pass's outputs, as `record` keeps them): every MLP before the first patched
    writer's layer, and any patched MLP, takes its output from a recording instead of computing it
    (`supplies`): up to that layer this pass is the clean pass, so its MLPs' outputs are the clean
    ones. A patched MLP's output is the counterfactual's whatever it reads.
    """

    graph: Graph
    corrupted: Float[Tensor, "writer batch pos d_model"]
    patched: Bool[Tensor, " writer"]
    clean: Float[Tensor, "writer batch pos d_model"] | None = None
    _first: int = 0
    """The layer of the first patched writer: the MLPs before it are the clean pass's (with ``clean``)."""

    def __post_init__(self) -> None:
        chosen = torch.nonzero(self.patched.cpu())[:, 0].tolist()
        self._first = min((self.graph.writer_layer(u) for u in chosen), default=self.graph.n_layers)

    def supplies(self, kind: str, layer: int) -> bool:
        """Whether this stream writes the output of ``kind`` at ``layer`` itself: the model need not compute it."""
        if kind != "mlp" or self.clean is None:
            return False
        return layer < self._first or bool(self.patched[self.graph.writer_range("mlp", layer)[0]])

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        lo, hi = self.graph.writer_range(kind, layer)
        chosen = self.patched[lo:hi]
        if not bool(chosen.any()):
            if not self.supplies(kind, layer):
                return None
            assert self.clean is not None  # an unpatched writer is supplied from the clean recording
            return (self.clean[lo:hi] - out.permute(2, 0, 1, 3)).sum(0)
        index = torch.nonzero(chosen)[:, 0]
        return (self.corrupted[lo:hi][index] - out.permute(2, 0, 1, 3)[index]).sum(0)

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        return None


@dataclass
class Gradient:
    """A differentiable pass that keeps each input ``x_i`` (read as the stream itself) for ``dm/dx_i``.

    ``alpha`` (integrated gradients) moves the embeddings to ``r + alpha (o - r)``: the
    counterfactual's at 0, the clean pass's at 1 (``corrupted`` holds the counterfactual's
    embeddings first, every position: read only where ``alpha < 1``); the shift is a leaf that
    needs a gradient, so the pass is differentiable whether or not the model's weights are.
    ``clean`` (when given) keeps this pass's outputs (`Record`) or subtracts them from the
    counterfactual's (`Difference`). The inputs kept are those at ``window``'s positions: a
    prompt too long for the memory budget is scored a window at a time (`pieces`).
    """

    graph: Graph
    corrupted: Float[Tensor, "writer batch pos d_model"]
    alpha: float = 1.0
    clean: Record | Difference | None = None
    inputs: list[tuple[int, int, Tensor]] = field(default_factory=list)
    leaves: tuple[str, ...] = ()
    """Kinds of input (``"q"``, ``"k"``) read as leaves: their gradient is kept, nothing flows on upstream."""
    window: slice = field(default_factory=lambda: ALL)

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        shift = None
        if kind in ("embed", "pos_embed"):  # read before ``clean`` may turn ``corrupted`` into differences
            lo, _ = self.graph.writer_range(kind, layer)
            toward = self.corrupted[lo] - out[:, :, 0].detach() if self.alpha != 1.0 else 0.0
            shift = ((1.0 - self.alpha) * toward + torch.zeros_like(out[:, :, 0].detach())).requires_grad_(True)
        if self.clean is not None:
            self.clean.write(kind, layer, out)
        return shift

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        # One tensor for each kind of input (not one for the layer's q, k and v sliced three ways:
        # the backward pass of a slice fills a zero gradient of the whole group).
        lo, hi = self.graph.input_range(kind, layer)
        source = stream.detach() if kind in self.leaves else stream  # detached: no tangent either (forward mode)
        kept = source[:, self.window, None].expand(-1, -1, hi - lo, -1)
        if kind in self.leaves:
            kept.requires_grad_(True)
        self.inputs.append((lo, hi, kept))
        if self.window == ALL:
            return kept
        start, stop, _ = self.window.indices(stream.shape[1])
        outside = source[:, :, None].expand(-1, -1, hi - lo, -1)
        return torch.cat([outside[:, :start], kept, outside[:, stop:]], dim=1)


def _moved(
    delta: Float[Tensor, "upstream batch pos d_model"],
    weights: Float[Tensor, "upstream slot"],
    out: Float[Tensor, "batch_pos slot d_model"],
) -> None:
    """``sum_u weights[u, i] delta_u`` for every input ``i`` into ``out``: one product a position, no copy.

    ``[slot upstream] @ [upstream d_model]`` at each position leaves the result already laid out
    ``[batch pos slot d_model]``.
    """
    upstream, batch, pos, d_model = delta.shape
    if upstream == 0:
        out.zero_()
        return
    torch.matmul(weights.T, delta.reshape(upstream, batch * pos, d_model).transpose(0, 1), out=out)


CHUNK_INPUTS = 64
"""Inputs whose gradients one matrix product reads: the differences are read once a chunk, not once a group."""


def gradient_scores(
    graph: Graph,
    stream: Gradient,
    value: Tensor,
    delta: Float[Tensor, "writer batch pos d_model"],
    scores: Float[Tensor, "writer input"],
    only: Bool[Tensor, " input"] | None = None,
) -> None:
    """Add ``sum_{batch, pos} delta_u . dm/dx_i`` to ``scores[u, i]`` for every edge (``value``: the summed metric).

    ``only``: the inputs wanted; a layer's inputs of one kind (its q inputs, k inputs, v inputs, its
    MLP's, the logits') holding none of them are skipped (each kind reads every upstream difference).
    """
    add_products(graph, input_gradients(stream, value, only), delta, scores)


def input_gradients(
    stream: Gradient, value: Tensor, only: Bool[Tensor, " input"] | None = None
) -> list[tuple[int, int, Tensor]]:
    """``dm/dx_i`` of every kind of input (``only``: as `gradient_scores`), one backward pass: ``(lo, hi, grad)``."""
    groups = [(lo, hi, x) for lo, hi, x in stream.inputs if only is None or bool(only[lo:hi].any())]
    grads = torch.autograd.grad(value, [x for _, _, x in groups], allow_unused=True)
    return [(lo, hi, grad) for (lo, hi, _), grad in zip(groups, grads, strict=True) if grad is not None]


def add_products(
    graph: Graph,
    found: list[tuple[int, int, Tensor]],
    delta: Float[Tensor, "writer batch pos d_model"],
    scores: Float[Tensor, "writer input"],
) -> None:
    """Add ``sum_{batch, pos} delta_u . grad_i`` to ``scores[u, i]`` for the inputs ``found`` (`input_gradients`)."""
    flat = delta.reshape(len(delta), -1)
    chunks = list(_chunks(found, CHUNK_INPUTS))
    widest = max((sum(hi - lo for lo, hi, _ in chunk) for chunk in chunks), default=0)
    # One buffer for every chunk's gradients: a fresh tensor a chunk costs, on a CPU, as much again
    # in page faults as the copy itself (0.3 of a forward pass of Qwen2.5-0.5B at 13 IOI prompts).
    buffer = flat.new_empty(widest, flat.shape[1])
    for chunk in chunks:
        _add_products(graph, flat, chunk, scores, buffer)


def _chunks(found: list[tuple[int, int, Tensor]], size: int) -> Iterator[list[tuple[int, int, Tensor]]]:
    """Consecutive groups gathered until they hold ``size`` inputs (a group is never split)."""
    chunk: list[tuple[int, int, Tensor]] = []
    for group in found:
        if chunk and sum(hi - lo for lo, hi, _ in chunk) + group[1] - group[0] > size:
            yield chunk
            chunk = []
        chunk.append(group)
    if chunk:
        yield chunk


def _add_products(
    graph: Graph,
    flat: Float[Tensor, "writer batch_pos_d_model"],
    chunk: list[tuple[int, int, Tensor]],
    scores: Float[Tensor, "writer input"],
    buffer: Float[Tensor, "slot batch_pos_d_model"],
) -> None:
    """One matrix product for a chunk of groups; each group keeps only its own upstream writers' rows.

    The product is bound by reading ``flat`` (skinny on the inputs' side): one read for a whole
    chunk instead of one per group makes it several times faster, at the cost of a few rows
    computed for the chunk's first groups and dropped. The gradients go inputs first into
    ``buffer``: autograd lays each group's out slot-major, so that is a copy of contiguous blocks.
    """
    upstream = [int(graph.upstream[lo]) for lo, _, _ in chunk]
    grads = buffer[: sum(hi - lo for lo, hi, _ in chunk)]
    torch.cat([einops.rearrange(grad.to(flat.dtype), "b p i d -> i (b p d)") for _, _, grad in chunk], out=grads)
    product = grads @ flat[: max(upstream)].T  # [input writer]
    start = 0
    for (lo, hi, _), rows in zip(chunk, upstream, strict=True):
        scores[:rows, lo:hi] += product[start : start + hi - lo, :rows].T
        start += hi - lo


def per_edge(graph: Graph, scores: Float[Tensor, "writer input"], count: int) -> Float[Tensor, " edge"]:
    """``scores`` summed over ``count`` prompts (or steps) as one float32 mean an edge, in `Graph.edges` order."""
    writers, inputs = graph.edge_index
    return (scores.cpu()[writers, inputs] / count).float()


def batch_size(task: Task, n_writers: int, d_model: int, copies: float, memory: int) -> int:
    """Prompts a batch holds so that ``copies`` of ``[writer batch pos d_model]`` (float32) fit ``memory`` bytes.

    At least one: a pass that reads every position's differences at once (a patched pass) holds a
    prompt whole, and says so where one prompt alone is over the budget.
    """
    per_prompt = task.clean.shape[1] * n_writers * d_model * 4 * copies
    if per_prompt > memory:
        warnings.warn(
            f"memory={memory:,} bytes: one prompt of {task.clean.shape[1]} positions needs {per_prompt / 2**30:.2f} "
            "GiB of differences in a pass that reads every position's at once (a patched pass, activation "
            "patching, information-flow routes); it is held whole, over the budget (the gradient methods "
            "score such a prompt in windows of positions)",
            stacklevel=2,
        )
    return max(1, min(len(task), int(memory // max(per_prompt, 1))))


def pieces(task: Task, n_writers: int, d_model: int, copies: float, memory: int) -> Iterator[tuple[Tensor, slice]]:
    """The prompts' rows and the window of positions each scoring pass holds, so ``copies`` fit ``memory`` bytes.

    Batches of whole prompts (`batch_size`) where one prompt fits; otherwise one prompt at a time,
    its positions split into windows that fit, each window its own passes: scores are sums over
    positions, so the windows add up to the whole prompt's, at the cost of a pass pair a window.

    Example:
        >>> import torch
        >>> from contribution_lens.circuits.task import Task
        >>> ids = torch.zeros(2, 5, dtype=torch.long)
        >>> task = Task("t", ids, ids, ids[:, 0], ids[:, 0] + 1, Task.full_length(ids))
        >>> [(rows.tolist(), (w.start, w.stop)) for rows, w in pieces(task, 1, 1, 1.0, 8)]
        [([0], (0, 2)), ([0], (2, 4)), ([0], (4, 5)), ([1], (0, 2)), ([1], (2, 4)), ([1], (4, 5))]
    """
    length = task.clean.shape[1]
    window = window_length(length, n_writers, d_model, copies, memory)
    if window is None:
        for rows in batches(task, batch_size(task, n_writers, d_model, copies, memory)):
            yield rows, ALL
        return
    for row in range(len(task)):
        for start in range(0, length, window):
            yield torch.tensor([row]), slice(start, min(start + window, length))


def window_length(length: int, n_writers: int, d_model: int, copies: float, memory: int) -> int | None:
    """Positions a window of a prompt of ``length`` holds so ``copies`` fit ``memory`` bytes (None: it fits whole)."""
    per_position = n_writers * d_model * 4 * copies
    if length * per_position <= memory:
        return None
    return max(1, int(memory // per_position))


def batches(task: Task, size: int) -> Iterator[Int[Tensor, " batch"]]:
    """Row indices of the task's prompts, ``size`` at a time."""
    for start in range(0, len(task), size):
        yield torch.arange(start, min(start + size, len(task)))


def tokens(task: Task, rows: Tensor, corrupted: bool = False) -> Int[Tensor, "batch pos"]:
    return (task.corrupted if corrupted else task.clean)[rows]


def reused(storage: Tensor | None, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """Memory of ``shape`` (``like``'s dtype and device), ``storage``'s where it is big enough, not zeroed.

    A method scoring batch after batch hands each batch's recording the last one's memory: on a
    CPU a fresh tensor this size costs as much in page faults as filling it. The caller writes
    every element.
    """
    numel = math.prod(shape)
    if (
        storage is not None
        and (storage.dtype, storage.device) == (like.dtype, like.device)
        and storage.numel() >= numel
    ):
        return storage.reshape(-1)[:numel].view(shape)
    return like.new_empty(shape)


def record(
    model: Model,
    task: Task,
    graph: Graph,
    rows: Tensor,
    corrupted: bool,
    window: slice = ALL,
    storage: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One pass without autograd: every writer's output (at ``window``'s positions) and the prompts' metric.

    ``storage``: an earlier batch's outputs, no longer needed, whose memory these may take.
    """
    stream = Record(graph, window=window, storage=storage)
    with torch.inference_mode():
        value = metric_pass(model, task, rows, stream, corrupted=corrupted)
    if stream.outputs is None or stream.written != len(graph.writers):
        raise RuntimeError(f"a recording pass wrote {stream.written} of the graph's {len(graph.writers)} writers")
    return stream.outputs, value


_EMBEDDINGS = ("embed", "pos_embed")


@dataclass
class _Embeddings:
    """Keeps the embeddings' outputs, ``[embedding batch pos d_model]`` in the graph's writer order."""

    outputs: list[Tensor | None]

    def write(self, kind: str, layer: int, out: Tensor) -> Tensor | None:
        self.outputs[_EMBEDDINGS.index(kind)] = out.detach()[:, :, 0]
        return None

    def read(self, kind: str, layer: int, stream: Tensor) -> Tensor | None:
        return None


def embeddings(model: Model, tokens: Tensor, n: int) -> Float[Tensor, "embedding batch pos d_model"]:
    """The embeddings of ``tokens`` alone (a pass stopped before the first block)."""
    stream = _Embeddings([None] * n)
    with torch.inference_mode():
        embedding_pass(model, tokens, stream)
    return torch.stack([x for x in stream.outputs if x is not None])  # out of inference mode: a normal tensor


def patched_metric(model: Model, task: Task, rows: Tensor, stream: Interchange | NodePatch | Null) -> Tensor:
    """The metric of the clean prompts ``rows`` in a pass through ``stream``."""
    with torch.inference_mode():
        return metric_pass(model, task, rows, stream)
