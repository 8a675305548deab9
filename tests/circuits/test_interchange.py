"""The interchange identities on every attention form: all edges kept is the clean pass, none kept the
counterfactual's, and a node-level circuit through the edge machinery is the patching of the nodes left out."""

from pathlib import Path

import pytest
import torch
from circuit_helpers import random_task

import architectures
import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens import adapter
from contribution_lens.circuits import interchange as ic

# Tiny checkpoints of real families: learned positions and biases (GPT-2), post-attention norms and
# q/k norms (Gemma 3), rotary GQA (Llama), rotary GQA with q/k/v biases (Qwen2).
CHECKPOINTS = ("GPT2LMHeadModel", "Gemma3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM")
FORMS = ["mha", "gqa-biases", "mqa", *CHECKPOINTS]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, object]:
    built = {"mha": tiny_bridge("mha"), "gqa-biases": tiny_bridge("gqa", biases=True), "mqa": tiny_bridge("mqa")}
    folder = tmp_path_factory.mktemp("circuit-checkpoints")
    for name in CHECKPOINTS:
        built[name] = cl.load_model(str(architectures.build(name, Path(folder) / name)))
    return built


def _passes(model, task):
    graph = cl.circuit_graph(model)
    rows = torch.arange(len(task))
    record, corrupted = ic.record(model, task, graph, rows, corrupted=True)
    _, clean = ic.record(model, task, graph, rows, corrupted=False)
    return graph, rows, record, clean, corrupted


@pytest.mark.parametrize("form", FORMS)
def test_every_edge_kept_is_the_clean_pass_and_none_the_counterfactual(models, form) -> None:
    model = models[form]
    task = random_task(model)
    graph, rows, record, clean, corrupted = _passes(model, task)
    # skip_unpatched=False: every input is recomputed per head through the norm and projections.
    kept = ic.Interchange(
        graph, record.clone(), torch.zeros(graph.valid.shape), skip_unpatched=False, share_identical=False
    )
    assert_close(ic.patched_metric(model, task, rows, kept), clean, rtol=0, atol=1e-5)
    for share in (True, False):  # one input for all heads through the model's own projections, or per head
        none = ic.Interchange(graph, record.clone(), graph.valid.float(), share_identical=share)
        assert_close(ic.patched_metric(model, task, rows, none), corrupted, rtol=0, atol=1e-5)
    every = cl.Circuit.from_nodes(graph, graph.components)
    assert abs(cl.evaluate_circuit(model, task, every).faithfulness - 1) < 1e-5


@pytest.mark.parametrize("form", FORMS)
def test_a_node_level_circuit_is_the_patching_of_the_nodes_left_out(models, form) -> None:
    model = models[form]
    task = random_task(model, seed=1)
    graph, rows, record, _, _ = _passes(model, task)
    chosen = graph.components[::2]
    circuit = cl.Circuit.from_nodes(graph, chosen)
    left_out = torch.tensor([name in graph.components and name not in chosen for name in graph.writers])
    direct = ic.patched_metric(model, task, rows, ic.NodePatch(graph, record, left_out))
    for share in (True, False):
        stream = ic.Interchange(graph, record.clone(), circuit.patch(), share_identical=share)
        assert_close(ic.patched_metric(model, task, rows, stream), direct, rtol=0, atol=1e-5)
    assert not torch.allclose(direct, ic.patched_metric(model, task, rows, ic.Null())), "the patch changed nothing"


class _EachInput:
    """The module's formula read literally: every input its own sum ``s_i + sum_u P[u, i] (r_u - o_u)``."""

    def __init__(self, graph, corrupted, patch) -> None:
        self.graph, self.corrupted, self.patch, self.delta = graph, corrupted, patch, corrupted.clone()

    def write(self, kind, layer, out):
        lo, hi = self.graph.writer_range(kind, layer)
        self.delta[lo:hi] = self.corrupted[lo:hi] - out.permute(2, 0, 1, 3)

    def read(self, kind, layer, stream):
        lo, hi = self.graph.input_range(kind, layer)
        upstream = int(self.graph.upstream[lo])
        moved = torch.einsum("ui,ubpd->bpid", self.patch[:upstream, lo:hi], self.delta[:upstream])
        return stream[:, :, None] + moved


def test_an_edge_circuits_patched_pass_is_each_inputs_own_sum_in_float64() -> None:
    """Circuits of every density (read as patched edges or as kept ones), one patching only MLP inputs (each
    MLP's sum over earlier layers read with its attention's inputs), one patching only the edges from a
    layer's heads into its MLP and one whose layer 1 heads read the counterfactual alone but write through
    kept edges, against each input's literal sum."""
    model = tiny_bridge("gqa", biases=True).to(torch.float64)
    task = random_task(model, seed=3)
    graph = cl.circuit_graph(model)
    rows = torch.arange(len(task))
    record, _ = ic.record(model, task, graph, rows, corrupted=True)
    generator = torch.Generator().manual_seed(0)
    valid = graph.valid.double()
    patches = [(torch.rand(valid.shape, generator=generator) < p).double() * valid for p in (0.1, 0.5, 0.95)]
    is_mlp = torch.tensor([name.endswith(".mlp") for name in graph.inputs])
    patches.append(valid * is_mlp)
    same_layer = torch.zeros_like(valid)
    for layer in range(graph.n_layers):
        lo, hi = graph.writer_range("heads", layer)
        same_layer[lo:hi, graph.input_range("mlp", layer)[0]] = 1
    patches.append(same_layer)
    # Layer 1's heads read only the counterfactual (every edge in patched) and write on through kept edges:
    # idle, their outputs must be the counterfactual's, not whatever the stream would have made them.
    cut_off = (torch.rand(valid.shape, generator=generator) < 0.5).double() * valid
    lo, hi = graph.writer_range("heads", 1)
    start, end = graph.input_group("q", 1)
    cut_off[:, start:end] = valid[:, start:end]
    cut_off[lo:hi] = 0
    patches.append(cut_off)
    supplied: set[str] = set()
    for patch in patches:
        with torch.inference_mode():
            want = ic.metric_pass(model, task, rows, _EachInput(graph, record, patch))
        for share, skip in ((True, False), (False, False), (True, True)):
            stream = ic.Interchange(graph, record.clone(), patch, share_identical=share, skip_idle=skip)
            assert_close(ic.patched_metric(model, task, rows, stream), want, rtol=0, atol=1e-10)
            supplied |= {kind for kind, _ in stream._idle}
    assert supplied == {"mlp", "heads"}, f"the circuits left idle only {supplied}: skip_idle was not fully tried"
    assert not torch.allclose(want, ic.patched_metric(model, task, rows, ic.Null())), "the patch changed nothing"


def _active_by_names(graph, patch):
    """`active_writers` read off the edges' names: reachability from the embeddings and to the logits."""
    unit = {name: name.split("H")[0] if "H" in name else name for name in graph.nodes}  # a layer's heads: one
    kept = [
        (unit[graph.writers[u]], {unit[n] for n in graph.input_nodes[i]})
        for u, i in zip(*graph.edge_index, strict=True)
        if patch[u, i] < 1
    ]
    live, useful = {unit[n] for n in graph.writers[: graph.n_embeddings]}, {"logits"}
    for _ in graph.nodes:  # enough rounds for the longest path
        live |= {reader for source, readers in kept if source in live for reader in readers}
        useful |= {source for source, readers in kept if readers & useful}
    return torch.tensor([(unit[n] in live and unit[n] in useful) or n in ("embed", "pos_embed") for n in graph.writers])


@pytest.mark.parametrize("shape", [(3, 4, 2, False), (2, 2, 1, True), (4, 3, 3, False)])
def test_the_active_writers_are_those_joined_to_an_embedding_and_to_the_logits(shape) -> None:
    graph = cl.circuits.graph.Graph(*shape)
    generator = torch.Generator().manual_seed(len(graph.edges))
    found = 0
    for density in (0.02, 0.05, 0.1, 0.3, 0.9):
        for _ in range(5):
            patch = (torch.rand(graph.valid.shape, generator=generator) > density).float() * graph.valid
            want = _active_by_names(graph, patch)
            assert torch.equal(ic.active_writers(graph, patch), want)
            found += int((~want).sum())
    assert found, "every writer was active: nothing was tested"


def _mlp_runs(model):
    """Counts of each layer's MLP bridge running (its own ``hook_in``), and the handles to remove."""
    counts = [0] * model.cfg.n_layers

    def counter(layer):
        def hook(module, args, output):
            counts[layer] += 1

        return hook

    handles = [model.blocks[layer].mlp.hook_in.register_forward_hook(counter(layer)) for layer in range(len(counts))]
    return counts, handles


def _per_head_reads(stream):
    """The layers whose heads ``stream`` hands inputs of their own (a q, k or v read that is not None)."""
    read, found = stream.read, set()

    def counted(kind, layer, resid):
        x = read(kind, layer, resid)
        if kind in ("q", "k", "v") and x is not None:
            found.add(layer)
        return x

    stream.read = counted
    return found


@pytest.mark.parametrize("form", FORMS)
def test_an_idle_writer_is_not_computed_and_no_metric_changes(models, form) -> None:
    """Sparse edge circuits and node-level ones: the MLPs and layers' heads that no kept path joins to an
    embedding and to the logits are supplied with the counterfactual's output; such an MLP does not run, such
    heads read no inputs of their own, and the metric is the one of the full pass."""
    model = models[form]
    task = random_task(model, seed=4)
    graph, rows, record, _, _ = _passes(model, task)
    generator = torch.Generator().manual_seed(1)
    patches = [(torch.rand(graph.valid.shape, generator=generator) > 0.15).float() * graph.valid for _ in range(3)]
    patches += [cl.Circuit.from_nodes(graph, graph.components[: len(graph.components) // 3]).patch()]
    skipped = {"mlp": 0, "heads": 0}
    for patch in patches:
        full = ic.Interchange(graph, record.clone(), patch)
        read_before = _per_head_reads(full)
        want = ic.patched_metric(model, task, rows, full)
        counts, handles = _mlp_runs(model)
        try:
            stream = ic.Interchange(graph, record.clone(), patch, skip_idle=True)
            read_now = _per_head_reads(stream)
            got = ic.patched_metric(model, task, rows, stream)
        finally:
            for handle in handles:
                handle.remove()
        assert_close(got, want, rtol=0, atol=1e-5)
        idle = {kind: sorted(layer for k, layer in stream._idle if k == kind) for kind in skipped}
        assert [layer for layer, runs in enumerate(counts) if not runs] == idle["mlp"]
        assert read_now == read_before - set(idle["heads"])
        skipped["mlp"] += len(idle["mlp"])
        skipped["heads"] += len(read_before & set(idle["heads"]))  # heads that read inputs of their own before
    assert all(skipped.values()), f"nothing of some kind was skipped: {skipped}"
    assert not cl.adapter.hidden_bias_path(model)


def _projection_runs(model):
    """The ``(side, layer)`` whose wrapped q, k, v or o ``nn.Linear`` ran, and the handles to remove."""
    ran, handles = set(), []
    for layer in range(model.cfg.n_layers):
        for side in "qkvo":
            linear = getattr(getattr(model.blocks[layer].attn, side, None), "original_component", None)
            if isinstance(linear, torch.nn.Linear):
                hook = lambda module, args, output, key=(side, layer): ran.add(key)  # noqa: E731
                handles.append(linear.register_forward_hook(hook))
    return ran, handles


@pytest.mark.parametrize("form", FORMS)
def test_a_projection_the_circuit_hooks_replace_is_not_computed(models, form) -> None:
    """Where every head of a layer reads an input of its own, the model's projection of the stream there would be
    thrown away: it does not run (GPT-2's joint product too: its bridge splits it into three linear layers). Nor
    does the output projection, in any circuit pass: the hooks compute each head's output, and their sum is the
    model's own (the logits are the model's, within float32 rounding). Outside a circuit pass every projection runs."""
    model = models[form]
    task = random_task(model, seed=5)
    graph, rows, record, _, _ = _passes(model, task)
    generator = torch.Generator().manual_seed(2)
    patch = (torch.rand(graph.valid.shape, generator=generator) > 0.3).float() * graph.valid
    stream = ic.Interchange(graph, record.clone(), patch)
    replaced = {(side, layer) for layer in range(graph.n_layers) for side in "qkv" if stream.replaces(layer)}
    assert replaced, "no layer's heads read inputs of their own"
    ran, handles = _projection_runs(model)
    qkv = {(side, layer) for layer in range(graph.n_layers) for side in "qkv"}
    linear_o = form != "GPT2LMHeadModel"  # GPT-2's output projection is a Conv1D: it runs as before
    try:
        with torch.inference_mode():
            own = model(task.clean)
        assert ran == (qkv | {("o", layer) for layer in range(graph.n_layers)} if linear_o else qkv)
        ran.clear()
        with torch.inference_mode():
            hooked = adapter.circuit_pass(model, task.clean, ic.Null())
        assert ran == qkv  # the model's own pass through the circuit hooks: no output projection
        ran.clear()
        ic.patched_metric(model, task, rows, stream)
    finally:
        for handle in handles:
            handle.remove()
    assert ran == qkv - replaced
    assert_close(hooked, own, rtol=0, atol=1e-5)


def test_a_projection_declared_replaced_but_read_as_the_stream_is_refused(models) -> None:
    model = models["Qwen2ForCausalLM"]
    task = random_task(model, seed=5)
    graph, rows, record, _, _ = _passes(model, task)
    stream = ic.Interchange(graph, record.clone(), graph.valid.float(), share_identical=False)
    stream.read = lambda kind, layer, resid: None  # reads nothing, though it declared each head's own input
    with pytest.raises(RuntimeError, match="were to be replaced"):
        ic.patched_metric(model, task, rows, stream)


@pytest.mark.parametrize("form", FORMS)
def test_a_node_patchs_pass_takes_the_mlps_before_its_layer_from_the_clean_recording(models, form) -> None:
    """Activation patching: up to the patched node's layer the pass is the clean pass, so those MLPs (and a patched
    MLP, replaced whatever it reads) take recorded outputs and do not run; the metric is the one that computes them."""
    model = models[form]
    task = random_task(model, seed=6)
    graph, rows, record, _, _ = _passes(model, task)
    outputs, _ = ic.record(model, task, graph, rows, corrupted=False)
    last = graph.n_layers - 1
    nodes = ["L0H0", f"L{last}H1", "L0.mlp", f"L{last}.mlp"]
    for node in nodes:
        patched = torch.tensor([name == node for name in graph.writers])
        want = ic.patched_metric(model, task, rows, ic.NodePatch(graph, record, patched))
        counts, handles = _mlp_runs(model)
        try:
            got = ic.patched_metric(model, task, rows, ic.NodePatch(graph, record, patched, outputs))
        finally:
            for handle in handles:
                handle.remove()
        assert_close(got, want, rtol=0, atol=1e-5)
        layer = int(node[1 : node.index("H") if "H" in node else node.index(".")])
        skipped = set(range(layer)) | ({layer} if node.endswith(".mlp") else set())
        assert {mlp for mlp, runs in enumerate(counts) if not runs} == skipped, node
    assert not torch.allclose(want, ic.patched_metric(model, task, rows, ic.Null())), "the patch changed nothing"


def test_a_post_attention_norm_over_an_output_bias_keeps_every_mlp(tmp_path) -> None:
    """Gemma 3 given attention biases: ``N_lin(b_O; s)`` reaches every later input whatever the circuit keeps,
    so taking an idle MLP's counterfactual output would change the metric, and the evaluation computes them all."""
    config = architectures.tiny_config("Gemma3ForCausalLM")
    config.attention_bias = True
    hf_model = architectures.model_class("Gemma3ForCausalLM")(config).eval()
    architectures._randomise(hf_model, 5)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            layer.self_attn.o_proj.bias.mul_(20)  # a bias the norm's scale visibly moves
    hf_model.save_pretrained(tmp_path)
    architectures.tokenizer().save_pretrained(tmp_path)
    model = cl.load_model(str(tmp_path))
    assert cl.adapter.hidden_bias_path(model)
    task = random_task(model, seed=4)
    graph, rows, record, _, _ = _passes(model, task)
    generator = torch.Generator().manual_seed(1)
    moved = 0.0
    for _ in range(3):
        circuit = cl.Circuit(graph, torch.rand(len(graph.edges), generator=generator) < 0.15, "edge", 0.15)
        exact = ic.patched_metric(model, task, rows, ic.Interchange(graph, record.clone(), circuit.patch()))
        skipping = ic.Interchange(graph, record.clone(), circuit.patch(), skip_idle=True)
        moved = max(moved, float((ic.patched_metric(model, task, rows, skipping) - exact).abs().max()))
        assert_close(cl.evaluate_circuit(model, task, circuit).patched, exact, rtol=0, atol=1e-6)
    assert moved > 1e-4, "the bias's path changed nothing: this test shows no need"


def test_a_padded_prompt_reads_its_metric_at_its_last_real_position(models) -> None:
    model = models["gqa-biases"]
    task = random_task(model)
    logits = model(task.clean)
    p = len(task) - 1
    want = logits[p, task.last[p], task.answer[p]] - logits[p, task.last[p], task.foil[p]]
    got = ic.metric(task, logits, torch.arange(len(task)))[p]
    assert_close(got, want)


def test_the_identities_hold_on_smollm2(bundled_model) -> None:
    """Random-token induction-style prompts (a random half, then the same half again; corrupted: another half)."""
    generator = torch.Generator().manual_seed(0)
    half = torch.randint(100, 5000, (3, 5), generator=generator)
    other = torch.randint(100, 5000, (3, 5), generator=generator)
    clean, corrupted = torch.cat([half, half], 1), torch.cat([other, half], 1)
    task = cl.Task(
        "induction", clean[:, :-1], corrupted[:, :-1], half[:, -1], other[:, -1], cl.Task.full_length(clean[:, :-1])
    )
    graph, rows, record, clean_m, corrupted_m = _passes(bundled_model, task)
    kept = ic.Interchange(
        graph, record.clone(), torch.zeros(graph.valid.shape), skip_unpatched=False, share_identical=False
    )
    assert_close(ic.patched_metric(bundled_model, task, rows, kept), clean_m, rtol=0, atol=1e-4)
    none = ic.Interchange(graph, record.clone(), graph.valid.float())
    assert_close(ic.patched_metric(bundled_model, task, rows, none), corrupted_m, rtol=0, atol=1e-4)
    chosen = [name for name in graph.components if name.endswith(".mlp") or name.endswith("H0")]
    circuit = cl.Circuit.from_nodes(graph, chosen)
    through_edges = ic.patched_metric(bundled_model, task, rows, ic.Interchange(graph, record.clone(), circuit.patch()))
    left_out = torch.tensor([name in graph.components and name not in chosen for name in graph.writers])
    assert_close(
        through_edges,
        ic.patched_metric(bundled_model, task, rows, ic.NodePatch(graph, record, left_out)),
        rtol=0,
        atol=1e-4,
    )
    scores = cl.circuit_scores(bundled_model, task, method="eap")
    assert len(scores.edges) == len(graph.edges) and bool(torch.isfinite(scores.edge_scores).all())


@pytest.mark.parametrize("form", [*FORMS, "Gemma2ForCausalLM"])
def test_the_unembedding_of_the_last_positions_alone_gives_the_full_passes_metric(models, form, tmp_path) -> None:
    """`metric_pass` unembeds each prompt's last real position alone: for the logit difference only the answer's
    and the foil's columns (the pass stops at the unembedding's input; Gemma 2's logit soft-cap applied), for the
    probability ``[batch 1 d_vocab]``; each reads the metric the full logits give. `embedding_pass` (stopped before
    the first block) records the full pass's embeddings."""
    from contribution_lens.adapter import circuit_pass, embedding_pass, logit_softcap

    if form not in models:
        models[form] = cl.load_model(str(architectures.build(form, tmp_path / form)))
    model = models[form]
    assert (logit_softcap(model) is not None) == (form == "Gemma2ForCausalLM")
    task = random_task(model)
    rows = torch.arange(len(task))
    graph = cl.circuit_graph(model)
    for metric, unembedded in (("logit_diff", []), ("probability", [(len(task), 1, int(model.cfg.d_vocab))])):
        read = task.with_metric(metric)
        shapes: list[tuple[int, ...]] = []
        with model.hooks(fwd_hooks=[("unembed.hook_out", lambda x, hook, seen=shapes: seen.append(tuple(x.shape)))]):
            got = ic.metric_pass(model, read, rows, ic.Null(), corrupted=True)
        assert shapes == unembedded, metric
        with torch.inference_mode():
            want = read.metric_values(circuit_pass(model, read.corrupted, ic.Null()))
        assert_close(got, want, rtol=1e-5, atol=1e-6)
    full, embeddings = ic.Record(graph), ic.Record(graph)
    with torch.inference_mode():
        circuit_pass(model, task.clean, full)
        embedding_pass(model, task.clean, embeddings)
    n = graph.n_embeddings
    assert full.outputs is not None and embeddings.outputs is not None
    assert torch.equal(embeddings.outputs[:n], full.outputs[:n])
    assert embeddings.written == n and full.written == len(graph.writers), "a block ran"


def test_a_recording_in_an_earlier_batchs_memory_is_the_fresh_recording(models) -> None:
    """The memory is the earlier tensor's (no fresh allocation) and every writer is written over."""
    model = models["gqa-biases"]
    task = random_task(model, n=3, seed=5)
    graph = cl.circuit_graph(model)
    earlier, _ = ic.record(model, task, graph, torch.arange(3), corrupted=False)
    with torch.inference_mode():  # recorded in it
        earlier.fill_(float("nan"))  # what a writer left unwritten would keep
    fresh, _ = ic.record(model, task, graph, torch.arange(2), corrupted=True)
    again, _ = ic.record(model, task, graph, torch.arange(2), corrupted=True, storage=earlier)
    assert again.data_ptr() == earlier.data_ptr()
    assert torch.equal(again, fresh)


def test_a_recording_that_misses_a_writer_is_refused(models, monkeypatch) -> None:
    model = models["mha"]
    task = random_task(model, n=2, seed=6)
    graph = cl.circuit_graph(model)
    write = ic.Record.write
    monkeypatch.setattr(
        ic.Record, "write", lambda self, kind, *rest: None if kind == "mlp" else write(self, kind, *rest)
    )
    with pytest.raises(RuntimeError, match=r"wrote \d+ of the graph's \d+ writers"):
        ic.record(model, task, graph, torch.arange(2), corrupted=True)


def test_the_curves_sizes_sharing_memory_are_each_sizes_own_patched_pass(models, monkeypatch) -> None:
    """The curve's passes share their sums' and gathers' memory, within a batch and from batch to batch: each
    size still reads only its own circuit.

    Small sizes gather a few writers' differences in blocks of positions, large ones read the block
    whole; a gather left stale by an earlier size or block, a sum buffer read before it is filled,
    or a batch's recording read in the memory of the batch before, changes a size's metric.
    """
    from contribution_lens.circuits import evaluation

    model = models["Qwen2ForCausalLM"]
    task = random_task(model, n=5, seed=7)
    scores = cl.circuit_scores(model, task, method="eap")
    graph = scores.graph
    per_prompt = task.clean.shape[1] * len(graph.writers) * int(model.cfg.d_model) * 4 * 2
    sums: list[tuple[int, int]] = []
    original = ic.Interchange._sum

    def counted(self, rows, weights, out):
        sums.append((len(rows), weights.shape[0]))
        return original(self, rows, weights, out)

    with monkeypatch.context() as patched:
        patched.setattr(ic.Interchange, "_sum", counted)
        # Three rows' differences at three positions a block: several blocks a gather, the last one short.
        patched.setattr(ic, "GATHER_BYTES", 3 * 3 * int(model.cfg.d_model) * 4)
        curve = cl.circuit_curve(model, task, scores, memory=2 * per_prompt)  # batches of 2, 2 and 1
    gathered = {rows for rows, upstream in sums if rows < upstream}
    assert len(gathered) > 1 and any(rows == upstream for rows, upstream in sums)
    for s, selection in enumerate(evaluation.SELECTIONS):
        for k, fraction in enumerate(evaluation.FRACTIONS):
            circuit = scores.circuit(fraction, "edge", absolute=selection == "absolute", prune=True)
            alone = cl.evaluate_circuit(model, task, circuit)  # one batch, fresh memory
            assert_close(curve.patched[s, k], alone.patched, rtol=1e-5, atol=1e-5)


def test_a_sum_over_gathered_rows_is_the_product_over_every_row(monkeypatch) -> None:
    """``_sum`` over a subset of rows, gathered in blocks of positions (the last one short), equals the dense product
    with zero weights elsewhere, in float64."""
    generator = torch.Generator().manual_seed(0)
    delta = torch.randn(7, 2, 5, 4, generator=generator, dtype=torch.float64)
    weights = torch.randn(7, 3, generator=generator, dtype=torch.float64)
    rows = torch.tensor([1, 4, 5])
    weights[[0, 2, 3, 6]] = 0
    stream = ic.Interchange(cl.circuits.graph.Graph(1, 1, 1, False), delta, weights)
    expected = torch.einsum("ui,ubpd->bpid", weights, delta)
    for gather_bytes in (1, 3 * 3 * 4 * 8, 10**9):  # one position a block, three (of ten), all at once
        monkeypatch.setattr(ic, "GATHER_BYTES", gather_bytes)
        out = stream._sum(rows, weights, torch.empty(2, 5, 3, 4, dtype=torch.float64))
        assert_close(out, expected, rtol=1e-12, atol=1e-12)
    every = stream._sum(torch.arange(7), weights, torch.empty(2, 5, 3, 4, dtype=torch.float64))
    assert_close(every, expected, rtol=1e-12, atol=1e-12)


def test_a_bridge_without_an_unembedding_hook_reads_the_two_columns_off_the_full_logits(models, monkeypatch) -> None:
    """Where the pass cannot stop at the unembedding's input, the logit difference reads the answer's and the foil's
    columns of the full logits at ``last``: the same metric."""
    model = models["gqa-biases"]
    task = random_task(model)
    rows = torch.arange(len(task))
    want = ic.metric_pass(model, task, rows, ic.Null())
    names = type(model).hook_dict
    hidden = property(lambda self: {k: v for k, v in names.fget(self).items() if k != "unembed.hook_in"})
    monkeypatch.setattr(type(model), "hook_dict", hidden)
    facts = adapter.anatomy_of(model)  # the hook names the adapter read once, before
    monkeypatch.setattr(facts, "hook_names", facts.hook_names - {"unembed.hook_in"})
    assert "unembed.hook_in" not in model.hook_dict
    shapes: list[tuple[int, ...]] = []
    with model.hooks(fwd_hooks=[("unembed.hook_out", lambda x, hook, seen=shapes: seen.append(tuple(x.shape)))]):
        got = ic.metric_pass(model, task, rows, ic.Null())
    assert shapes == [(len(task), task.clean.shape[1], int(model.cfg.d_vocab))]  # the full logits ran
    assert_close(got, want, rtol=1e-5, atol=1e-6)
