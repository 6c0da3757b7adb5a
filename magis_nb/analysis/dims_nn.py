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
