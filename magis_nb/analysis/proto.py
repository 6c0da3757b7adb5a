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

from ..ir.build import unique_ident
from ..ir.graph import Graph, Node, Ref, Region, iter_refs, map_refs


class External(Ref):
    """A reference to a tensor of the original graph, resolved after all regions exist."""


def has_external(node: Node) -> bool:
    """``node`` reads or aliases an `External` ref."""
    return any(isinstance(r, External) for r in iter_refs((node.args, node.kwargs))) \
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
            for r in iter_refs((v.args, v.kwargs)):
                preds[v.id].add(r.node)
            preds[v.id].update(v.deps)
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
