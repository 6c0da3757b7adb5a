"""Per-op dimension rules: how each ATen op's tensor dims relate (paper §4.1).

``op_dims(node, in_shapes, out_shapes)`` lists the op's iteration axes: for each,
the (tensor-input, dim) and (output, dim) pairs it indexes and how outputs that
lack it merge across parts. This is what the D-Graph links and what fission
relies on, so every listed axis is exactly true (tests/test_dims.py runs the
rules in parts with real tensors, on the zoo's graphs and hand-written cases):

Splitting along an axis into n equal contiguous parts (n divides ``Axis.size``),
part k runs the op on its inputs narrowed along the listed input dims (a dim of
length L gives ``x.narrow(dim, k*L/n, L/n)``; inputs not listed are passed whole)
with ``OpDims.chunk_args(node, axis, part_out_shapes)``. Then (a) each output
that contains the axis is the full output narrowed the same way along its listed
dim, and (b) each output that does not is merged from the n parts with
``Axis.combine`` ("sum", "max", "min", "mean" = average of the parts). With
``combine=None`` such outputs cannot be merged.

Note [axis sizes]: usually every listed dim has length ``Axis.size``. A view that
merges or splits dims links the outermost non-1 dims of a group with equal
products ([B,S,H] -> [B*S,H]: input dim 0, output dim 0); their lengths differ
(B and B*S) and ``Axis.size`` is their gcd (B): n must divide it, and each
listed dim, whatever its length L, is cut into n chunks of L/n. Likewise the
"group" axis of a grouped convolution has size groups while the channel dims it
indexes are multiples of it. ``part_out_shapes[i]`` is always the full output
shape with each listed output dim divided by n (unchanged for outputs that lack
the axis); ``chunk_args`` reads the part's sizes (and n) off it.

Parts get plain ``narrow`` views, which are not contiguous when an inner dim is
cut. Axes where a kernel mishandles that are left out: native_layer_norm_backward
reads mean/rstd ignoring their strides (only its outermost leading dim is listed),
native_group_norm(_backward) needs a contiguous input (batch only). The fused
scaled_dot_product_attention kernels (dims_attention.py) split along batch and
heads, and on CPU along the query sequence when not causal.

Note [blocked dims]: a view that merges dims ([B,S,H] -> [B*S,H]) leaves the
inner one (S) inside the merged dim: its chunk is not one contiguous run of
the merged dim but B of them, one per outer index. A listed dim may be
(d, block): dim d of length L seen as [L/block, block], each part taking a
chunk of block/n of every block (``x.unflatten(d, (L//block, block))
.narrow(d + 1, k*block/n, block/n).flatten(d, d + 1)``, a copy unless
L == block). The view rule lists these for the inner dims of a merge or a
split; the D-Graph (dgraph.py) carries them on through every op whose axis
there treats positions alike (every listed dim as long as the axis): a
matmul's rows, an elementwise op, a norm's rows, a loss's positions. So the
sequence of a [B,S,H] activation runs on through the linears as a blocked
dim of [B*S,H]. The axis size is the block.

Size-1 dims are never axes (they cannot be split), and broadcast dims (an input
dim of size 1 against a larger output dim) are not indexed. Ops without a rule,
RNG ops (dropout) and ops with no tensor output are barriers: ``op_dims`` is None.
"""
from __future__ import annotations

from ..ir.graph import Node
from . import dims_index, dims_nn, dims_ops, dims_shape, dims_attention  # noqa: F401  (last: overrides dims_nn)
from .dims_base import RULES, Axis, Bound, OpDims, dim_block, dim_index

__all__ = ["Axis", "OpDims", "op_dims", "covered_targets"]


def op_dims(node: Node, in_shapes: list[tuple[int, ...]],
            out_shapes: list[tuple[int, ...] | None]) -> OpDims | None:
    """The op's axes; None = no rule: the op is a barrier (can never be split)."""
    fn = RULES.get(node.target)
    if fn is None or node.rng or node.kind != "op" or not hasattr(node.op, "_schema"):
        return None
    if not any(s is not None for s in out_shapes):
        return None
    ins = [tuple(s) for s in in_shapes]
    outs = [tuple(s) if s is not None else None for s in out_shapes]
    try:
        res = fn(node, Bound(node), ins, outs)
    except (KeyError, IndexError, TypeError, ValueError):
        return None         # arguments the rule does not understand: a barrier
    return res if res is None or consistent(res, ins, outs) else None


def covered_targets() -> list[str]:
    """Every op target that has a rule."""
    return sorted(RULES)


def consistent(res: OpDims, ins, outs) -> bool:
    """Every listed dim exists and is a multiple of the axis size; each tensor is
    listed at most once per axis."""
    for a in res.axes:
        if a.combine not in ("sum", "max", "min", "mean", None) or a.size < 2:
            return False
        for pairs, shapes in ((a.inputs, ins), (a.outputs, outs)):
            tens = [t for t, _ in pairs]
            if len(set(tens)) != len(tens):
                return False
            for t, d in pairs:
                s = shapes[t] if 0 <= t < len(shapes) else None
                i = dim_index(d)
                if s is None or not 0 <= i < len(s) or s[i] % dim_block(d, s[i]) \
                        or dim_block(d, s[i]) % a.size:
                    return False
    return True
