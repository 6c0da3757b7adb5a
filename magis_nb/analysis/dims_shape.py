"""Dimension rules for elementwise ops, reductions, softmax, views and indexing ops."""
from __future__ import annotations

import math

import torch

from .dims_base import OpDims, ax, axes_of, broadcast_axes, gcd, norm_dim, rule

# Elementwise (with broadcasting) over every tensor input; all outputs have the
# output shape. ``*_like`` factories are here too: their output takes the input's shape.
_UNARY = """abs neg exp exp2 expm1 log log1p log2 sqrt rsqrt reciprocal sin cos tan tanh
sigmoid relu gelu silu mish hardswish hardsigmoid erf erfc sign floor ceil trunc round
bitwise_not logical_not isnan isinf clone alias detach lift_fresh_copy _to_copy
relu6 hardtanh elu leaky_relu softplus celu selu square frac nan_to_num positive""".split()
_BINARY = """add sub mul div rsub pow remainder fmod atan2 maximum minimum eq ne lt le gt ge
bitwise_and bitwise_or bitwise_xor logical_and logical_or logical_xor masked_fill
clamp clamp_min clamp_max where lerp addcmul addcdiv copy fill threshold_backward
native_dropout_backward gelu_backward silu_backward sigmoid_backward tanh_backward
hardtanh_backward leaky_relu_backward elu_backward softplus_backward hardswish_backward
hardsigmoid_backward mish_backward threshold xlogy ones_like zeros_like empty_like
full_like""".split()
_OVERLOADS = ("default", "Tensor", "Scalar", "self", "Tensor_Scalar", "Tensor_Tensor",
              "Tensor_mode", "Scalar_Tensor", "Scalar_mode")


def _existing(names, overloads):
    """The functional overloads that exist (one Tensor returned)."""
    out = set()
    for b in names:
        packet = getattr(torch.ops.aten, b, None)
        have = set(packet.overloads()) if packet is not None else set()
        for o in overloads:
            rets = [str(r.type) for r in getattr(packet, o)._schema.returns] if o in have else []
            if rets == ["Tensor"]:
                out.add(f"aten.{b}.{o}")
    return sorted(out)


# out= and in-place overloads are left out on purpose (they write into an argument)
ELEMENTWISE = _existing(_UNARY + _BINARY, _OVERLOADS)


@rule(*ELEMENTWISE)
def _elementwise(node, b, ins, outs):
    if outs[0] is None:
        return None
    shape = outs[0]
    oix = [i for i, s in enumerate(outs) if s == shape]
    if len(oix) != sum(s is not None for s in outs):
        return None
    return OpDims(broadcast_axes(ins, list(range(len(ins))), shape, oix))


def _reduce(ins, outs, dims, keepdim, combine, name="reduce"):
    """Input 0 reduced over ``dims``: kept dims are spatial, reduced ones combine."""
    rank = len(ins[0])
    red = sorted({norm_dim(d, rank) for d in dims}) if dims else list(range(rank))
    oix = [i for i, s in enumerate(outs) if s is not None]
    res = []
    for d in range(rank):
        if d in red:
            if combine is not None:
                res.append(ax(ins[0][d], [(0, d)], [], combine, name))
        else:
            od = d if keepdim else d - sum(r < d for r in red)
            res.append(ax(ins[0][d], [(0, d)], [(o, od) for o in oix], combine))
    return OpDims(axes_of(*res))


_REDUCE_COMBINE = {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min",
                   "max": "max", "min": "min"}


@rule("aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default", "aten.amin.default")
def _reduce_dim(node, b, ins, outs):
    if b.t("self") != 0 or len(ins) != 1:
        return None
    return _reduce(ins, outs, b["dim"], bool(b["keepdim"]),
                   _REDUCE_COMBINE[node.target.split(".")[1]])


@rule("aten.sum.default", "aten.mean.default", "aten.max.default", "aten.min.default")
def _reduce_all(node, b, ins, outs):
    return _reduce(ins, outs, None, False, _REDUCE_COMBINE[node.target.split(".")[1]])


@rule("aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default",
      "aten.var.correction", "aten.std.correction", "aten.logsumexp.default",
      "aten.linalg_vector_norm.default", "aten.prod.dim_int", "aten.any.dim", "aten.all.dim")
def _reduce_kept_only(node, b, ins, outs):
    """Reductions whose partial results do not merge: only the kept dims."""
    dim = b["dim"]
    if dim is None and node.target.startswith(("aten.argmax", "aten.argmin")):
        return OpDims([])
    dims = [dim] if isinstance(dim, int) else dim
    return _reduce(ins, outs, dims, bool(b["keepdim"]), None)


@rule("aten._softmax", "aten._log_softmax", "aten._safe_softmax", "aten.cumsum",
      "aten.cumprod", "aten._softmax_backward_data", "aten._log_softmax_backward_data")
def _all_but_dim(node, b, ins, outs):
    """Every dim except ``dim``, on every tensor input and the output."""
    rank = len(outs[0])
    dim = norm_dim(b["dim"], rank)
    return OpDims(axes_of(*(
        ax(outs[0][d], [(j, d) for j in range(len(ins))], [(0, d)])
        for d in range(rank) if d != dim)))


@rule("aten.tril", "aten.triu")
def _batch_of_matrix(node, b, ins, outs):
    return OpDims(axes_of(*(ax(outs[0][d], [(0, d)], [(0, d)])
                            for d in range(len(outs[0]) - 2))))


@rule("aten.flip")
def _flip(node, b, ins, outs):
    rank = len(outs[0])
    flipped = {norm_dim(d, rank) for d in b["dims"]}
    return OpDims(axes_of(*(ax(outs[0][d], [(0, d)], [(0, d)])
                            for d in range(rank) if d not in flipped)))


@rule("aten.constant_pad_nd")
def _pad(node, b, ins, outs):
    rank, pad = len(outs[0]), list(b["pad"])
    padded = {rank - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    return OpDims(axes_of(*(ax(outs[0][d], [(0, d)], [(0, d)])
                            for d in range(rank) if d not in padded)))


# -- views and layout ------------------------------------------------------------

def view_groups(a, b):
    """Pair up minimal dim groups of shapes a and b with equal products."""
    if 0 in a or 0 in b:
        return []
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        pa, pb, ii, jj = a[i], b[j], [i], [j]
        while pa != pb:
            if pa < pb:
                i += 1
                if i >= len(a):
                    return groups
                pa *= a[i]
                ii.append(i)
            else:
                j += 1
                if j >= len(b):
                    return groups
                pb *= b[j]
                jj.append(j)
        groups.append((ii, jj))
        i, j = i + 1, j + 1
    return groups


def _view_axes(a, b):
    """Note [view axes]: in each group of dims with equal products, the outermost
    non-1 dim on either side is one axis, of size gcd of the two: a chunk of the
    group's leading dim on one side is the same contiguous run of elements as a
    chunk of it on the other, when n divides both. [B,S,H] -> [B*S,H] gives the
    axis (in 0, out 0) of size B; a part's output dim 0 is B*S/n long."""
    res = []
    for ii, jj in view_groups(a, b):
        oi = next((i for i in ii if a[i] > 1), None)
        oj = next((j for j in jj if b[j] > 1), None)
        if oi is not None and oj is not None:
            res.append(ax(gcd(a[oi], b[oj]), [(0, oi)], [(0, oj)]))
        # Note [blocked dims] in dims.py: in a merge the inner dims live on in the
        # merged one as blocks ([B,S,H] -> [B*S,H]: S is (0, S) of the output);
        # in a split, likewise on the input side
        if sum(b[j] > 1 for j in jj) == 1 and oi is not None:
            for i in ii:
                if i > oi and a[i] > 1:
                    blk = math.prod(a[i:ii[-1] + 1])
                    res.append(ax(a[i], [(0, i)], [(0, (oj, blk))]))
        elif sum(a[i] > 1 for i in ii) == 1 and oj is not None:
            for j in jj:
                if j > oj and b[j] > 1:
                    blk = math.prod(b[j:jj[-1] + 1])
                    res.append(ax(b[j], [(0, (oi, blk))], [(0, j)]))
    return axes_of(*res)


def _size_rewrite(argname):
    def rw(node, axis, out_shapes):
        from .dims_base import Bound
        return Bound(node).replace(**{argname: list(out_shapes[0])})
    return rw


@rule("aten.view", "aten._unsafe_view", "aten.reshape", "aten.view_copy", "aten._reshape_copy")
def _view(node, b, ins, outs):
    if b.t("self") != 0 or outs[0] is None:
        return None
    return OpDims(_view_axes(ins[0], outs[0]), _size_rewrite("size"), contiguous=frozenset({0}))


@rule("aten.flatten.using_ints", "aten.squeeze.default", "aten.squeeze.dim",
      "aten.squeeze.dims", "aten.unsqueeze.default")
def _view_no_sizes(node, b, ins, outs):
    return OpDims(_view_axes(ins[0], outs[0]))


@rule("aten.unflatten.int")
def _unflatten(node, b, ins, outs):
    dim, k = norm_dim(b["dim"], len(ins[0])), len(b["sizes"])

    def rw(node, axis, out_shapes):
        from .dims_base import Bound
        return Bound(node).replace(sizes=list(out_shapes[0][dim:dim + k]))
    return OpDims(_view_axes(ins[0], outs[0]), rw)


@rule("aten.expand", "aten.expand_copy")
def _expand(node, b, ins, outs):
    return OpDims(broadcast_axes(ins, [0], outs[0], [0]), _size_rewrite("size"))


def _perm_axes(ins, outs, perm):
    return OpDims(axes_of(*(ax(outs[0][j], [(0, p)], [(0, j)]) for j, p in enumerate(perm))))


@rule("aten.permute", "aten.permute_copy")
def _permute(node, b, ins, outs):
    rank = len(ins[0])
    return _perm_axes(ins, outs, [norm_dim(d, rank) for d in b["dims"]])


@rule("aten.transpose.int", "aten.transpose_copy.int")
def _transpose(node, b, ins, outs):
    rank = len(ins[0])
    perm = list(range(rank))
    d0, d1 = norm_dim(b["dim0"], rank), norm_dim(b["dim1"], rank)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _perm_axes(ins, outs, perm)


@rule("aten.t", "aten.numpy_T")
def _t(node, b, ins, outs):
    return _perm_axes(ins, outs, list(range(len(ins[0])))[::-1])


# -- indexing -----------------------------------------------------------------

@rule("aten.select.int", "aten.select_copy.int")
def _select(node, b, ins, outs):
    rank = len(ins[0])
    dim = norm_dim(b["dim"], rank)
    return OpDims(axes_of(*(ax(ins[0][d], [(0, d)], [(0, d if d < dim else d - 1)])
                            for d in range(rank) if d != dim)))


@rule("aten.slice.Tensor", "aten.slice_copy.Tensor")
def _slice(node, b, ins, outs):
    rank = len(ins[0])
    dim = norm_dim(b["dim"], rank)
    # a slice of all of ``dim`` (from 0, step 1, to the end or past it) is the
    # identity there, and on a part it takes all of the part: the backward of
    # Hugging Face's cache update (``cat([empty, k], -2)``) slices k's gradient
    # that way, and without the axis k's chain left the sequence's component
    whole = (b["start"] in (None, 0) and (b["step"] in (None, 1))
             and (b["end"] is None or b["end"] >= ins[0][dim]))
    return OpDims(axes_of(*(ax(ins[0][d], [(0, d)], [(0, d)])
                            for d in range(rank) if d != dim or whole)))


@rule("aten.select_backward", "aten.slice_backward")
def _select_slice_backward(node, b, ins, outs):
    rank = len(outs[0])
    dim = norm_dim(b["dim"], rank)
    sel = node.target.startswith("aten.select")
    res = [ax(outs[0][d], [(0, d if not sel or d < dim else d - 1)], [(0, d)])
           for d in range(rank) if d != dim]
    return OpDims(axes_of(*res), _size_rewrite("input_sizes"))


@rule("aten.cat")
def _cat(node, b, ins, outs):
    rank = len(outs[0])
    dim = norm_dim(b["dim"], rank)
    tix = b.tix.get("tensors") or []
    if any(t is None for t in tix):
        return None
    # legacy: 1-d empty tensors are skipped by cat; they are passed whole
    real = [t for t in tix if len(ins[t]) == rank]
    # with one tensor left the cat is a copy of it, along ``dim`` too (Hugging
    # Face's DynamicCache appends k and v to empty tensors in every forward)
    return OpDims(axes_of(*(ax(outs[0][d], [(t, d) for t in real], [(0, d)])
                            for d in range(rank) if d != dim or len(real) == 1)))


@rule("aten.split.Tensor", "aten.split_with_sizes", "aten.unbind.int",
      "aten.split_with_sizes_copy", "aten.split_copy.Tensor", "aten.unbind_copy.int")
def _split(node, b, ins, outs):
    rank = len(ins[0])
    dim = norm_dim(b["dim"] or 0, rank)
    drop = node.target.startswith("aten.unbind")
    oix = [i for i, s in enumerate(outs) if s is not None]
    return OpDims(axes_of(*(
        ax(ins[0][d], [(0, d)], [(o, d - 1 if drop and d > dim else d) for o in oix])
        for d in range(rank) if d != dim)))


# -- factories ----------------------------------------------------------------

@rule("aten.arange.default", "aten.arange.start", "aten.arange.start_step",
      "aten.scalar_tensor", "aten.linspace")
def _no_axes(node, b, ins, outs):
    return OpDims([])


@rule("aten.zeros", "aten.ones", "aten.full", "aten.empty.memory_format",
      "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.new_empty")
def _factory(node, b, ins, outs):
    """Every output dim is an axis. ``new_*(self, size)`` reads only self's dtype and
    device, so any part of self will do: where self has the output's rank and the
    same size in a dim (``new_zeros(grad, size)`` in the backward of an indexing
    op), self is listed as indexed there too. Otherwise a region producing self
    could not contain the factory (it would seem to need all of self)."""
    s = b.t("self")
    same = s is not None and len(ins[s]) == len(outs[0])
    return OpDims(axes_of(*(ax(n, [(s, d)] if same and ins[s][d] == n else [], [(0, d)])
                            for d, n in enumerate(outs[0]))),
                  _size_rewrite("size"))
