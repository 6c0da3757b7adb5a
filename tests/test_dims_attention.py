"""Dimension rules of the fused scaled_dot_product_attention ops (dims_attention.py).

Each rule runs in parts with real tensors as tests/test_dims.py checks rules
(inputs narrowed, outputs compared part by part or merged), forward and
backward, causal or not, with and without a mask, grouped-query heads, in the
memory layouts a captured graph hands the CPU kernel. Then regions split
through the ops in a captured training step (and an `optimize`d inference
plan) run allclose to eager.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_dims import dims_call, check_axis, dims_of, make, summary

import magis_nb
from magis_nb.analysis import DGraph, apply_fission, check
from magis_nb.analysis.dims import Axis, OpDims
from magis_nb.analysis.ftrans import FTrans
from magis_nb.program import trace
from magis_nb.verify import check_step

aten = torch.ops.aten
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


# -- the rules in parts, with real tensors -----------------------------------------

def _t(*shape, layout="bhle"):
    """float64 [B,H,L,E]; "blhe" stores it as a captured graph does (a transposed
    [B,L,H,E] projection), so every narrowed part is non-contiguous."""
    x = torch.randn(*shape, dtype=torch.float64)
    return x.transpose(1, 2).contiguous().transpose(1, 2) if layout == "blhe" else x


def _run_parts(node, ts, ns=(2, 4)) -> dict[str, list[int]]:
    """Every axis of the rule, in n parts for each n that divides it: {name: [n...]}."""
    od = dims_of(node, ts)
    full = dims_call(node, ts)
    done = {}
    for a, axis in enumerate(od.axes):
        for n in ns:
            if axis.size % n == 0:
                check_axis(node, ts, full, od, a, n)
                done.setdefault(axis.name, []).append(n)
    return done


MASKS = [None, (8, 6), (1, 6), (4, 1, 8, 6), (1, 4, 8, 6), (4, 4, 8, 6)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("layout", ["bhle", "blhe"])
def test_forward_and_backward_in_parts(causal, mask, layout):
    q, k, v = (_t(4, 4, s, 8, layout=layout) for s in (8, 6, 6))
    kw = {} if mask is None else {"attn_mask": torch.randn(*mask, dtype=torch.float64)}
    # causal with a mask of its own: no query axis (the kernel refuses both anyway)
    axes = {"batch": [2, 4], "heads": [2, 4]} | ({} if causal and mask else {"query": [2, 4]})
    node, ts = make(FWD, q, k, v, 0.0, causal, **kw)
    assert _run_parts(node, ts) == axes
    out, lse = FWD(q, k, v, 0.0, causal, **kw)
    # lse as the kernel made it ([B,L,H] in memory) and contiguous, as a region
    # that joins its parts into a fresh buffer hands it on
    for lse_in in (lse, lse.contiguous()):
        go = _t(4, 4, 8, 8, layout=layout)
        node, ts = make(BWD, go, q, k, v, out, lse_in, 0.0, causal, **kw)
        assert _run_parts(node, ts) == axes
    od = dims_of(node, ts)
    # on the query axis the key/value gradients are sums over the parts
    assert [(a.outputs, a.combine) for a in od.axes if a.name == "query"] == (
        [] if causal and mask else [(((0, 2),), "sum")])


def test_mask_rides_along_where_it_is_not_broadcast():
    q, k, v = _t(4, 4, 8, 8), _t(4, 4, 6, 8), _t(4, 4, 6, 8)
    node, ts = make(FWD, q, k, v, attn_mask=torch.randn(4, 1, 8, 6, dtype=torch.float64))
    assert summary(dims_of(node, ts)) == [
        ("batch", 4, ((0, 0), (1, 0), (2, 0), (3, 0)), ((0, 0), (1, 0)), None),
        ("heads", 4, ((0, 1), (1, 1), (2, 1)), ((0, 1), (1, 1)), None),   # mask: whole
        ("query", 8, ((0, 2), (3, 2)), ((0, 2), (1, 2)), None)]
    node, ts = make(FWD, q, k, v, attn_mask=torch.randn(1, 6, dtype=torch.float64))
    assert [a.inputs for a in dims_of(node, ts).axes][2] == ((0, 2),)


def test_grouped_query_heads_split_in_aligned_chunks():
    """H=4 query heads over Hkv=2 key/value heads: head h reads kv head h//2. The
    heads axis has size Hkv and cuts both head dims into n chunks (n | Hkv)."""
    q, k, v = _t(4, 4, 8, 8, layout="blhe"), _t(4, 2, 6, 8), _t(4, 2, 6, 8)
    node, ts = make(FWD, q, k, v)
    od = dims_of(node, ts)
    assert summary(od)[1] == ("heads", 2, ((0, 1), (1, 1), (2, 1)), ((0, 1), (1, 1)), None)
    assert _run_parts(node, ts) == {"batch": [2, 4], "heads": [2], "query": [2, 4]}
    out, lse = FWD(q, k, v)
    node, ts = make(BWD, _t(4, 4, 8, 8), q, k, v, out, lse, 0.0, False)
    assert _run_parts(node, ts) == {"batch": [2, 4], "heads": [2], "query": [2, 4]}


def test_causal_query_split_needs_the_part_mask():
    """Why a causal part runs with its own mask rows: the kernel aligns the causal
    diagonal with row 0 of each part, so with is_causal kept the second half of
    the queries would lose keys. With the mask (the rule's rewrite) every part
    equals its rows of the whole, also for fewer queries than keys."""
    q, k, v = _t(2, 2, 8, 4), _t(2, 2, 8, 4), _t(2, 2, 8, 4)
    node, ts = make(FWD, q, k, v, 0.0, True)
    od = dims_of(node, ts)
    assert [a.name for a in od.axes] == ["batch", "heads", "query"]
    wrong = OpDims([Axis(8, ((0, 2),), ((0, 2), (1, 2)), None, "query")])
    with pytest.raises(AssertionError):
        check_axis(node, ts, dims_call(node, ts), wrong, 0, 2)
    for n in (2, 4, 8):
        check_axis(node, ts, dims_call(node, ts), od, 2, n)
    q = _t(2, 2, 4, 4)      # 4 queries over 8 keys: top-left aligned, as the kernel does
    node, ts = make(FWD, q, k, v, 0.0, True)
    check_axis(node, ts, dims_call(node, ts), dims_of(node, ts), 2, 2)


def test_causal_mask_op():
    from magis_nb.analysis.causal import causal_mask
    for off in range(8):        # up to past the last key: rows that see every key
        m = causal_mask(torch.zeros(3, 2), off, 6)
        assert m.shape == (3, 6)
        assert (m == 0).tolist() == [[j <= off + i for j in range(6)] for i in range(3)]
        assert ((m == 0) | (m == float("-inf"))).all()
    assert causal_mask(torch.zeros(3, 2, device="meta"), 2, 6).shape == (3, 6)


def _meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_barriers():
    # dropout draws random numbers: no rule (the CPU kernel refuses dropout > 0
    # anyway; its meta function, which capture uses, does not)
    q, k, v = _meta(2, 2, 8, 4), _meta(2, 2, 8, 4), _meta(2, 2, 8, 4)
    node, ts = make(FWD, q, k, v, 0.5)
    assert dims_of(node, ts) is None
    out, lse = FWD(q, k, v)
    node, ts = make(BWD, _meta(2, 2, 8, 4), q, k, v, out, lse, 0.5, False)
    assert dims_of(node, ts) is None
    # the key sequence is a softmax reduction: never an axis
    node, ts = make(FWD, q, k, v)
    assert all((1, 2) not in a.inputs for a in dims_of(node, ts).axes)


def test_cuda_kernels_batch_and_heads_only():
    """Not runnable here: the axes are checked against the meta shapes only."""
    q, k, v, go = _meta(2, 4, 8, 16), _meta(2, 4, 6, 16), _meta(2, 4, 6, 16), _meta(2, 4, 8, 16)
    flash = aten._scaled_dot_product_flash_attention.default
    node, ts = make(flash, q, k, v)
    assert summary(dims_of(node, ts)) == [
        ("batch", 2, ((0, 0), (1, 0), (2, 0)), ((0, 0), (1, 0)), None),
        ("heads", 4, ((0, 1), (1, 1), (2, 1)), ((0, 1), (1, 1)), None)]
    node, ts = make(flash, q, _meta(2, 2, 6, 16), _meta(2, 2, 6, 16))
    assert [a.name for a in dims_of(node, ts).axes] == ["batch"]     # GQA: heads left out
    o = flash(q, k, v)
    node, ts = make(aten._scaled_dot_product_flash_attention_backward.default, go, q, k, v,
                    o[0], o[1], None, None, 8, 6, 0.0, False, o[6], o[7])
    od = dims_of(node, ts)
    assert [(a.name, a.outputs) for a in od.axes] == [
        ("batch", ((0, 0), (1, 0), (2, 0))), ("heads", ((0, 1), (1, 1), (2, 1)))]
    assert all((6, 0) not in a.inputs for a in od.axes)           # philox seed: whole

    eff = aten._scaled_dot_product_efficient_attention.default
    effb = aten._scaled_dot_product_efficient_attention_backward.default
    bias = _meta(2, 4, 8, 6)
    node, ts = make(eff, q, k, v, bias, True)
    assert [(a.name, a.inputs[-1]) for a in dims_of(node, ts).axes] == [
        ("batch", (3, 0)), ("heads", (3, 1))]
    o = eff(q, k, v, bias, True)                                   # lse padded to 32 rows
    node, ts = make(effb, go, q, k, v, bias, o[0], o[1], o[2], o[3], 0.0, [True] * 4)
    assert [a.outputs for a in dims_of(node, ts).axes] == [
        ((0, 0), (1, 0), (2, 0), (3, 0)), ((0, 1), (1, 1), (2, 1), (3, 1))]
    # a bias broadcast over the batch with its gradient asked for: batch left out
    node, ts = make(effb, go, q, k, v, _meta(1, 4, 8, 6), o[0], o[1], o[2], o[3], 0.0,
                    [True] * 4)
    assert [a.name for a in dims_of(node, ts).axes] == ["heads"]
    node, ts = make(eff, q, k, v, None, True, 0.1)
    assert dims_of(node, ts) is None


# -- regions through SDPA in captured programs --------------------------------------

class Attention(nn.Module):
    def __init__(self, d=32, heads=4, kv_heads=4, causal=False, mask=False):
        super().__init__()
        self.h, self.hkv, self.e = heads, kv_heads, d // heads
        self.causal, self.mask = causal, mask
        self.ln = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * self.e)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        B, L, D = x.shape
        h = self.ln(x)
        q = self.q(h).view(B, L, self.h, self.e).transpose(1, 2)
        k, v = self.kv(h).view(B, L, 2, self.hkv, self.e).permute(2, 0, 3, 1, 4)
        m = torch.ones(L, L, dtype=torch.bool).tril() if self.mask else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=self.causal,
                                           enable_gqa=self.hkv != self.h)
        return x + self.o(y.transpose(1, 2).reshape(B, L, D))


def _model(**kw):
    torch.manual_seed(0)
    return nn.Sequential(Attention(**kw), Attention(**kw))


def _mse(y, t):
    return F.mse_loss(y, t)


VARIANTS = {"plain": {}, "causal": {"causal": True}, "mask": {"mask": True},
            "gqa": {"kv_heads": 2}}


def _grow(dg, v, comp, n, size=6):
    """A valid region around op v in component comp: v, then neighbours in the
    component while the F-Trans stays valid, up to ``size`` ops."""
    g, c = dg.graph, dg.components[comp]
    ops = {v}
    grew = True
    while grew and len(ops) < size:
        grew = False
        for w in sorted({w for u in ops for w in g.preds(u) + g.succs(u)} - ops):
            if w in c.axis_of and check(dg, ops | {w}, comp, n) is None:
                ops.add(w)
                grew = True
                break
    return frozenset(ops)


def _split_runs(variant, which):
    """For each SDPA op of kind ``which`` and each of its axes: a region grown
    around it, split in 2 and 4 (where n divides), checked against eager.
    Returns {axis name: regions run}."""
    m = _model(**VARIANTS[variant])
    x, t = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    prog = trace(m, (x, t), loss_fn=_mse)
    g = prog.graph
    dg = DGraph(g)
    ops = [n for n in g.ops if n.target == str(FWD if which == "fwd" else BWD)]
    assert len(ops) == 2
    assert not ops[0].rng, "dropout_p=0: no RNG draw"
    assert prog.simulate().peak == check_step(m, (x, t), _mse, "train",
                                              lambda _: prog.module()).measured_peak
    runs = {}
    for node in ops:
        for comp in dg.components:
            if node.id not in comp.axis_of:
                continue
            name = dg.axis(node.id, comp.id).name
            for n in (2, 4):
                if comp.size % n or dg.axis(node.id, comp.id).size % n:
                    continue
                region = _grow(dg, node.id, comp.id, n)
                assert check(dg, region, comp.id, n) is None
                split = prog.with_graph(apply_fission(dg, [FTrans(region, comp.id, n)]))
                chk = check_step(m, (x, t), _mse, "train", lambda _: split.module())
                assert chk.comparison.allclose, (variant, name, n, chk.comparison.mismatches)
                assert split.simulate().peak == chk.measured_peak
                runs[name] = runs.get(name, 0) + 1
    return runs


EXPECTED = {"plain": {"batch", "heads", "query"}, "causal": {"batch", "heads", "query"},
            "mask": {"batch", "heads", "query"}, "gqa": {"batch", "heads", "query"}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_training_regions_through_the_backward(variant):
    assert set(_split_runs(variant, "bwd")) == EXPECTED[variant]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_training_regions_through_the_forward(variant):
    assert set(_split_runs(variant, "fwd")) == EXPECTED[variant]


def test_optimize_splits_inference_through_sdpa():
    """In inference the attention's activations are transient: the plan splits
    the batch through an SDPA op. (In a training step the fused kernel leaves
    no large transient there: the activations the backward keeps dominate, and
    the search meets such budgets with swaps and recomputation instead; the
    regions above check that training splits are right.)"""
    torch.manual_seed(0)
    m = nn.Sequential(*(mod for _ in range(2) for mod in (
        Attention(d=64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))))
    x = torch.randn(4, 256, 64)
    # a fixed profile, bounded by states rather than seconds: the same plan on any machine
    res = magis_nb.optimize(m, (x,), mode="infer", mem_budget=0.5, time_budget=60,
                            device_profile="rtx3090", max_states=100)
    split = [n for n in res.plan.state.graph.ops if n.region and n.target == str(FWD)]
    assert len(split) >= 2 and res.plan.peak < 0.85 * res.before.peak, res.plan
    chk = check_step(m, (x,), None, "infer", lambda _: res.module)
    assert chk.comparison.allclose, chk.comparison.mismatches
