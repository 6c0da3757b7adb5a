"""Dimension rules for advanced indexing: ``x[idx...]`` and its gradient.

``aten.index(self, indices)`` with a list like ``[None, None, ih, iw]`` is what
``F.interpolate`` (nearest, bilinear, bicubic) decomposes into, and
``aten._unsafe_index_put(zeros, indices, grad, accumulate=True)`` is its
backward. The dims that no index tensor touches (the None entries, and the dims
past the end of the list) pass through unchanged: those are the axes, so a
U-Net that upsamples by interpolation can still be split along its batch.
"""
from __future__ import annotations

from .dims_base import OpDims, ax, axes_of, rule


def _broadcast(shapes):
    rank = max(len(s) for s in shapes)
    out = []
    for d in range(rank):
        sizes = {s[d - rank + len(s)] for s in shapes if d - rank + len(s) >= 0} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _free_dims(b, ins):
    """(self dim -> result dim for every dim no index touches, result shape), or None.

    Advanced indexing: the index tensors broadcast to one shape B. When the indexed
    dims are adjacent, B replaces them in place; otherwise B goes first and the free
    dims follow in order. Boolean masks index several dims with a 1-d result; they
    make the predicted shape wrong, and a wrong prediction means no rule (the
    caller compares it with the real output shape).
    """
    s, tix = b.t("self"), b.tix.get("indices") or []
    if s is None:
        return None
    shape = ins[s]
    pos = [d for d, t in enumerate(tix) if t is not None]
    if not pos or len(tix) > len(shape):
        return None
    bshape = _broadcast([ins[tix[d]] for d in pos])
    if bshape is None:
        return None
    free = [d for d in range(len(shape)) if d not in pos]
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    if adjacent:
        before = [d for d in free if d < pos[0]]
        result = [shape[d] for d in before] + list(bshape) + [shape[d] for d in free if d > pos[-1]]
        where = {d: (d if d < pos[0] else d - len(pos) + len(bshape)) for d in free}
    else:
        result = list(bshape) + [shape[d] for d in free]
        where = {d: len(bshape) + k for k, d in enumerate(free)}
    return where, tuple(result)


@rule("aten.index.Tensor", "aten._unsafe_index.Tensor")
def _index(node, b, ins, outs):
    got = _free_dims(b, ins)
    if got is None or outs[0] is None or tuple(outs[0]) != got[1]:
        return None
    s = b.t("self")
    return OpDims(axes_of(*(ax(ins[s][d], [(s, d)], [(0, r)]) for d, r in got[0].items())))


@rule("aten.index_put.default", "aten._unsafe_index_put.default")
def _index_put(node, b, ins, outs):
    """Output = self with values written at the indices; the values broadcast to
    the result shape of ``self[indices]``, aligned from the right. Along a free
    dim each part writes only its own slice, with or without accumulate."""
    got = _free_dims(b, ins)
    v = b.t("values")
    if got is None or v is None or outs[0] is None or tuple(outs[0]) != tuple(ins[b.t("self")]):
        return None
    s, (where, result) = b.t("self"), got
    vshape, lead = ins[v], len(result) - len(ins[v])
    res = []
    for d, r in where.items():
        vd = r - lead
        if vd >= 0 and vshape[vd] == result[r]:
            tens = [(s, d), (v, vd)]
        elif vd < 0 or vshape[vd] == 1:
            tens = [(s, d)]          # values broadcast along this dim: passed whole
        else:
            return None
        res.append(ax(ins[s][d], tens, [(0, d)]))
    return OpDims(axes_of(*res))

