"""Dimension rules for losses, pooling, upsampling and attention ops."""
from __future__ import annotations

from .dims_base import Bound, OpDims, ax, axes_of, broadcast_axes, rule


# -- losses -------------------------------------------------------------------------

def _nll_positions(x_shape, two_d):
    """Dims of self (N, [H, W]) that a target position indexes, and the target dims."""
    if two_d:
        return [0, 2, 3], [0, 1, 2]
    return ([0], [0]) if len(x_shape) == 2 else ([], [])


@rule("aten.nll_loss_forward", "aten.nll_loss2d_forward")
def _nll_loss(node, b, ins, outs):
    """reduction none: positions are spatial; sum: "sum" (output and total_weight).
    mean divides by the total weight of the whole batch: no rule."""
    red = b["reduction"]
    if red not in (0, 2):
        return None
    x, t = b.t("self"), b.t("target")
    xd, td = _nll_positions(ins[x], "2d" in node.target)
    return OpDims(axes_of(*(
        ax(ins[x][a], [(x, a), (t, c)], [(0, c)] if red == 0 else [], "sum", "position")
        for a, c in zip(xd, td))))


@rule("aten.nll_loss_backward", "aten.nll_loss2d_backward")
def _nll_loss_backward(node, b, ins, outs):
    """Positions are spatial: total_weight comes in as a (shared) input."""
    x, t, go = b.t("self"), b.t("target"), b.t("grad_output")
    xd, td = _nll_positions(ins[x], "2d" in node.target)
    none = b["reduction"] == 0
    return OpDims(axes_of(*(
        ax(ins[x][a], [(x, a), (t, c)] + ([(go, c)] if none else []), [(0, a)], name="position")
        for a, c in zip(xd, td))))


@rule("aten.mse_loss")
def _mse_loss(node, b, ins, outs):
    red = b["reduction"]
    if red == 0:
        return OpDims(broadcast_axes(ins, [0, 1], outs[0], [0]))
    comb = "mean" if red == 1 else "sum"
    return OpDims(axes_of(*(ax(s, [(0, d), (1, d)], [], comb) for d, s in enumerate(ins[0]))))


@rule("aten.mse_loss_backward")
def _mse_loss_backward(node, b, ins, outs):
    """Mean divides by the whole numel: only reduction none/sum."""
    red = b["reduction"]
    if red == 1:
        return None
    return OpDims(broadcast_axes(ins, [0, 1, 2], outs[0], [0]))


# -- pooling and upsampling ---------------------------------------------------------

def _leading(ins, outs, tens, spatial=2, name=("batch", "channel")):
    """Every dim before the last ``spatial`` ones, on the given inputs and all outputs."""
    lead = len(ins[tens[0]]) - spatial
    oix = [o for o in range(len(outs)) if outs[o] is not None]
    return [ax(ins[tens[0]][d], [(t, d) for t in tens], [(o, d) for o in oix],
               name=name[d - lead + 2] if d - lead + 2 >= 0 else "")
            for d in range(lead)]


@rule("aten.max_pool2d_with_indices", "aten.avg_pool2d", "aten._adaptive_avg_pool2d",
      "aten.adaptive_max_pool2d", "aten.upsample_nearest2d", "aten.upsample_nearest2d.vec",
      "aten.upsample_bilinear2d", "aten.upsample_bilinear2d.vec", "aten.reflection_pad2d",
      "aten.replication_pad2d")
def _pool2d(node, b, ins, outs):
    return OpDims(axes_of(*_leading(ins, outs, [0])))


@rule("aten.max_pool2d_with_indices_backward", "aten.avg_pool2d_backward",
      "aten._adaptive_avg_pool2d_backward", "aten.adaptive_max_pool2d_backward")
def _pool2d_backward(node, b, ins, outs):
    return OpDims(axes_of(*_leading(ins, outs, list(range(len(ins))))))


@rule("aten.upsample_nearest2d_backward", "aten.upsample_bilinear2d_backward")
def _upsample_backward(node, b, ins, outs):
    def rw(node, axis, out_shapes):
        return Bound(node).replace(input_size=list(out_shapes[0]))
    return OpDims(axes_of(*_leading(ins, outs, [0])), rw)


# -- attention ----------------------------------------------------------------------

def _sdpa_axes(b, ins, q_tens, causal, q_outs, kv_outs, comb):
    """Batch and heads on every tensor; query sequence (not causal) on the query-side
    tensors. The key sequence is a softmax reduction: not an axis."""
    q, k, v, m = (b.t(n) for n in ("query", "key", "value", "attn_mask"))
    L = ins[q][-2]
    res = []
    for d, nm in ((0, "batch"), (1, "heads")):
        if len(ins[q]) < 4:
            break
        tens = [(t, d) for t in q_tens + [k, v]]
        if m is not None:
            md = d - (4 - len(ins[m]))
            if md >= 0 and ins[m][md] == ins[q][d]:
                tens.append((m, md))
        res.append(ax(ins[q][d], tens, q_outs(d) + kv_outs(d), comb, nm))
    if not causal:
        d = len(ins[q]) - 2
        tens = [(t, d) for t in q_tens]
        if m is not None and len(ins[m]) >= 2 and ins[m][-2] == L:
            tens.append((m, len(ins[m]) - 2))
        res.append(ax(L, tens, q_outs(d), comb, "query"))
    return axes_of(*res)


@rule("aten._scaled_dot_product_flash_attention_for_cpu")
def _sdpa_cpu(node, b, ins, outs):
    """(output [B,H,L,E], logsumexp [B,H,L])."""
    if b["dropout_p"]:
        return None
    return OpDims(_sdpa_axes(b, ins, [b.t("query")], bool(b["is_causal"]),
                             lambda d: [(0, d), (1, d)], lambda d: [], None))


@rule("aten._scaled_dot_product_flash_attention_for_cpu_backward")
def _sdpa_cpu_backward(node, b, ins, outs):
    """(grad_q, grad_k, grad_v): along the query sequence grad_k/grad_v are sums."""
    if b["dropout_p"]:
        return None
    qt = [b.t(n) for n in ("grad_out", "query", "out", "logsumexp")]
    return OpDims(_sdpa_axes(b, ins, qt, bool(b["is_causal"]), lambda d: [(0, d)],
                             lambda d: [(1, d), (2, d)] if d < 2 else [], "sum"))
