"""Dimension rules for matmul, convolution, normalization and embedding ops."""
from __future__ import annotations

from .dims_base import Bound, OpDims, ax, axes_of, broadcast_axes, parts, rule


def _present(*pairs):
    """Drop (tensor, dim) pairs whose tensor index is None (an absent optional)."""
    return [(t, d) for t, d in pairs if t is not None]


# -- matmul -------------------------------------------------------------------

@rule("aten.mm")
def _mm(node, b, ins, outs):
    (m, k), (_, n) = ins[0], ins[1]
    return OpDims(axes_of(ax(m, [(0, 0)], [(0, 0)], name="M"),
                          ax(n, [(1, 1)], [(0, 1)], name="N"),
                          ax(k, [(0, 1), (1, 0)], [], "sum", "K")))


@rule("aten.mv")
def _mv(node, b, ins, outs):
    m, k = ins[0]
    return OpDims(axes_of(ax(m, [(0, 0)], [(0, 0)], name="M"),
                          ax(k, [(0, 1), (1, 0)], [], "sum", "K")))


@rule("aten.bmm")
def _bmm(node, b, ins, outs):
    (bs, m, k), (_, _, n) = ins[0], ins[1]
    return OpDims(axes_of(ax(bs, [(0, 0), (1, 0)], [(0, 0)], name="batch"),
                          ax(m, [(0, 1)], [(0, 1)], name="M"),
                          ax(n, [(1, 2)], [(0, 2)], name="N"),
                          ax(k, [(0, 2), (1, 1)], [], "sum", "K")))


@rule("aten.addmm", "aten.baddbmm")
def _addmm(node, b, ins, outs):
    """bias + a @ b: the bias (broadcast to the output) rides along M/N/batch;
    K is not an axis (each part would add the bias again)."""
    out, r = outs[0], len(outs[0])
    tb = b.t("self")
    t1, t2 = (b.t("mat1"), b.t("mat2")) if r == 2 else (b.t("batch1"), b.t("batch2"))
    bias = {a.outputs[0][1]: list(a.inputs) for a in broadcast_axes([ins[tb]], [0], out, [0])}
    res = []
    for d, size in enumerate(out):
        mats = [(t2, d)] if d == r - 1 else [(t1, d)] if d == r - 2 else [(t1, d), (t2, d)]
        res.append(ax(size, mats + [(tb, dj) for _, dj in bias.get(d, [])], [(0, d)],
                      name=("batch", "M", "N")[d - r + 3]))
    return OpDims(axes_of(*res))


# -- convolution ----------------------------------------------------------------

def _conv_dims(axes):
    """OpDims for convolution(_backward): on the group axis ``groups`` becomes
    groups/n; a requested grad_bias takes its bias_sizes from the part's shape."""
    def rw(node, axis, out_shapes):
        b = Bound(node)
        new = {}
        if axes[axis].name == "group":
            new["groups"] = b["groups"] // parts(node, axes[axis], out_shapes)
        if b["bias_sizes"] is not None and len(out_shapes) > 2 and out_shapes[2] is not None:
            new["bias_sizes"] = [out_shapes[2][0]]
        return b.replace(**new) if new else (tuple(node.args), dict(node.kwargs))
    return OpDims(axes, rw)


@rule("aten.convolution")
def _convolution(node, b, ins, outs):
    """Batch always. groups == 1: out-channel (weight, bias, out) and, without a
    bias, in-channel as a "sum" axis. groups > 1: the group axis (input, weight,
    bias and output channels; groups becomes groups/n). H/W need halos: none."""
    x, w, bias = b.t("input"), b.t("weight"), b.t("bias")
    g, tr = b["groups"], bool(b["transposed"])
    wo, wi = (1, 0) if tr else (0, 1)           # weight dims of out/in channels
    res = [ax(ins[x][0], [(x, 0)], [(0, 0)], name="batch")]
    if g == 1:
        res.append(ax(outs[0][1], _present((w, wo), (bias, 0)), [(0, 1)], name="out_channel"))
        if bias is None:
            res.append(ax(ins[x][1], [(x, 1), (w, wi)], [], "sum", "in_channel"))
    else:
        res.append(ax(g, _present((x, 1), (w, 0), (bias, 0)), [(0, 1)], name="group"))
    return _conv_dims(axes_of(*res))


@rule("aten.convolution_backward")
def _convolution_backward(node, b, ins, outs):
    """Outputs (grad_input, grad_weight, grad_bias). Batch: weight grads "sum".
    groups == 1: out-channel (grad_input "sum"); in-channel only when grad_bias is
    not asked for (every part would compute all of it). groups > 1: the group axis."""
    go, x, w = b.t("grad_output"), b.t("input"), b.t("weight")
    g, tr = b["groups"], bool(b["transposed"])
    wo, wi = (1, 0) if tr else (0, 1)

    def have(*pairs):
        return [(o, d) for o, d in pairs if outs[o] is not None]
    res = [ax(ins[x][0], [(go, 0), (x, 0)], have((0, 0)), "sum", "batch")]
    if g == 1:
        res.append(ax(ins[go][1], [(go, 1), (w, wo)], have((1, wo), (2, 0)), "sum", "out_channel"))
        if outs[2] is None:
            res.append(ax(ins[x][1], [(x, 1), (w, wi)], have((0, 1), (1, wi)), "sum", "in_channel"))
    else:
        res.append(ax(g, [(go, 1), (x, 1), (w, 0)], have((0, 1), (1, 0), (2, 0)), "sum", "group"))
    return _conv_dims(axes_of(*res))


# -- normalization ----------------------------------------------------------------

@rule("aten.native_layer_norm")
def _layer_norm(node, b, ins, outs):
    """(out, mean, rstd): the leading (non-normalized) dims; mean/rstd keep them."""
    x = b.t("input")
    lead = len(ins[x]) - len(b["normalized_shape"])
    oix = [o for o in range(3) if outs[o] is not None]
    return OpDims(axes_of(*(ax(ins[x][d], [(x, d)], [(o, d) for o in oix], name="row")
                            for d in range(lead))), contiguous=frozenset({x}))


@rule("aten.native_layer_norm_backward")
def _layer_norm_backward(node, b, ins, outs):
    """(grad_input, grad_weight, grad_bias): leading dims; weight grads "sum".

    The CPU kernel reads mean/rstd as flat contiguous arrays (ignoring their
    strides): a part narrowed along an inner leading dim (the sequence of
    [B,S,H]) is copied contiguous first (`OpDims.contiguous`).
    """
    x = b.t("input")
    lead = len(ins[x]) - len(b["normalized_shape"])
    tens = [b.t(n) for n in ("grad_out", "input", "mean", "rstd")]
    gi = outs[0] is not None
    return OpDims(axes_of(*(
        ax(ins[x][d], [(t, d) for t in tens], [(0, d)] if gi else [], "sum", "row")
        for d in range(lead))), contiguous=frozenset(t for t in tens if t is not None))


def _channel_axis(ins, b, x_names, vec_names, outs_ch):
    """The channel axis of a batch norm: dim 1 of the activations, dim 0 of every
    per-channel vector that is present with the channel count (not empty)."""
    xs = [b.t(n) for n in x_names]
    c = ins[xs[0]][1]
    vecs = [(b.t(n), 0) for n in vec_names
            if b.t(n) is not None and ins[b.t(n)] == (c,)]
    return ax(c, [(t, 1) for t in xs] + vecs, outs_ch, name="channel")


@rule("aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit.no_stats",
      "aten._native_batch_norm_legit_no_training")
def _batch_norm(node, b, ins, outs):
    """Channel only, except in eval (no_training), where the op is elementwise
    with per-channel constants: then batch and spatial dims too (its mean/invstd
    outputs are empty, and "sum" of empty parts is empty)."""
    x = b.t("input")
    oc = [(0, 1)] + [(o, 0) for o in range(1, len(outs))
                     if outs[o] is not None and outs[o] == (ins[x][1],)]
    res = [_channel_axis(ins, b, ["input"], ["weight", "bias", "running_mean", "running_var"], oc)]
    if node.target.startswith("aten._native_batch_norm_legit_no_training"):
        res += [ax(ins[x][d], [(x, d)], [(0, d)], "sum", "batch" if d == 0 else "spatial")
                for d in range(len(ins[x])) if d != 1]
    return OpDims(axes_of(*res))


@rule("aten.native_batch_norm_backward")
def _batch_norm_backward(node, b, ins, outs):
    """(grad_input, grad_weight, grad_bias). Channel always; with train=False the
    statistics are constants, so batch/spatial dims are axes with weight grads "sum"."""
    x = b.t("input")
    oc = [(o, 1 if o == 0 else 0) for o in range(3) if outs[o] is not None]
    res = [_channel_axis(ins, b, ["grad_out", "input"],
                         ["weight", "running_mean", "running_var", "save_mean", "save_invstd"], oc)]
    if not b["train"]:
        gi = outs[0] is not None
        res += [ax(ins[x][d], [(b.t("grad_out"), d), (x, d)],
                   [(0, d)] if gi else [], "sum", "batch" if d == 0 else "spatial")
                for d in range(len(ins[x])) if d != 1]
    return OpDims(axes_of(*res))


def _group_norm_dims(axes):
    def rw(node, axis, out_shapes):
        b = Bound(node)
        return b.replace(N=b["N"] // parts(node, axes[axis], out_shapes))
    return OpDims(axes, rw)


@rule("aten.native_group_norm")
def _group_norm(node, b, ins, outs):
    """(out, mean[N,G], rstd[N,G]): the batch (N rewritten to N/n). Not the groups:
    the kernels require a contiguous input, and a narrowed channel dim is not."""
    x = b.t("input")
    oix = [o for o in range(3) if outs[o] is not None]
    return _group_norm_dims(axes_of(ax(ins[x][0], [(x, 0)], [(o, 0) for o in oix], name="batch")))


@rule("aten.native_group_norm_backward")
def _group_norm_backward(node, b, ins, outs):
    tens = [b.t(n) for n in ("grad_out", "input", "mean", "rstd")]
    return _group_norm_dims(axes_of(
        ax(ins[tens[1]][0], [(t, 0) for t in tens], [(0, 0)] if outs[0] is not None else [],
           "sum", "batch")))


# -- embedding ----------------------------------------------------------------------

@rule("aten.embedding")
def _embedding(node, b, ins, outs):
    w, idx = b.t("weight"), b.t("indices")
    k = len(ins[idx])
    return OpDims(axes_of(*[ax(ins[idx][d], [(idx, d)], [(0, d)], name="token") for d in range(k)],
                          ax(ins[w][1], [(w, 1)], [(0, k)], name="hidden")))


@rule("aten.embedding_dense_backward")
def _embedding_backward(node, b, ins, outs):
    """Tokens are "sum" axes (unless gradients are scaled by token frequency)."""
    go, idx = b.t("grad_output"), b.t("indices")
    k = len(ins[idx])
    res = [] if b["scale_grad_by_freq"] else [
        ax(ins[idx][d], [(go, d), (idx, d)], [], "sum", "token") for d in range(k)]
    return OpDims(axes_of(*res, ax(ins[go][k], [(go, k)], [(0, 1)], name="hidden")))


# -- BatchNorm in phases (Note [BatchNorm in phases] in ir/phased_norm.py) ------------

def _phase_axes(ins, b, acts, vecs, out_dim, reduce: bool, stats=()):
    """Axes of a phased BatchNorm op: the channel (dim 1 of the activations and
    of the [3, C] statistics, dim 0 of per-channel vectors); every other dim of
    the activations either reduced ("sum": the statistics of parts add up) or
    elementwise onto output 0."""
    xs = [b.t(n) for n in acts if b.t(n) is not None]
    c = ins[xs[0]][1] if xs else ins[b.t(stats[0])][1]
    ch = ([(t, 1) for t in xs] + [(b.t(n), 1) for n in stats]
          + [(b.t(n), 0) for n in vecs if b.t(n) is not None])
    res = [ax(c, ch, out_dim, name="channel")]
    if xs:
        for d in range(len(ins[xs[0]])):
            if d != 1:
                res.append(ax(ins[xs[0]][d], [(t, d) for t in xs], [] if reduce else [(0, d)],
                              "sum", "batch" if d == 0 else "spatial"))
    return OpDims(axes_of(*res))


@rule("magis_nb.bn_stats")
def _bn_stats(node, b, ins, outs):
    return _phase_axes(ins, b, ["x"], ["shift"], [(0, 1)], True)


@rule("magis_nb.bn_backward_reduce")
def _bn_backward_reduce(node, b, ins, outs):
    return _phase_axes(ins, b, ["grad_out", "x"], ["mean", "invstd"], [(0, 1)], True)


@rule("magis_nb.bn_elemt")
def _bn_elemt(node, b, ins, outs):
    return _phase_axes(ins, b, ["x"], ["weight", "bias", "mean", "invstd"], [(0, 1)], False)


@rule("magis_nb.bn_backward_elemt")
def _bn_backward_elemt(node, b, ins, outs):
    return _phase_axes(ins, b, ["grad_out", "x"], ["weight", "mean", "invstd"], [(0, 1)], False,
                       ["sums"])


@rule("magis_nb.bn_finalize", "magis_nb.bn_running", "magis_nb.bn_backward_affine")
def _bn_per_channel(node, b, ins, outs):
    vecs = [n for n in ("shift", "running_mean", "running_var") if n in b.names]
    return _phase_axes(ins, b, [], vecs, [(o, 0) for o in range(len(outs))], False,
                       ["stats" if "stats" in b.names else "sums"])
