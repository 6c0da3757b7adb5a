"""Window rules: which rows of its inputs an op reads for a band of output rows.

Spatial fission (spatial.py) splits the height and width of image tensors. A
convolution's output rows [a, b) read an overlapping window of its input: the
rows [a*s - p, (b-1)*s + d*(k-1) + 1 - p), a few more than the part's own (the
halo). Each rule here answers, for one op and one spatial dim:

  ``need(a, b)``   the input rows [lo, hi) that output rows [a, b) read. They may
                   reach past the input ([lo < 0 or hi > size]): those rows are the
                   op's padding, which a part adds itself (``pad``).
  ``pad``          the value the op pads with (0 for a convolution, -inf for a max
                   pool), or None: the op has no padding along the dim and ``need``
                   stays inside the input.
  ``origin(lo)``   the output row that the op makes first when it runs on input
                   rows from ``lo`` on (padding rows included) with its padding
                   along the dim set to 0. For convolutions and pools, fed exactly
                   ``need(a, b)``, that is ``a``; an upsampling or a transposed
                   convolution makes a few rows more, which the part narrows away.
  ``edits(size)``  how the op's arguments change for a part whose windowed input
                   has ``size`` rows along the dim: (argument, list index or None,
                   value) triples (padding 0 there, output sizes rewritten).

Only tensor inputs listed in ``inputs`` are windowed (weights, biases and norm
statistics are read whole). Every forward rule is exact: a part's rows equal the
whole op's rows bit for bit (tests/test_spatial.py runs each on random shapes);
a convolution's backward (Note [gradients in tiles] in spatial.py) makes its
rows by another kernel and sums its weight gradient over the tiles, equal to
rounding (tests/test_spatial_grads.py). What
has no rule, or a rule's preconditions fail, is a barrier (None): ceil-mode
average pools, ``count_include_pad=False`` with padding, an ``output_padding``,
bilinear with ``align_corners=True``, scales that are not powers of two (a
non-dyadic scale rounds differently once the rows are shifted), or a max pool
whose indices anything reads (they index the part, not the image).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..ir.graph import Node
from .dims_base import Bound



def spatial_dims(rank: int) -> tuple[int, ...]:
    """The image dims of a [N, C, *spatial] tensor with 1 to 3 spatial dims
    (NCL, NCHW, NCDHW); () for any other rank."""
    return tuple(range(2, rank)) if 3 <= rank <= 5 else ()


def _image(shape, d: int) -> bool:
    return d in spatial_dims(len(shape))


@dataclass(frozen=True)
class Window:
    inputs: tuple[int, ...]                     # windowed tensor-input indices
    need: Callable[[int, int], tuple[int, int]]
    origin: Callable[[int], int]
    edits: Callable[[int], list]
    pad: float | None = None
    dense: bool = True                          # the kernel wants its input contiguous
    # an op with outputs summed over the tiles (a convolution's weight
    # gradient, Note [gradients in tiles]): a tile owns a band [a, e) of the
    # rows of input ``sum_own`` and reads ``sum_need(a, e)`` of the other
    sum_need: Callable[[int, int], tuple[int, int]] | None = None
    sum_own: int | None = None


def _pow2(x: float) -> bool:
    return x >= 1 and float(x).is_integer() and (int(x) & (int(x) - 1)) == 0


def _conv(node: Node, b: Bound, ins, outs, d: int) -> Window | None:
    x = b.t("input")
    w_shape = ins[b.t("weight")]
    if not _image(ins[x], d):
        return None
    i = d - 2
    k, s, p, dil = w_shape[d], b["stride"][i], b["padding"][i], b["dilation"][i]
    reach = dil * (k - 1)
    H_in = ins[x][d]
    if not b["transposed"]:
        return Window((x,), lambda a, e: (a * s - p, (e - 1) * s + reach + 1 - p),
                      lambda lo: (lo + p) // s, lambda size: [("padding", i, 0)], 0.0)
    if b["output_padding"][i]:
        return None

    def need_t(a, e):
        # the inputs that reach rows [a, e), and enough of them that the rows
        # made run from at most a to at least e (a row no input reaches, when
        # the stride exceeds the kernel, is the bias alone)
        lo = min(-((-(a + p - reach)) // s), (a + p) // s)
        hi = max((e - 1 + p) // s + 1, -((-(e + p - reach - 1)) // s) + 1)
        return max(lo, 0), min(hi, H_in)

    return Window((x,), need_t, lambda lo: lo * s - p, lambda size: [("padding", i, 0)])


def _grad_conv(node: Node, b: Bound, ins, outs, d: int) -> Window | None:
    """``convolution_backward``, in the gather form of Note [gradients in
    tiles]. Of a convolution: grad_input's rows [a, e) are what the
    grad_output rows whose windows reach them add up (a transposed convolution
    of those rows); a tile owns a band of grad_output for the weight gradient
    and reads the input window the band was made from. Of a transposed
    convolution, the other way round: grad_input's rows are a convolution of
    grad_output's window, and a tile owns a band of the input."""
    g, x = b.t("grad_output"), b.t("input")
    if g is None or x is None or not _image(ins[x], d) or not _image(ins[g], d):
        return None
    i = d - 2
    k, s, p, dil = ins[b.t("weight")][d], b["stride"][i], b["padding"][i], b["dilation"][i]
    reach = dil * (k - 1)

    def window(a, e):           # a convolution's input rows for its output rows [a, e)
        return a * s - p, (e - 1) * s + reach + 1 - p

    def reached(size):          # the rows of ``size`` whose windows reach rows [a, e)
        def need(a, e):
            lo = max(-((-(a + p - reach)) // s), 0)
            hi = min((e - 1 + p) // s + 1, size)
            return lo, max(hi, lo)
        return need

    if b["transposed"]:
        return Window((g, x), window, lambda lo: (lo + p) // s, lambda size: [("padding", i, 0)],
                      0.0, sum_need=window, sum_own=x)
    return Window((g, x), reached(ins[g][d]), lambda lo: lo * s - p,
                  lambda size: [("padding", i, 0)], 0.0, sum_need=window, sum_own=g)


def _pool(node: Node, b: Bound, ins, outs, d: int) -> Window | None:
    x = b.t("self")
    if not _image(ins[x], d):
        return None
    i = d - 2
    k = b["kernel_size"]
    k = k[i] if len(k) > 1 else k[0]
    st = b["stride"] or b["kernel_size"]
    s = st[i] if len(st) > 1 else st[0]
    pd = b["padding"]
    p = pd[i] if len(pd) > 1 else pd[0]
    is_max = "max_pool" in node.target
    if is_max:
        dl = b["dilation"]
        dil = dl[i] if len(dl) > 1 else dl[0]
    else:
        dil = 1
        if b["ceil_mode"] or (p and not b["count_include_pad"]):
            return None
    reach = dil * (k - 1)

    return Window((x,), lambda a, e: (a * s - p, (e - 1) * s + reach + 1 - p),
                  lambda lo: (lo + p) // s, lambda size: [("padding", i, 0)],
                  float("-inf") if is_max else 0.0)


def _upsample(node: Node, b: Bound, ins, outs, d: int) -> Window | None:
    x = b.t("input") if b.t("input") is not None else b.t("self")
    if not _image(ins[x], d) or outs[0] is None:
        return None
    H_in, H_out = ins[x][d], outs[0][d]
    if H_out % H_in or not _pow2(H_out // H_in):
        return None
    s = H_out // H_in
    i = d - 2
    vec = node.target.endswith(".vec")
    if vec:
        sf = b["scale_factors"]
        if sf is not None and sf[i] != s:
            return None
    else:
        scale_name = _SCALES[len(ins[x]) - 2][i]
        sc = b[scale_name]
        if sc is not None and sc != s:
            return None
    linear = "linear" in node.target         # linear, bilinear, trilinear
    if linear and b["align_corners"]:
        return None

    if linear:
        def need(a, e):
            lo = math.floor(max((a + 0.5) / s - 0.5, 0.0))
            hi = math.floor(max((e - 1 + 0.5) / s - 0.5, 0.0)) + 2
            return lo, min(hi, H_in)
    else:
        def need(a, e):
            return a // s, (e - 1) // s + 1

    def edits(size):
        if vec:
            return [] if b["output_size"] is None else [("output_size", i, size * s)]
        return [("output_size", i, size * s), (scale_name, None, float(s))]
    return Window((x,), need, lambda lo: lo * s, edits)


# the scale arguments of upsample_*{1,2,3}d, by spatial rank
_SCALES = {1: ("scales",), 2: ("scales_h", "scales_w"), 3: ("scales_d", "scales_h", "scales_w")}


def _pad(node: Node, b: Bound, ins, outs, d: int) -> Window | None:
    """An explicit ``F.pad`` (constant; a negative pad crops): output row r is
    input row r - top, and rows outside the input are the pad value."""
    pad = list(b["pad"])
    x = b.t("self")
    if not _image(ins[x], d) or len(pad) % 2:
        return None
    at = 2 * (len(ins[x]) - 1 - d)   # pad lists the last dim first: [left, right, top, bottom]
    if at >= len(pad):               # this dim is not padded
        return Window((x,), lambda a, e: (a, e), lambda lo: lo, lambda size: [], dense=False)
    top = pad[at]
    return Window((x,), lambda a, e: (a - top, e - top), lambda lo: lo + top,
                  lambda size: [("pad", at, 0), ("pad", at + 1, 0)], float(b["value"] or 0.0),
                  dense=False)


def _same(node: Node, b: Bound, ins, outs, d: int, only=None) -> Window | None:
    """Output row r reads row r of every input as large as the output there
    (broadcast inputs are read whole)."""
    out = outs[0]
    if out is None or not _image(out, d):
        return None
    r = len(out)
    tens = []
    for j, s in enumerate(ins):
        if only is not None and j not in only:
            continue
        dj = d - (r - len(s))
        if dj >= 0 and s[dj] == out[d] and len(s) == r:
            tens.append(j)
        elif dj >= 0 and s[dj] != 1:
            return None           # a dim neither the output's nor broadcast
    if not tens:
        return None
    return Window(tuple(tens), lambda a, e: (a, e), lambda lo: lo, lambda size: [], dense=False)


def _batch_norm_eval(node, b, ins, outs, d):
    w = _same(node, b, ins, outs, d, only=(b.t("input"),))
    return None if w is None else Window(w.inputs, w.need, w.origin, w.edits, dense=True)


def _bn_elemt(node, b, ins, outs, d):
    """BatchNorm's elementwise phases (Note [BatchNorm in phases]): the image
    inputs (x; dy and x for the backward) by rows, the statistics whole."""
    img = (0,) if node.target == "magis_nb.bn_elemt.default" else (0, 1)
    w = _same(node, b, ins, outs, d, only=img)
    return None if w is None else Window(w.inputs, w.need, w.origin, w.edits, dense=True)


def _cat(node, b, ins, outs, d):
    from .dims_base import norm_dim
    if norm_dim(b["dim"], len(outs[0])) == d:
        return None
    return _same(node, b, ins, outs, d)


ELEMENTWISE = {
    "aten.relu.default", "aten.relu_.default", "aten.add.Tensor", "aten.sub.Tensor",
    "aten.mul.Tensor", "aten.div.Tensor", "aten.sigmoid.default", "aten.silu.default",
    "aten.gelu.default", "aten.tanh.default", "aten.hardtanh.default", "aten.leaky_relu.default",
    "aten.neg.default", "aten.clone.default", "aten.hardswish.default", "aten.elu.default",
    "aten.add.Scalar", "aten.mul.Scalar", "aten.clamp.default", "aten.where.self",
    # a training step's backward, elementwise too
    "aten.threshold_backward.default", "aten.sigmoid_backward.default",
    "aten.tanh_backward.default", "aten.silu_backward.default", "aten.gelu_backward.default",
    "aten.hardtanh_backward.default", "aten.leaky_relu_backward.default",
    "aten.hardswish_backward.default",
}

RULES: dict[str, Callable] = {
    "aten.convolution.default": _conv,
    "aten.max_pool2d_with_indices.default": _pool,
    "aten.max_pool3d_with_indices.default": _pool,
    "aten.avg_pool2d.default": _pool,
    "aten.avg_pool3d.default": _pool,
    **{f"aten.upsample_{kind}.{v}": _upsample for v in ("default", "vec")
       for kind in ("nearest1d", "nearest2d", "nearest3d", "linear1d", "bilinear2d",
                    "trilinear3d")},
    "aten._native_batch_norm_legit_no_training.default": _batch_norm_eval,
    "aten.constant_pad_nd.default": _pad,
    "aten.cat.default": _cat,
    "aten.convolution_backward.default": _grad_conv,
    "magis_nb.bn_elemt.default": _bn_elemt,
    "magis_nb.bn_backward_elemt.default": _bn_elemt,
    **{t: _same for t in ELEMENTWISE},
}


# ops whose window is wider than their own rows, or shifted: a region without
# one is elementwise along the image, which the D-Graph's equal slices split
# already (and the generated code loops over)
HALO_TARGETS = frozenset(t for t, fn in RULES.items()
                         if fn not in (_same, _cat, _batch_norm_eval, _bn_elemt))


def window(node: Node, in_shapes, out_shapes, d: int, indices_read: bool = False) -> Window | None:
    """The op's window along spatial dim ``d``, or None: it cannot be split there."""
    fn = RULES.get(node.target)
    if fn is None or node.rng or node.kind != "op":
        return None
    if node.target.startswith("aten.max_pool") and indices_read:
        return None
    try:
        return fn(node, Bound(node), [tuple(s) for s in in_shapes],
                  [None if s is None else tuple(s) for s in out_shapes], d)
    except (KeyError, IndexError, TypeError, ValueError):
        return None
