"""Per-op dimension rules: every listed axis is exactly true.

The key test runs each zoo model's captured graph op by op with real tensors and,
for every op with a rule and every axis, computes the op in parts as the rule
promises (inputs narrowed, ``chunk_args``) and compares with the full op.
"""
from __future__ import annotations

import pytest
import torch

from magis_nb import zoo
from magis_nb.analysis.causal import CausalPart
from magis_nb.analysis.dims import Axis, op_dims
from magis_nb.analysis.dims_base import dim_index
from magis_nb.ir.build import op_name
from magis_nb.ir.graph import Node, Ref, TensorInfo, iter_refs
from magis_nb.program import trace

aten = torch.ops.aten
RTOL, ATOL = 1e-4, 1e-5
# outputs whose values are undefined: only shapes are compared
UNDEFINED = {"aten.empty_like.default", "aten.empty.memory_format", "aten.new_empty.default"}
# zoo ops that are barriers on purpose (RNG, mean-reduced loss, no output)
# RNG ops, the dropout mask's allocation (made from shapes only, outside any
# region), mean-reduced losses (captured as a sum: see ir/passes.py) and asserts.
BARRIERS = {"aten.native_dropout.default", "aten.bernoulli_.float", "aten.nll_loss_forward.default",
            "aten.nll_loss2d_forward.default", "aten._assert_tensor_metadata.default",
            "aten.empty_strided.default"}


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


# -- the soundness check --------------------------------------------------------

def _fill(obj, tensors, it):
    if isinstance(obj, Ref):
        return tensors[next(it)]
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(o, tensors, it) for o in obj)
    if isinstance(obj, dict):
        return {k: _fill(v, tensors, it) for k, v in obj.items()}
    return obj


def dims_call(node: Node, tensors, args=None, kwargs=None):
    args = node.args if args is None else args
    kwargs = node.kwargs if kwargs is None else kwargs
    a, kw = _fill((tuple(args), dict(kwargs)), tensors, iter(range(len(tensors))))
    out = node.op(*a, **kw)
    return list(out) if node.multi else [out]


# A split may differ from the whole op by this many times the whole's own
# float32 rounding on that output (its largest difference from the op in
# float64): a sum combined from parts rounds differently, and where the whole
# is a difference of large sums (bn_stats' shifted sum, n*(mean - shift)) that
# rounding is above any fixed tolerance (2.3e-5 on the tiny DenseNet here).
SPLIT_SLACK = 4.0


def _rounding(node: Node, tensors, i: int) -> float:
    """The whole op's own float32 rounding on output ``i``: its largest
    difference from the op run on float64 copies of its float32 inputs (0.0
    when the op has no float32 input or does not run in float64)."""
    if not any(t.dtype == torch.float32 for t in tensors):
        return 0.0
    wide = [t.double() if t.dtype == torch.float32 else t for t in tensors]
    try:
        full, ref = dims_call(node, tensors)[i], dims_call(node, wide)[i]
    except RuntimeError:
        return 0.0
    if not isinstance(ref, torch.Tensor) or ref.shape != full.shape:
        return 0.0
    return (full.double() - ref.double()).abs().max().item()


def _same(part, full, exact, what, rounding=lambda: 0.0):
    """``part`` equals ``full``: to RTOL and ATOL, or within SPLIT_SLACK times
    ``rounding()``, the whole op's own rounding (computed only when needed)."""
    assert part.shape == full.shape, f"{what}: shape {tuple(part.shape)} != {tuple(full.shape)}"
    if exact:
        return
    if not full.dtype.is_floating_point:
        assert torch.equal(part, full), what
        return
    try:
        torch.testing.assert_close(part, full, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    except AssertionError:
        extra = SPLIT_SLACK * rounding()
        torch.testing.assert_close(part, full, rtol=RTOL, atol=ATOL + extra,
                                   msg=lambda m: f"{what} (own rounding x{SPLIT_SLACK}: "
                                                 f"{extra:.2e}): {m}")


def _merge(parts, how, n):
    acc = parts[0]
    for p in parts[1:]:
        if how in ("sum", "mean"):
            acc = acc + p
        elif how == "max":
            acc = torch.maximum(acc, p)
        else:
            acc = torch.minimum(acc, p)
    return acc / n if how == "mean" else acc


def split_counts(size: int) -> list[int]:
    ns = {n for n in (2, 3) if size % n == 0}
    if size <= 4:
        ns.add(size)
    return sorted(ns)


def _part(x, d, k: int, n: int):
    """Part k of n of ``x`` along listed dim ``d`` (Note [blocked dims])."""
    if isinstance(d, tuple):
        d, blk = d
        c = blk // n
        return x.unflatten(d, (x.shape[d] // blk, blk)).narrow(d + 1, k * c, c).flatten(d, d + 1)
    L = x.shape[d] // n
    return x.narrow(d, k * L, L)


def check_axis(node: Node, tensors, full, od, a: int, n: int) -> None:
    """Run ``node`` in n parts along axis ``a`` of ``od`` and compare with ``full``."""
    axis: Axis = od.axes[a]
    assert axis.size % n == 0
    dims_in = dict(axis.inputs)
    dims_out = dict(axis.outputs)
    part_shapes = []
    for i, t in enumerate(node.outputs):
        if t is None:
            part_shapes.append(None)
            continue
        s = list(t.shape)
        if i in dims_out:
            s[dim_index(dims_out[i])] //= n
        part_shapes.append(tuple(s))
    args, kwargs = od.chunk_args(node, a, part_shapes)
    cp = next((x for x in (*args, *kwargs.values()) if isinstance(x, CausalPart)), None)
    outs = []
    for k in range(n):
        ins = []
        for j, x in enumerate(tensors):
            if j in dims_in:
                x = _part(x, dims_in[j], k, n)
                if j in od.contiguous:     # as apply_fission hands it over
                    x = x.contiguous()
            if cp is not None and j in cp.prefix:  # the keys its rows see
                x = x.narrow(2, 0, cp.keys_of(k))
            ins.append(x)
        # a causal op split along its queries: part k's own mask rows (analysis/causal.py)
        a_k = tuple(x.make(ins[x.q], k) if isinstance(x, CausalPart) else x for x in args)
        kw_k = {nm: x.make(ins[x.q], k) if isinstance(x, CausalPart) else x
                for nm, x in kwargs.items()}
        got = list(dims_call(node, ins, a_k, kw_k))
        for i in (cp.prefix_outs if cp is not None else ()):    # gradients of those keys
            full_i = torch.zeros(node.outputs[i].shape, dtype=got[i].dtype)
            full_i.narrow(2, 0, got[i].shape[2]).copy_(got[i])
            got[i] = full_i
        outs.append(got)
    exact = node.target in UNDEFINED
    for i, f in enumerate(full):
        if node.outputs[i] is None or not isinstance(f, torch.Tensor):
            continue
        what = f"{node.target} axis {axis} n={n} output {i}"
        own = lambda i=i: _rounding(node, tensors, i)     # noqa: E731
        if i in dims_out:
            for k in range(n):
                _same(outs[k][i], _part(f, dims_out[i], k, n), exact, f"{what} part {k}", own)
        elif axis.combine is not None:
            merged = _merge([o[i] for o in outs], axis.combine, n)
            if merged.dtype != f.dtype and f.dtype.is_floating_point:
                merged = merged.to(f.dtype)
            _same(merged, f, exact, what, own)


def check_node(node: Node, tensors) -> int:
    """Check every axis of ``node``'s rule; returns the number of splits run."""
    ins = [tuple(t.shape) for t in tensors]
    outs = [t.shape if t is not None else None for t in node.outputs]
    od = op_dims(node, ins, outs)
    if od is None:
        return 0
    full = dims_call(node, tensors)
    count = 0
    for a, axis in enumerate(od.axes):
        for n in split_counts(axis.size):
            check_axis(node, tensors, full, od, a, n)
            count += 1
    return count


# -- real graphs ----------------------------------------------------------------

def _signature(node, tensors):
    rest = repr(_fill((node.args, node.kwargs), [None] * len(tensors), iter(range(len(tensors)))))
    return node.target, tuple(tuple(t.shape) for t in tensors), rest


def check_program(case, mode: str) -> tuple[set, set]:
    """Run the captured graph op by op; check each distinct op. Returns the op
    targets with and without a rule."""
    inputs = case.inputs if mode == "train" or case.loss_fn is None else case.inputs[:-1]
    prog = trace(case.model, inputs, loss_fn=case.loss_fn if mode == "train" else None, mode=mode)
    g = prog.graph
    params = dict(case.model.named_parameters(remove_duplicate=False))
    buffers = dict(case.model.named_buffers())
    vals = {}
    for n in g.inputs:
        kind, key = n.role
        vals[Ref(n.id, 0)] = params[key] if kind == "param" else \
            buffers[key] if kind == "buffer" else inputs[key]
    seen, ruled, unruled, per_target = set(), set(), set(), {}
    with torch.no_grad():
        for nid in g.program_order():
            n = g.nodes[nid]
            tensors = [vals[r].detach() for r in iter_refs((n.args, n.kwargs))]
            sig = _signature(n, tensors)
            if sig not in seen:
                seen.add(sig)
                ins = [tuple(t.shape) for t in tensors]
                outs = [t.shape if t is not None else None for t in n.outputs]
                if op_dims(n, ins, outs) is None:
                    unruled.add(n.target)
                else:
                    ruled.add(n.target)
                    per_target[n.target] = per_target.get(n.target, 0) + 1
                    if per_target[n.target] <= MAX_SIGNATURES:
                        check_node(n, tensors)
            out = dims_call(n, tensors)
            for i, t in enumerate(out):
                if i < len(n.outputs) and n.outputs[i] is not None:
                    vals[Ref(nid, i)] = t
    return ruled, unruled


MAX_SIGNATURES = 6      # distinct (shapes, args) checked per op target and model

CASES = [(name, "train") for name in zoo.names("tiny")] + \
    [("resnet", "infer"), ("bert", "infer"), ("unet", "infer")]
# The default run covers every op kind of the zoo's tiny graphs (68 targets); the
# others (marked slow) add only more instances of the same ops, at 3-8 s each.
FAST = {("vit", "train"), ("gpt", "train"), ("btlm", "train"), ("densenet", "train"),
        ("unet", "train"), ("resnet", "infer"), ("bert", "infer"), ("unetpp-magis", "train")}


@pytest.mark.parametrize("name,mode", [
    pytest.param(*c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_rules_are_sound_on_zoo_graphs(name, mode):
    ruled, unruled = check_program(zoo.build(name, "tiny"), mode)
    assert unruled <= BARRIERS, f"zoo ops without a rule: {sorted(unruled - BARRIERS)}"
    assert ruled


# -- hand-written nodes ---------------------------------------------------------

def make(op, *args, **kwargs):
    """A Node calling ``op`` on real tensors (replaced by Refs), and those tensors."""
    tensors = []

    def conv(a):
        if isinstance(a, torch.Tensor):
            tensors.append(a)
            return Ref(len(tensors) - 1)
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        return a
    cargs, ckw = conv(tuple(args)), {k: conv(v) for k, v in kwargs.items()}
    out = op(*args, **kwargs)
    multi = isinstance(out, (tuple, list))
    outs = [TensorInfo(tuple(t.shape), t.dtype, 0) if isinstance(t, torch.Tensor) else None
            for t in (out if multi else [out])]
    node = Node(id=100, name="n", kind="op", target=op_name(op), op=op, args=cargs,
                kwargs=ckw, outputs=outs, multi=multi)
    return node, tensors


def dims_of(node, tensors):
    return op_dims(node, [tuple(t.shape) for t in tensors],
                   [t.shape if t is not None else None for t in node.outputs])


def summary(od):
    return [(a.name, a.size, a.inputs, a.outputs, a.combine) for a in od.axes]


def r(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_mm():
    node, ts = make(aten.mm.default, r(6, 4), r(4, 8))
    assert summary(dims_of(node, ts)) == [
        ("M", 6, ((0, 0),), ((0, 0),), "sum"),
        ("N", 8, ((1, 1),), ((0, 1),), "sum"),
        ("K", 4, ((0, 1), (1, 0)), (), "sum")]
    assert check_node(node, ts) == 2 + 1 + 2     # 6: n=2,3; 8: 2; 4: 2,4


def test_addmm_has_no_k_axis():
    node, ts = make(aten.addmm.default, r(8), r(6, 4), r(4, 8))
    assert summary(dims_of(node, ts)) == [
        ("M", 6, ((1, 0),), ((0, 0),), "sum"),
        ("N", 8, ((2, 1), (0, 0)), ((0, 1),), "sum")]
    check_node(node, ts)
    node, ts = make(aten.addmm.default, r(6, 1), r(6, 4), r(4, 8), beta=0.5)
    assert [a.inputs for a in dims_of(node, ts).axes] == [((1, 0), (0, 0)), ((2, 1),)]
    check_node(node, ts)


def test_bmm():
    node, ts = make(aten.bmm.default, r(4, 6, 3), r(4, 3, 2))
    assert summary(dims_of(node, ts)) == [
        ("batch", 4, ((0, 0), (1, 0)), ((0, 0),), "sum"),
        ("M", 6, ((0, 1),), ((0, 1),), "sum"),
        ("N", 2, ((1, 2),), ((0, 2),), "sum"),
        ("K", 3, ((0, 2), (1, 1)), (), "sum")]
    check_node(node, ts)


def test_view_merge_and_split():
    x = r(4, 6, 5)
    node, ts = make(aten.view.default, x, [24, 5])
    od = dims_of(node, ts)
    # the inner merged dim (6) lives on as blocks of 6 in the merged one
    # (Note [blocked dims]); check_node runs it in parts as apply_fission does
    assert [(a.size, a.inputs, a.outputs) for a in od.axes] == [
        (4, ((0, 0),), ((0, 0),)), (6, ((0, 1),), ((0, (0, 6)),)), (5, ((0, 2),), ((0, 1),))]
    assert od.chunk_args(node, 0, [(12, 5)]) == ((Ref(0), [12, 5]), {})
    assert od.chunk_args(node, 1, [(12, 5)]) == ((Ref(0), [12, 5]), {})
    assert check_node(node, ts) == 4    # n = 2, 4 on the 4; 2, 3 on the 6
    # and the split back: the blocks are on the input side
    node, ts = make(aten.view.default, r(24, 5), [4, 6, 5])
    assert [(a.size, a.inputs, a.outputs) for a in dims_of(node, ts).axes] == [
        (4, ((0, 0),), ((0, 0),)), (6, ((0, (0, 6)),), ((0, 1),)), (5, ((0, 1),), ((0, 2),))]
    check_node(node, ts)
    # [6, 4] -> [4, 6]: one group, axis of size gcd(6, 4) = 2
    node, ts = make(aten._unsafe_view.default, r(6, 4), [4, 6])
    assert [(a.size, a.inputs, a.outputs) for a in dims_of(node, ts).axes] == [
        (2, ((0, 0),), ((0, 0),))]
    check_node(node, ts)
    # a split dim with size-1 dims around it
    node, ts = make(aten.view.default, r(1, 12, 1), [3, 4])
    assert [(a.size, a.inputs, a.outputs) for a in dims_of(node, ts).axes] == [
        (3, ((0, 1),), ((0, 0),)), (4, ((0, (1, 4)),), ((0, 1),))]
    check_node(node, ts)


def test_convolution():
    x, w, b = r(4, 6, 5, 5), r(8, 6, 3, 3), r(8)
    node, ts = make(aten.convolution.default, x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert summary(dims_of(node, ts)) == [
        ("batch", 4, ((0, 0),), ((0, 0),), "sum"),
        ("out_channel", 8, ((1, 0), (2, 0)), ((0, 1),), "sum")]
    check_node(node, ts)
    node, ts = make(aten.convolution.default, x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1)
    assert [a.name for a in dims_of(node, ts).axes] == ["batch", "out_channel", "in_channel"]
    check_node(node, ts)


def test_convolution_grouped_and_transposed():
    x = r(2, 6, 7, 7)
    node, ts = make(aten.convolution.default, x, r(9, 2, 3, 3), r(9), [1, 1], [0, 0], [1, 1],
                    False, [0, 0], 3)
    od = dims_of(node, ts)
    assert summary(od)[1] == ("group", 3, ((0, 1), (1, 0), (2, 0)), ((0, 1),), "sum")
    assert od.chunk_args(node, 1, [(2, 3, 5, 5)])[0][-1] == 1
    check_node(node, ts)
    node, ts = make(aten.convolution.default, x, r(6, 4, 2, 2), None, [2, 2], [0, 0], [1, 1],
                    True, [1, 1], 1)
    assert [(a.name, a.inputs, a.outputs) for a in dims_of(node, ts).axes] == [
        ("batch", ((0, 0),), ((0, 0),)), ("out_channel", ((1, 1),), ((0, 1),)),
        ("in_channel", ((0, 1), (1, 0)), ())]
    check_node(node, ts)
    node, ts = make(aten.convolution.default, x, r(6, 2, 3, 3), r(4), [1, 1], [1, 1], [1, 1],
                    True, [0, 0], 2)
    check_node(node, ts)


@pytest.mark.parametrize("transposed,groups,bias", [(False, 1, True), (False, 1, False),
                                                     (True, 1, True), (False, 2, True),
                                                     (True, 2, False)])
def test_convolution_backward(transposed, groups, bias):
    x = r(4, 4, 6, 6)
    w = r(4, 6 // groups, 3, 3) if transposed else r(6, 4 // groups, 3, 3)
    y = aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], transposed, [0, 0], groups)
    node, ts = make(aten.convolution_backward.default, torch.randn_like(y), x, w,
                    [6] if bias else None, [1, 1], [1, 1], [1, 1], transposed, [0, 0], groups,
                    [True, True, bias])
    od = dims_of(node, ts)
    names = [a.name for a in od.axes]
    assert names == ["batch"] + (["group"] if groups > 1 else
                                 ["out_channel"] + ([] if bias else ["in_channel"]))
    assert od.axes[0].combine == "sum" and od.axes[0].outputs == ((0, 0),)
    assert check_node(node, ts) > 0


def test_layer_norm_and_backward():
    x, w, b = r(4, 6, 8), r(8), r(8)
    node, ts = make(aten.native_layer_norm.default, x, [8], w, b, 1e-5)
    assert summary(dims_of(node, ts)) == [
        ("row", 4, ((0, 0),), ((0, 0), (1, 0), (2, 0)), "sum"),
        ("row", 6, ((0, 1),), ((0, 1), (1, 1), (2, 1)), "sum")]
    check_node(node, ts)
    _, mean, rstd = aten.native_layer_norm.default(x, [8], w, b, 1e-5)
    node, ts = make(aten.native_layer_norm_backward.default, r(4, 6, 8), x, [8], mean, rstd,
                    w, b, [True, True, True])
    # every leading dim; the CPU kernel ignores the strides of a narrowed mean/rstd,
    # so a part narrowed along an inner dim is handed over contiguous (OpDims.contiguous)
    od = dims_of(node, ts)
    assert summary(od) == [
        ("row", 4, ((0, 0), (1, 0), (2, 0), (3, 0)), ((0, 0),), "sum"),
        ("row", 6, ((0, 1), (1, 1), (2, 1), (3, 1)), ((0, 1),), "sum")]
    assert od.contiguous == {0, 1, 2, 3}
    assert check_node(node, ts) == 4
    # without the copy the kernel reads the wrong statistics: why the copy is there
    full = aten.native_layer_norm_backward.default(*ts[:2], [8], *ts[2:], [True, True, True])
    part = aten.native_layer_norm_backward.default(
        ts[0].narrow(1, 3, 3), ts[1].narrow(1, 3, 3), [8], ts[2].narrow(1, 3, 3),
        ts[3].narrow(1, 3, 3), *ts[4:], [True, True, True])
    assert not torch.allclose(part[0], full[0].narrow(1, 3, 3))


def test_batch_norm_has_no_batch_axis():
    x, w, b, rm, rv = r(4, 6, 3, 3), r(6), r(6), r(6), r(6).abs()
    node, ts = make(aten._native_batch_norm_legit_functional.default, x, w, b, rm, rv,
                    True, 0.1, 1e-5)
    assert summary(dims_of(node, ts)) == [
        ("channel", 6, ((0, 1), (1, 0), (2, 0), (3, 0), (4, 0)),
         ((0, 1), (1, 0), (2, 0), (3, 0), (4, 0)), "sum")]
    check_node(node, ts)
    _, sm, si, _, _ = aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True,
                                                                         0.1, 1e-5)
    node, ts = make(aten.native_batch_norm_backward.default, r(4, 6, 3, 3), x, w, rm, rv, sm, si,
                    True, 1e-5, [True, True, True])
    assert [a.name for a in dims_of(node, ts).axes] == ["channel"]
    check_node(node, ts)
    # eval: per-channel constants, so batch and spatial dims are axes too
    node, ts = make(aten._native_batch_norm_legit_no_training.default, x, w, b, rm, rv, 0.1, 1e-5)
    assert [a.name for a in dims_of(node, ts).axes] == ["channel", "batch", "spatial", "spatial"]
    check_node(node, ts)
    node, ts = make(aten.native_batch_norm_backward.default, r(4, 6, 3, 3), x, w, rm, rv, None,
                    None, False, 1e-5, [True, True, True])
    assert [a.name for a in dims_of(node, ts).axes] == ["channel", "batch", "spatial", "spatial"]
    check_node(node, ts)


def test_softmax():
    node, ts = make(aten._softmax.default, r(4, 6, 5), 1, False)
    assert [(a.inputs, a.outputs) for a in dims_of(node, ts).axes] == [
        (((0, 0),), ((0, 0),)), (((0, 2),), ((0, 2),))]
    check_node(node, ts)
    y = aten._softmax.default(ts[0], -1, False)
    node, ts = make(aten._softmax_backward_data.default, r(4, 6, 5), y, -1, torch.float64)
    assert [a.inputs for a in dims_of(node, ts).axes] == [((0, 0), (1, 0)), ((0, 1), (1, 1))]
    check_node(node, ts)


def test_reductions_combine():
    x = r(4, 6, 2)
    for op, args, comb in [(aten.sum.dim_IntList, ([1], True), "sum"),
                           (aten.mean.dim, ([0, 1],), "mean"),
                           (aten.amax.default, ([1],), "max"),
                           (aten.amin.default, ([0], True), "min"),
                           (aten.sum.default, (), "sum"), (aten.mean.default, (), "mean")]:
        node, ts = make(op, x, *args)
        od = dims_of(node, ts)
        assert {a.combine for a in od.axes if not a.outputs} == {comb}
        check_node(node, ts)
    node, ts = make(aten.sum.dim_IntList, x, [1], True)
    assert summary(dims_of(node, ts)) == [("", 4, ((0, 0),), ((0, 0),), "sum"),
                                          ("reduce", 6, ((0, 1),), (), "sum"),
                                          ("", 2, ((0, 2),), ((0, 2),), "sum")]
    node, ts = make(aten.var.correction, x, [1], correction=1)
    assert [a.inputs for a in dims_of(node, ts).axes] == [((0, 0),), ((0, 2),)]
    check_node(node, ts)


def test_barriers_and_elementwise_broadcast():
    node, ts = make(aten.native_dropout.default, r(4, 4), 0.5, True)
    node.rng = True
    assert dims_of(node, ts) is None
    node, ts = make(aten.nll_loss_forward.default, r(6, 3), torch.tensor([0, 1, 2, 0, 1, 2]),
                    None, 1, -100)
    assert dims_of(node, ts) is None                     # mean reduction
    node, ts = make(aten.cumsum.default, r(4), 0)
    node.target = "aten.no_such_op.default"
    assert dims_of(node, ts) is None
    node, ts = make(aten.masked_fill.Scalar, r(2, 4, 6), r(4, 1) > 0, 0.0)
    assert [(a.size, a.inputs) for a in dims_of(node, ts).axes] == [
        (2, ((0, 0),)), (4, ((0, 1), (1, 0))), (6, ((0, 2),))]
    check_node(node, ts)


def test_shape_ops():
    x = r(4, 6, 3)
    cases = [
        (aten.expand.default, (r(4, 1, 3), [2, 4, 6, 3])),
        (aten.permute.default, (x, [2, 0, 1])), (aten.transpose.int, (x, 0, 2)),
        (aten.t.default, (r(4, 6),)), (aten.unsqueeze.default, (x, 1)),
        (aten.squeeze.dims, (r(4, 1, 6), [1])), (aten.select.int, (x, 1, 2)),
        (aten.slice.Tensor, (x, 1, 1, 5)), (aten.cat.default, ([x, r(4, 2, 3)], 1)),
        (aten.select_backward.default, (r(4, 3), [4, 6, 3], 1, 2)),
        (aten.slice_backward.default, (r(4, 4, 3), [4, 6, 3], 1, 1, 5, 1)),
        (aten.split.Tensor, (x, 2, 1)), (aten.split_with_sizes.default, (x, [2, 4], 1)),
        (aten.constant_pad_nd.default, (x, [1, 1])), (aten.unbind.int, (x, 1)),
        (aten.flatten.using_ints, (x, 0, 1)), (aten.unflatten.int, (r(24, 3), 0, [4, 6])),
        (aten.ones_like.default, (x,)), (aten.new_zeros.default, (x, [4, 6])),
        (aten.full.default, ([4, 6], 2.0)), (aten.where.self, (x > 0, x, r(6, 1))),
        (aten.embedding.default, (r(10, 4), torch.randint(0, 10, (4, 6)))),
        (aten.embedding_dense_backward.default, (r(4, 6, 4), torch.randint(0, 10, (4, 6)), 10,
                                                 -1, False)),
    ]
    for op, args in cases:
        node, ts = make(op, *args)
        od = dims_of(node, ts)
        assert od is not None and od.axes, op
        assert check_node(node, ts) > 0, op


def test_losses_pooling_norms_attention():
    logp = torch.log_softmax(r(6, 3), 1)
    tgt = torch.tensor([0, 1, 2, -100, 1, 2])
    cases = [
        (aten.nll_loss_forward.default, (logp, tgt, None, 0, -100)),
        (aten.nll_loss_forward.default, (logp, tgt, r(3).abs(), 2, -100)),
        (aten.nll_loss_backward.default, (torch.tensor(1.0, dtype=torch.float64), logp, tgt, None,
                                          1, -100, torch.tensor(5.0, dtype=torch.float64))),
        (aten.nll_loss2d_forward.default, (r(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4)), None,
                                           2, -100)),
        (aten.mse_loss.default, (r(4, 6), r(4, 6), 1)),
        (aten.max_pool2d_with_indices.default, (r(2, 4, 6, 6), [3, 3], [2, 2], [1, 1])),
        (aten.avg_pool2d.default, (r(2, 4, 6, 6), [2, 2], [2, 2])),
        (aten.upsample_nearest2d_backward.default, (r(2, 4, 6, 6), [6, 6], [2, 4, 3, 3])),
        (aten.native_group_norm.default, (r(4, 6, 3, 3), r(6), r(6), 4, 6, 9, 3, 1e-5)),
    ]
    for op, args in cases:
        node, ts = make(op, *args)
        assert check_node(node, ts) > 0, op
    x = r(4, 6, 3, 3)
    _, mean, rstd = aten.native_group_norm.default(x, r(6), r(6), 4, 6, 9, 3, 1e-5)
    node, ts = make(aten.native_group_norm_backward.default, r(4, 6, 3, 3), x, mean, rstd, r(6),
                    4, 6, 9, 3, [True, True, True])
    assert [a.name for a in dims_of(node, ts).axes] == ["batch"]
    check_node(node, ts)
    q, k, v = (torch.randn(2, 3, s, 4) for s in (6, 4, 4))
    node, ts = make(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v)
    assert [a.name for a in dims_of(node, ts).axes] == ["batch", "heads", "query"]
    check_node(node, ts)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
    node, ts = make(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                    torch.randn_like(out), q, k, v, out, lse, 0.0, False)
    od = dims_of(node, ts)
    assert [(a.name, a.outputs, a.combine) for a in od.axes][2] == ("query", ((0, 2),), "sum")
    check_node(node, ts)
    node, ts = make(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v,
                    is_causal=True)
    # causal: each query part with its own mask rows (analysis/causal.py)
    assert [a.name for a in dims_of(node, ts).axes] == ["batch", "heads", "query"]
    check_node(node, ts)


def test_advanced_indexing_splits_the_dims_no_index_touches():
    """x[:, :, ih, iw] (F.interpolate's decomposition), x[idx] with trailing free
    dims, non-adjacent indices (the broadcast dims go first), and the scatter back."""
    x = r(4, 6, 3, 5)
    ih = torch.tensor([0, 0, 1, 1, 2, 2]).unsqueeze(-1)        # [6, 1]
    iw = torch.tensor([0, 1, 1, 2, 3, 4, 4, 2, 0, 1])           # [10]
    ij = torch.tensor([2, 0, 1])
    cases = [  # (op, args, the free (self dim, result dim) pairs)
        (aten._unsafe_index.Tensor, (x, [None, None, ih, iw]), [(0, 0), (1, 1)]),
        (aten.index.Tensor, (x, [ij]), [(1, 1), (2, 2), (3, 3)]),
        (aten.index.Tensor, (x, [None, ij, ij]), [(0, 0), (3, 2)]),
        (aten.index.Tensor, (x, [ij, None, ij]), [(1, 1), (3, 2)]),   # not adjacent: B first
    ]
    for op, args, free in cases:
        node, ts = make(op, *args)
        od = dims_of(node, ts)
        assert [(i[0][1], o[0][1]) for i, o in ((a.inputs, a.outputs) for a in od.axes)] == free, args
        assert check_node(node, ts) > 0, op
    up = r(4, 6, 6, 10)
    for acc in (True, False):
        node, ts = make(aten._unsafe_index_put.default, torch.zeros(4, 6, 3, 5, dtype=torch.float64),
                        [None, None, ih, iw], up, acc)
        assert [a.inputs for a in dims_of(node, ts).axes] == [((0, 0), (3, 0)), ((0, 1), (3, 1))]
        check_node(node, ts)
    # the zeros it scatters into: made from the gradient's dtype (any part of it will do)
    node, ts = make(aten.new_zeros.default, up, [4, 6, 3, 5])
    assert [a.inputs for a in dims_of(node, ts).axes] == [((0, 0),), ((0, 1),), (), ()]
    check_node(node, ts)
    # values broadcast along a free dim: passed whole to every part
    node, ts = make(aten.index_put.default, x, [None, ij], r(3, 1, 5), True)
    assert [a.inputs for a in dims_of(node, ts).axes] == [((0, 0),), ((0, 2),), ((0, 3), (2, 2))]
    check_node(node, ts)
    # a boolean mask's result is not B's shape: no rule, never a wrong one
    node, ts = make(aten.index.Tensor, x, [None, torch.tensor([1, 0, 1, 1, 0, 1]).bool()])
    assert dims_of(node, ts) is None


def test_a_slice_of_all_of_a_dim_and_a_cat_onto_an_empty_tensor_split_along_it():
    """Hugging Face's DynamicCache appends k and v to empty tensors
    (``cat([empty, k], -2)``) and the backward slices k's gradient out whole:
    both are copies along that dim, so a split along it runs through them
    (without it, k and v of HF's Llama left the sequence's component and no
    block backward could remake them in parts). A slice of part of a dim, or a
    cat of two tensors, still has no axis there."""
    x = r(4, 6, 3)
    for op, args, dim in [(aten.slice.Tensor, (x, 1, 0, 6), 1),
                          (aten.slice.Tensor, (x, 1, 0, 2**63 - 1), 1),
                          (aten.slice.Tensor, (x, -2), 1),
                          (aten.cat.default, ([torch.empty(0, dtype=x.dtype), x], 1), 1)]:
        node, ts = make(op, *args)
        od = dims_of(node, ts)
        assert any((0, dim) in a.outputs for a in od.axes), (op, args[1:])
        assert check_node(node, ts) >= 3, op     # every axis run in parts, that one too
    for op, args in [(aten.slice.Tensor, (x, 1, 1, 6)), (aten.slice.Tensor, (x, 1, 0, 6, 2)),
                     (aten.cat.default, ([x, r(4, 2, 3)], 1))]:
        node, ts = make(op, *args)
        assert not any((0, 1) in a.outputs for a in dims_of(node, ts).axes), args[1:]


class _BlockedBatchNormQKV(torch.nn.Module):
    """LeViT's attention input: a linear with BatchNorm1d over the flattened
    tokens, its channels then viewed as heads x (query, key, value)."""

    def __init__(self, c=16, heads=2, key=4, value=8):
        super().__init__()
        self.heads, self.key, self.value = heads, key, value
        self.lin = torch.nn.Linear(c, heads * (2 * key + value), bias=False)
        self.bn = torch.nn.BatchNorm1d(heads * (2 * key + value))
        self.out = torch.nn.Linear(heads * value, c)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.bn(self.lin(x).flatten(0, 1)).view(b, n, self.heads, -1)
        q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.split([self.key, self.key, self.value], dim=3))
        a = (q @ k.transpose(-2, -1) * self.key ** -0.5).softmax(-1)
        return self.out((a @ v).transpose(1, 2).reshape(b, n, -1))


def test_a_graph_input_read_in_blocks_and_whole():
    """A weight read along a plain dim and along the same dim in blocks (the
    BatchNorm's channels, viewed as heads) gives the D-Graph keys of both kinds:
    it sorted them as tuples against ints and failed on LeViT. Every F-Tree
    candidate of the step, split in 2, equals eager's."""
    import torch.nn.functional as F

    from magis_nb.analysis import DGraph, apply_fission
    from magis_nb.analysis.ftree import build_ftree
    from magis_nb.runtime import OptimizedModule
    from magis_nb.verify import Reference
    torch.manual_seed(0)
    model = _BlockedBatchNormQKV()
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    prog = trace(model, (x, y), loss_fn=F.mse_loss)
    dg = DGraph(prog.graph)
    assert any(any(isinstance(d, tuple) for _, d in c.inputs) for c in dg.components)
    assert "p_bn_weight[0:16]" in [c.name for c in dg.components]
    cands = build_ftree(dg, prog.hotspots())
    assert cands
    ref = Reference(model, (x, y), F.mse_loss, "train")
    for c in cands:
        split = prog.with_graph(apply_fission(dg, [c.ftrans(2)]))
        order = split.to_node_order(split.program_order())
        chk = ref.check(OptimizedModule(model, prog.captured, split.graph, order))
        assert chk.comparison.allclose, (c, chk.comparison.mismatches)


def test_own_rounding_does_not_hide_a_wrong_combine():
    """SPLIT_SLACK widens the tolerance by the whole op's own rounding, which
    stays far below what a wrong rule gets wrong: bn_stats' spatial split passes
    as summed and fails merged by mean."""
    import dataclasses
    from magis_nb.ir.phased_norm import OPS
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16) * 3 + 5
    node, ts = make(OPS["bn_stats"], x, torch.full((3,), 4.5))
    od = dims_of(node, ts)
    full = dims_call(node, ts)
    a = next(i for i, ax_ in enumerate(od.axes) if ax_.combine == "sum" and ax_.size % 2 == 0)
    check_axis(node, ts, full, od, a, 2)
    assert _rounding(node, ts, 0) > 0
    od.axes[a] = dataclasses.replace(od.axes[a], combine="mean")
    with pytest.raises(AssertionError):
        check_axis(node, ts, full, od, a, 2)


def test_a_second_rule_for_a_target_is_refused():
    """A target has one dimension rule: registering another raises instead of
    replacing it (which rule held depended on the order of imports)."""
    from magis_nb.analysis.dims_base import RULES, rule
    before = RULES["aten.mm.default"]
    with pytest.raises(ValueError, match="already has a dimension rule"):
        rule("aten.mm")(lambda *a: None)
    assert RULES["aten.mm.default"] is before
