"""The strides a part tensor will have when the split program runs, for views.

Note [views of parts]
A region's ``view`` (or ``_unsafe_view``) was traced against the whole tensor's
strides. In a part, its input may be laid out so that the view is not valid:
a chain like ``transpose -> view -> view`` over a narrow along an inner dim (a
sequence part of ``[B, S, H]`` is ``[B, S/n, H]`` with the whole tensor's batch
stride) can merge ``B`` and ``S/n`` in the whole but not in the part ("view size
is not compatible with input tensor's size and stride"). Such a view reads a
contiguous copy of its part; the copy is an op of the split program, so the
memory simulator counts it. To find out, the view chain is replayed on meta
tensors (exact for views); a tensor made by an op in the region is taken to be
laid out densely in the dim order of the tensor it is a part of (what aten's
ops do: elementwise ops keep their input's order, attention's output its
permuted one), an input of the region with its traced strides. Only views that
fail get a copy: cloning before every view of a view would add a copy to each
attention chain of a transformer.
"""
from __future__ import annotations

import torch

from ..ir.graph import Graph, Node, Ref, TensorInfo, contiguous, map_refs
from .proto import External, ProtoBuilder

RESHAPES = frozenset({"aten.view.default", "aten._unsafe_view.default"})


def _dense_like(shape: tuple, like: TensorInfo) -> tuple[int, ...]:
    """Dense strides for ``shape`` with the dims in the order ``like``'s strides
    give them (outermost first; contiguous order where ``like``'s are unknown)."""
    st = like.stride
    if st is None or len(st) != len(shape):
        return tuple(contiguous(shape))
    order = sorted(range(len(shape)), key=lambda d: (-st[d], d))
    out, acc = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = acc
        acc *= max(shape[d], 1)
    return tuple(out)


class PartLayouts:
    """Meta tensors standing for the proto refs of split regions (memoized)."""

    def __init__(self, b: ProtoBuilder, g: Graph):
        self.b, self.g = b, g
        self.origin: dict[int, int] = {}     # proto id -> the original op it is a part of
        self.metas: dict[tuple, torch.Tensor] = {}   # (ref type, node, out) -> meta

    def meta(self, r: Ref) -> torch.Tensor:
        """A meta tensor with ``r``'s shape, dtype and (expected) strides."""
        key = (type(r), r.node, r.out)
        got = self.metas.get(key)
        if got is not None:
            return got
        if isinstance(r, External):
            t = self.g.tensor(Ref(r.node, r.out))
            st = t.stride if t.stride is not None and len(t.stride) == len(t.shape) \
                else contiguous(t.shape)
            m = torch.empty_strided(tuple(t.shape), tuple(st), dtype=t.dtype, device="meta")
        else:
            node = self.b.nodes[r.node]
            t = node.outputs[r.out]
            m = self._view(node, r.out) if t.alias is not None else None
            if m is None:
                st = t.stride
                if st is None:
                    v = self.origin.get(r.node)
                    like = self.g.nodes[v].outputs[r.out] if v is not None else t
                    st = _dense_like(tuple(t.shape), like)
                m = torch.empty_strided(tuple(t.shape), tuple(st), dtype=t.dtype, device="meta")
        self.metas[key] = m
        return m

    def _replay(self, node: Node, args, kwargs):
        """``node``'s op run on meta tensors standing for ``args``' refs."""
        meta = lambda r, _k: self.meta(r)  # noqa: E731
        return node.op(*map_refs(args, meta), **map_refs(kwargs, meta))

    def _view(self, node: Node, out: int) -> torch.Tensor | None:
        """A view op replayed on meta tensors; None where it cannot be."""
        try:
            got = self._replay(node, node.args, node.kwargs)
        except Exception:  # noqa: BLE001 - unknown layout: taken as dense below
            return None
        got = got[out] if isinstance(got, (tuple, list)) else got
        return got if isinstance(got, torch.Tensor) else None

    def viewable(self, node: Node, args, kwargs) -> bool:
        """Whether reshaping op ``node`` (`RESHAPES`) is valid on these part args."""
        try:
            self._replay(node, args, kwargs)
        except RuntimeError:
            return False
        return True
