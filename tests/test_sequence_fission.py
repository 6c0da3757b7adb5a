"""Fission along the sequence: attention split along its queries.

The query and the key positions of attention scores come from one tensor's
sequence dim, so ops like ``q @ k.T`` have two axes in one D component (Note
[ambiguous ops] in analysis/dgraph.py). A region takes the axis its neighbours
agree on; the F-Tree cuts each block between the projections of k and v and
the attention (`ftree._segments`). Every region here runs against eager
PyTorch (loss, gradients) with the measured peak equal to the simulated one.
"""
from __future__ import annotations

import pytest
import torch

from magis_nb import zoo
from magis_nb.analysis import DGraph, apply_fission, build_ftree, check
from magis_nb.analysis.ftrans import FTrans
from magis_nb.program import trace
from magis_nb.verify import Reference
from magis_nb.zoo.gpt import CausalLM

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

BMM = "aten.bmm.default"


def _gpt(seq=64, batch=1):
    torch.manual_seed(0)
    c = dict(batch=batch, seq=seq, vocab=96, d=32, heads=2, layers=2, ffn=64, max_pos=seq,
             pos="learned", mlp="gelu", window=None, qkv_bias=False)
    m = CausalLM(c, p=0.0)
    ids = torch.randint(0, 96, (batch, seq))
    return m, (ids, ids.clone())


def exact(split, ref):
    """Run a split program against eager: allclose, and its measured peak the
    simulated one. Returns the check."""
    chk = ref.check(split.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == split.simulate().peak
    return chk


def _seq_comp(dg):
    return next(c for c in dg.components if ("x0", 1) in c.inputs)


def test_scores_have_two_axes_in_the_sequence_component():
    m, inputs = _gpt()
    prog = trace(m, inputs)
    dg = DGraph(prog.graph)
    comp = _seq_comp(dg)
    bmms = [v for v in comp.choices if prog.graph.nodes[v].target == BMM]
    assert bmms, "the attention matmuls are ambiguous along the sequence"
    assert all(len(comp.choices[v]) == 2 for v in bmms)
    assert set(comp.ops) >= set(comp.axis_of) | set(comp.choices)


def test_attention_regions_split_along_the_queries_are_exact():
    """The F-Tree offers regions holding a block's attention (scores, softmax,
    their matmuls), split along the queries with k and v read whole; each
    runs allclose to eager with the measured peak equal to the simulated one."""
    m, inputs = _gpt()
    prog = trace(m, inputs)
    g = prog.graph
    dg = DGraph(g)
    comp = _seq_comp(dg)
    ref = Reference(m, inputs, None, "train", 0)
    runs = 0
    for c in build_ftree(dg, prog.hotspots()):
        amb = [v for v in c.ops if v in dg.components[c.comp].choices and g.nodes[v].target == BMM]
        if c.comp != comp.id or not amb:
            continue
        axes = dg.region_axes(c.ops, c.comp)
        # each scores matmul is split along its queries: its first input (q) is sliced
        for v in amb:
            assert 0 in dict(dg.dims[v].axes[axes[v]].inputs)
        for n in (2, 8):
            split = prog.with_graph(apply_fission(dg, [FTrans(c.ops, c.comp, n)]))
            exact(split, ref)
            runs += 1
    assert runs >= 2


def test_a_region_with_k_and_the_scores_is_refused():
    """With k's projection inside, the scores op would need k whole and q split:
    no axis fits, and check() says so."""
    m, inputs = _gpt()
    prog = trace(m, inputs)
    g = prog.graph
    dg = DGraph(g)
    comp = _seq_comp(dg)
    scores = min(v for v in comp.choices if g.nodes[v].target == BMM)
    # the scores matmul and the ops that make both of its inputs, back to the norm
    ops, stack = {scores}, [scores]
    while stack:
        v = stack.pop()
        for p in g.preds(v):
            if p in comp.ops and p not in ops and g.nodes[p].target != "aten.native_layer_norm.default":
                ops.add(p)
                stack.append(p)
    why = check(dg, ops, comp.id, 2)
    assert why is not None and ("no axis" in why or "would need all" in why), why


@pytest.mark.parametrize("name", ["llama"])
def test_causal_sdpa_regions_split_along_the_queries(name):
    """The Llama-style model's causal SDPA (forward and backward) in regions of
    the F-Tree split along the sequence: each part with its own mask rows."""
    case = zoo.build(name)
    ids = case.inputs[0][:1].clone()     # batch 1: the sequence is one dim through the linears
    inputs = (ids, ids.clone())
    prog = trace(case.model, inputs)
    g = prog.graph
    dg = DGraph(g)
    comp = _seq_comp(dg)
    ref = Reference(case.model, inputs, None, "train", 0)
    sdpa = {n.id for n in g.ops if "scaled_dot_product" in n.target}
    runs = 0
    for c in build_ftree(dg, prog.hotspots()):
        if c.comp != comp.id or not c.ops & sdpa:
            continue
        split = prog.with_graph(apply_fission(dg, [FTrans(c.ops, c.comp, 4)]))
        assert any(n.target == "magis_nb.causal_mask.default" for n in split.graph.ops)
        exact(split, ref)
        runs += 1
    assert runs >= 1


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_sequence_runs_through_the_linears_at_batch_2(name):
    """[B,S,H] -> [B*S,H] before every linear: the sequence lives on in the
    merged dim as blocks of S (Note [blocked dims]). Regions of the sequence
    component that hold linears (their matmuls split along blocked rows, their
    weight gradients summed) run allclose with the measured peak equal to the
    simulated one."""
    if name == "gpt":
        m, inputs = _gpt(batch=2)
    else:
        case = zoo.build(name)
        m, inputs = case.model, case.inputs
    assert inputs[0].shape[0] == 2
    prog = trace(m, inputs)
    g = prog.graph
    dg = DGraph(g)
    comp = _seq_comp(dg)
    mms = {n.id for n in g.ops if n.target == "aten.mm.default"}
    blocked = [v for v in mms if v in comp.ops and any(isinstance(d, tuple)
               for _, d in dg.dims[v].axes[comp.axis_of[v]].inputs)]
    assert len(blocked) >= len(mms) // 2, "the sequence reaches the linears"
    ref = Reference(m, inputs, None, "train", 0)
    runs = 0
    for c in build_ftree(dg, prog.hotspots()):
        if c.comp != comp.id or not c.ops & set(blocked):
            continue
        split = prog.with_graph(apply_fission(dg, [FTrans(c.ops, c.comp, 4)]))
        exact(split, ref)
        runs += 1
    assert runs >= 1


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_backward_regions_recompute_their_forward_in_parts(name):
    """Note [recomputed in parts]: a backward segment that remakes its slices of
    the forward it reads. Its recomputed ops are forward ops only, none draws
    random numbers; split, it runs allclose with the measured peak equal to the
    simulated one, and below the unsplit peak (the saved tensors die in the
    forward)."""
    from magis_nb.analysis.ftree import forward_ops
    from magis_nb.bench.longctx import case_at

    case = case_at(name, 128, 1)   # long enough that the saved forward is at the peak
    prog = trace(case.model, case.inputs)
    g = prog.graph
    dg = DGraph(g)
    fwd = forward_ops(g)
    ref = Reference(case.model, case.inputs, None, "train", 0)
    base = prog.simulate().peak
    rec = [c for c in build_ftree(dg, prog.hotspots()) if c.recompute and not c.ops & fwd]
    assert rec, "a backward segment recomputes its forward"
    best = base
    for c in rec:
        assert c.recompute <= fwd
        assert not any(g.nodes[v].rng for v in c.recompute)
        split = prog.with_graph(apply_fission(dg, [c.ftrans(4)]))
        assert any("_r_p" in n.name for n in split.graph.ops)
        chk = exact(split, ref)
        best = min(best, chk.measured_peak)
    assert best < base


def _every_block(name, seq, n):
    """The model at ``seq`` tokens and the plan `proposals.enable_blocks` makes:
    every region of the sequence component that recomputes, together."""
    from magis_nb.bench.longctx import case_at

    case = case_at(name, seq, 1)
    return (case, *_every_block_of(case.model, case.inputs, n))


def _every_block_of(model, inputs, n):
    from magis_nb.analysis.ftree import overlaps

    prog = trace(model, inputs)
    dg = DGraph(prog.graph)
    cands = build_ftree(dg, prog.hotspots())
    comp = _seq_comp(dg).id
    plan: dict[int, int] = {}
    for c in sorted((c for c in cands if c.recompute and c.comp == comp), key=lambda c: -c.score):
        trial = {**plan, c.id: min(n, c.max_n)}
        if not overlaps(cands, trial, c.id):
            plan = trial
    return prog, dg, cands, plan


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_every_block_recomputing_at_once_is_exact(name):
    """Note [recomputing what another region splits]: each block's attention
    forward split along the queries (making its rows of the causal mask) and
    each block's backward remaking its slices of the forward, all enabled
    together. Allclose to eager, measured peak = simulated, below the unsplit
    peak; the forward's regions recompute only ops computed from the data."""
    from magis_nb.analysis.ftree import forward_ops

    case, prog, dg, cands, plan = _every_block(name, 128, 4)
    g = prog.graph
    fwd = forward_ops(g)
    fwd_regions = [c for c in plan if cands[c].ops & fwd]
    bwd_regions = [c for c in plan if not cands[c].ops & fwd]
    assert fwd_regions and len(bwd_regions) >= 3
    weights = {n.id for n in g.nodes if n.kind == "input" and n.category == "weight"}
    for c in fwd_regions:      # the mask's ops: nothing in them reads a weight
        assert not any(r.node in weights for v in cands[c].recompute for r in g.nodes[v].refs())
    split = prog.with_graph(apply_fission(dg, [cands[c].ftrans(k) for c, k in plan.items()]))
    ref = Reference(case.model, case.inputs, None, "train", 0)
    chk = exact(split, ref)
    assert chk.measured_peak < prog.simulate().peak


def test_hugging_face_llama_every_block_in_parts_is_exact():
    """Hugging Face's `LlamaForCausalLM` as users build it (SDPA, grouped-query
    heads passed to the kernel as they are, the DynamicCache appending k and v
    to empty tensors even in training): each block's backward remakes its
    slices of the forward in parts, k and v whole before them, like the zoo's
    Llama. Before the cache's cat and its backward's slice had an axis along
    the sequence, k and v left the sequence's component, no region recomputed,
    and at 2048 tokens the search stopped at 40 MiB where it now meets eager's
    peak at 256 (28.3 MiB, x1.44 measured)."""
    transformers = pytest.importorskip("transformers")
    from magis_nb.analysis.ftree import forward_ops

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (1, 128))
    inputs = dict(input_ids=ids, labels=ids.clone())
    prog, dg, cands, plan = _every_block_of(model, inputs, 4)
    fwd = forward_ops(prog.graph)
    back = [c for c in plan if not cands[c].ops & fwd]
    assert len(back) >= 2 and all(cands[c].recompute for c in back)
    assert any(cands[c].prologue for c in back)     # k and v remade whole
    split = prog.with_graph(apply_fission(dg, [cands[c].ftrans(k) for c, k in plan.items()]))
    chk = exact(split, Reference(model, inputs, None, "train", 0))
    assert chk.measured_peak < prog.simulate().peak


def test_every_block_at_once_keeps_no_whole_scores():
    """Zoo GPT (unfused causal attention): with every block split, no tensor of
    [T, T] scores, probabilities or mask exists whole in the program, forward or
    backward; the unsplit originals of the mask's ops are dropped."""
    seq = 256                   # not the width (128): only scores are [seq, seq]
    _, prog, dg, cands, plan = _every_block("gpt", seq, 4)
    split = apply_fission(dg, [cands[c].ftrans(k) for c, k in plan.items()])
    whole = [n.name for n in split.ops for t in n.outputs
             if t is not None and t.alias is None and list(t.shape[-2:]) == [seq, seq]]
    assert not whole, whole
    # every view of a part is valid as traced: no copy before one (Note [views of parts])
    assert not [n.name for n in split.ops if "_vc" in n.name]
    before = [n.name for n in prog.graph.ops for t in n.outputs
              if t is not None and t.alias is None and list(t.shape[-2:]) == [seq, seq]]
    assert len(before) >= 4 * 4     # scores, mask, probabilities, their gradient per block



def test_the_backward_of_silu_goes_with_the_backward():
    """SwiGLU's backward computes SiLU's derivative from the saved gate output
    alone (sigmoid, 1 - sigmoid, ...). Those ops wait for their reader in the
    backward (`ftree._segments`): each block's backward region holds them with
    the gradient they scale, and no region holds them with a forward attention
    (where they made a [T, ffn] tensor whole for the backward). The every-block
    plan then stays exact and keeps no [T, ffn] activation whole."""
    from magis_nb.analysis.ftree import forward_ops

    case, prog, dg, cands, plan = _every_block("llama", 128, 4)
    g = prog.graph
    fwd = forward_ops(g)
    backward = min(n.id for n in g.nodes
                   if n.kind == "op" and n.category == "gradient" and g.preds(n.id))
    sig = {n.id for n in g.ops if n.target == "aten.sigmoid.default" and n.id > backward}
    assert len(sig) == 4                      # one per block
    holding = [cands[c] for c in plan if cands[c].ops & sig]
    assert len(holding) == 4
    for c in holding:
        assert not c.ops & fwd
        assert any(g.nodes[v].category == "gradient" for v in c.ops)
    split = prog.with_graph(apply_fission(dg, [cands[c].ftrans(k) for c, k in plan.items()]))
    ffn = case.model.blocks[0].mlp.gate.out_features
    whole = [n.name for n in split.graph.ops for t in n.outputs if t is not None
             and t.alias is None and n.category == "activation" and tuple(t.shape[-2:]) == (128, ffn)]
    assert not whole, whole


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_block_backward_remakes_k_and_v_whole(name):
    """Note [recomputed whole before the parts] (analysis/prologue.py): each
    block's backward region recomputes its k and v projections whole before its
    query parts (they read every key), so no block keeps k and v from the
    forward. Exact, measured = simulated; at the backward's first op the
    activations live are exactly every block's k and v fewer than in the same
    plan without prologues."""
    import dataclasses

    case, prog, dg, cands, plan = _every_block(name, 512, 8)   # below that the loss head is the peak
    g = prog.graph
    weights = {n.id for n in g.nodes if n.kind == "input" and n.category == "weight"}
    with_pro = [c for c in plan if cands[c].prologue]
    assert len(with_pro) == 4                  # one per block
    for c in with_pro:
        pro = cands[c].prologue
        assert not pro & cands[c].ops
        # the k and v projections: matmuls of the block's normed input by a weight
        mms = [v for v in pro if g.nodes[v].target == "aten.mm.default"
               and any(g.storage_of(r).node in weights for r in g.nodes[v].refs())]
        assert len(mms) == 2, [g.nodes[v].name for v in pro]
    ref = Reference(case.model, case.inputs, None, "train", 0)
    split = prog.with_graph(apply_fission(dg, [cands[c].ftrans(k) for c, k in plan.items()]))
    assert sum("_rw" in n.name for n in split.graph.ops) >= 4 * 2
    exact(split, ref)
    kept = prog.with_graph(apply_fission(dg, [dataclasses.replace(
        cands[c].ftrans(k), prologue=frozenset()) for c, k in plan.items()]))
    assert not any("_rw" in n.name for n in kept.graph.ops)
    exact(kept, ref)

    def at_backward(p):     # activation bytes live at the backward's first op
        tl = p.simulate()
        first = next(i for i, v in enumerate(p.program_order())
                     if p.graph.nodes[p.op_ids[v]].category == "gradient")
        return tl.by_category["activation"][first]
    kv = 2 * 512 * 128 * 4      # k and v (Llama's repeated to every head), d=128, fp32
    assert at_backward(kept) - at_backward(split) == 4 * kv


def test_a_causal_query_part_reads_only_the_keys_it_sees():
    """Note [the keys a causal part sees] (analysis/causal.py): query part k of
    n of a causal self-attention runs against the first (k + 1) * L/n keys and
    values, forward and backward, and adds its key and value gradients into
    those rows of the sums. Exact, measured = simulated, and every region of
    the plan is still one loop in the generated code."""
    from magis_nb.ir.graph import Region
    from magis_nb.runtime.codegen import generate

    seq, n = 128, 4
    case, prog, dg, cands, plan = _every_block("llama", seq, n)
    split = prog.with_graph(apply_fission(dg, [cands[c].ftrans(k) for c, k in plan.items()]))
    g = split.graph
    sdpa = [nd for nd in g.ops if "scaled_dot_product" in nd.target
            and isinstance(nd.region, Region)]
    assert len(sdpa) >= 4 * n * 3       # every block: forward, recomputed forward, backward
    for nd in sdpa:
        key = g.tensor(nd.args[2] if "backward" in nd.target else nd.args[1])
        assert key.shape[2] == (nd.region.part + 1) * seq // n, nd.name
        if "backward" in nd.target:
            assert nd.outputs[1].shape[2] == nd.outputs[2].shape[2] == key.shape[2]
    exact(split, Reference(case.model, case.inputs, None, "train", 0))
    src = generate(g, split.to_node_order(split.program_order()))
    assert src.count("for _k in") == len(plan)
    assert "(_k + 1) * 32" in src
