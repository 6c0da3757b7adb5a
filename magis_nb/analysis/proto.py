"""The nodes of a graph being rewritten by fission, before their final ids.

`apply_fission` builds the split program as proto nodes with provisional ids
(positions in `ProtoBuilder.nodes`) and a sort key each; `ProtoBuilder.finish`
orders them topologically (ties broken by key) and renumbers them. A node of a
split region may read a tensor of the original graph whose proto id is not known
yet (another region's assembled output): it holds an `External` ref, resolved
once every region exists.
"""
from __future__ import annotations

import dataclasses
import heapq
import math

import torch

from ..ir.build import unique_ident
from ..ir.graph import Graph, Node, Ref, Region, TensorInfo, contiguous, map_refs

aten = torch.ops.aten


class External(Ref):
    """A reference to a tensor of the original graph, resolved after all regions exist."""


def has_external(node: Node) -> bool:
    """``node`` reads or aliases an `External` ref."""
    return any(isinstance(r, External) for r in node.refs()) \
        or any(t is not None and isinstance(t.alias, External) for t in node.outputs)


class ProtoBuilder:
    """Collects proto nodes (ids are provisional) with a sort key for the final order."""

    def __init__(self, g: Graph):
        self.g = g
        self.nodes: list[Node] = []
        self.keys: list[tuple] = []
        self.taken = {n.name for n in g.nodes}
        self.external: set[int] = set()     # proto ids of nodes holding External refs

    def add(self, node: Node, key: tuple, fresh_name: str | None = None) -> int:
        node.id = len(self.nodes)
        if fresh_name is not None:
            node.name = unique_ident(fresh_name, self.taken)
        self.nodes.append(node)
        self.keys.append(key)
        if has_external(node):
            self.external.add(node.id)
        return node.id

    def op(self, target, op, args, kwargs, outputs, key, name, category,
           region: Region | tuple = (), deps=()):
        return self.add(Node(0, "", "op", target, op, tuple(args), dict(kwargs), outputs,
                             category, region=region, deps=tuple(deps)), key, name)

    def resolve_external(self, resolve) -> None:
        """Replace every External ref by ``resolve(ref)``, a Ref in proto ids."""
        fix = lambda r, _k: resolve(r) if isinstance(r, External) else r
        for v in sorted(self.external):
            node = self.nodes[v]
            node.args = map_refs(node.args, fix)
            node.kwargs = map_refs(node.kwargs, fix)
            node.outputs = [None if t is None else dataclasses.replace(
                t, alias=resolve(t.alias) if isinstance(t.alias, External) else t.alias)
                for t in node.outputs]
        self.external.clear()

    def finish(self, outputs: list[Ref], roles) -> Graph:
        """Topologically order the proto nodes (ties broken by key) and renumber."""
        n = len(self.nodes)
        preds = [set() for _ in range(n)]
        for v in self.nodes:
            for r in v.refs():
                preds[v.id].add(r.node)
            preds[v.id].update(v.deps)
        # RNG ops keep their order (the graph's RNG edges follow node ids): a
        # dependency the split adds (a packed mask drawn after the last is packed)
        # must not let a later draw take an earlier one's place.
        rng = sorted((self.keys[v.id], v.id) for v in self.nodes if v.rng)
        for (_, a), (_, b) in zip(rng, rng[1:]):
            preds[b].add(a)
        succs = [[] for _ in range(n)]
        for v in range(n):
            for p in preds[v]:
                succs[p].append(v)
        indeg = [len(p) for p in preds]
        heap = [(self.keys[v], v) for v in range(n) if indeg[v] == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            _, v = heapq.heappop(heap)
            order.append(v)
            for w in succs[v]:
                indeg[w] -= 1
                if indeg[w] == 0:
                    heapq.heappush(heap, (self.keys[w], w))
        if len(order) != n:
            raise RuntimeError("fission produced a cyclic graph (please report this)")
        new = {old: i for i, old in enumerate(order)}
        remap = lambda r, _k: Ref(new[r.node], r.out)
        out_nodes = []
        for old in order:
            v = self.nodes[old]
            v.id = new[old]
            v.args = map_refs(v.args, remap)
            v.kwargs = map_refs(v.kwargs, remap)
            v.deps = tuple(sorted(new[d] for d in v.deps))
            v.outputs = [None if t is None else dataclasses.replace(
                t, alias=None if t.alias is None else Ref(new[t.alias.node], t.alias.out))
                for t in v.outputs]
            out_nodes.append(v)
        return Graph(out_nodes, [Ref(new[r.node], r.out) for r in outputs], roles)


# -- what the expansions of split regions (apply.py, spatial.py) share ---------------

def itemsize(t: TensorInfo) -> int:
    try:
        return torch.empty((), dtype=t.dtype).element_size()
    except Exception:  # noqa: BLE001
        n = math.prod(t.shape)
        return t.nbytes // n if n else 4


def tensor_info(shape, like: TensorInfo, alias: Ref | None = None, stride=None) -> TensorInfo:
    """A new node's output: ``like``'s dtype at ``shape``; a view of ``alias`` owns no bytes."""
    shape = tuple(shape)
    nbytes = 0 if alias is not None else math.prod(shape) * itemsize(like)
    return TensorInfo(shape, like.dtype, nbytes, alias, None if stride is None else tuple(stride))


def full_stride(t: TensorInfo) -> tuple[int, ...]:
    """The strides of the full-size result a region output is assembled into
    (DESIGN.md §11 "Layout is semantics": the views outside the region were
    traced against the original's strides). The original's when they are dense
    (a transposed or permuted layout: ``scaled_dot_product_attention``'s output);
    for a layout with gaps or overlaps (an expanded or sliced original), dense
    strides with the dims in the original's order (an expanded dim where a
    contiguous layout has it), since the parts are written into it (``copy_``
    cannot write overlapping elements) and every view valid on the original is
    valid on those; contiguous when the graph does not know."""
    shape = tuple(t.shape)
    if t.stride is None or len(t.stride) != len(shape):
        return tuple(contiguous(shape))
    stride = tuple(t.stride)
    expect = 1
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1):
        if st != expect:
            break
        expect *= sz
    else:
        return stride
    # an expanded dim (stride 0) sits where a contiguous layout puts it
    eff = list(stride)
    for d in reversed(range(len(shape))):
        if eff[d] == 0:
            eff[d] = eff[d + 1] * shape[d + 1] if d + 1 < len(shape) else 1
    order = sorted(range(len(shape)), key=lambda d: (-eff[d], d))   # outermost first
    out, acc = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = acc
        acc *= shape[d]
    return tuple(out)


def layout_seen(g: Graph, r: Ref, region: frozenset[int]) -> bool:
    """An op after the region reads output ``r`` (directly or through a view), so
    its strides are part of the program. Otherwise ``r`` is only returned (a weight
    gradient, split along the batch and summed): contiguous is then what eager's
    AccumulateGrad gives, and accumulating into a transposed buffer measured up to
    3x slower per part here."""
    return bool(g.readers().get(g.storage_of(r), set()) - region)


def order_after(b: ProtoBuilder, first: int, prev_last: int) -> None:
    """Order the nodes from ``first`` on that read no node of their own part
    after ``prev_last``, the previous part's last node."""
    for v in range(first, len(b.nodes)):
        node = b.nodes[v]
        inner = any(not isinstance(r, External) and r.node >= first
                    for r in node.refs())
        if not inner:
            node.deps = tuple(node.deps) + (prev_last,)


def full_result(b: "ProtoBuilder", t: TensorInfo, stride, key, name: str, category: str) -> int:
    """An uninitialised full-size tensor like ``t`` with ``stride`` (`full_stride`),
    made before a split region's first part: each part writes its slice of it."""
    kw = {"dtype": t.dtype, "layout": torch.strided, "device": torch.device("cpu"),
          "pin_memory": False}
    info = tensor_info(t.shape, t, stride=stride)
    if tuple(stride) == tuple(contiguous(t.shape)):
        return b.op("aten.empty.memory_format", aten.empty.memory_format, [list(t.shape)], kw,
                    [info], key, name, category)
    return b.op("aten.empty_strided.default", aten.empty_strided.default,
                [list(t.shape), list(stride)], kw, [info], key, name, category)
