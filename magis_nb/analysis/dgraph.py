"""The dimension graph D(G) (paper §4.1) and its connected components.

A D-node is one splittable axis of one op, ("op", node id, axis index), or one dim
of a graph input, ("in", node id, dim). Two D-nodes are linked when a tensor flows
from one op to the next and the producer's axis indexes the very dim of that
tensor that the consumer's axis reads. A connected component is a graph-level
dimension (batch, sequence, heads, channels ...): splitting every op of a region
along the same component keeps the parts independent.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd

from ..ir.graph import Graph, iter_refs
from .dims import OpDims, op_dims


@dataclass
class Component:
    id: int
    axis_of: dict[int, int] = field(default_factory=dict)  # op id -> its one axis here
    ambiguous: set[int] = field(default_factory=set)       # ops with several axes here
    size: int = 0                                          # gcd of the axis sizes
    name: str = ""
    inputs: list[tuple[str, int]] = field(default_factory=list)  # graph-input dims linked

    @property
    def ops(self) -> list[int]:
        return sorted(self.axis_of)


class DGraph:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.dims: dict[int, OpDims | None] = {}
        for n in graph.ops:
            self.dims[n.id] = _rule(graph, n)
        parent: dict[tuple, tuple] = {}

        def find(x):
            parent.setdefault(x, x)
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        def union(a, b):
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)

        out_axis: dict[tuple[int, int, int], int] = {}  # (op, out, dim) -> axis
        for v, d in self.dims.items():
            for a, ax in enumerate(d.axes if d else ()):
                find(("op", v, a))
                for (o, dim) in ax.outputs:
                    out_axis[(v, o, dim)] = a
        for v, d in self.dims.items():
            if d is None:
                continue
            refs = list(iter_refs((graph.nodes[v].args, graph.nodes[v].kwargs)))
            for a, ax in enumerate(d.axes):
                for (k, dim) in ax.inputs:
                    r = refs[k]
                    src = graph.nodes[r.node]
                    if src.kind == "input":
                        union(("op", v, a), ("in", r.node, dim))
                    elif (r.node, r.out, dim) in out_axis:
                        union(("op", v, a), ("op", r.node, out_axis[(r.node, r.out, dim)]))
        groups: dict[tuple, Component] = {}
        linked: dict[tuple, list[tuple[str, int]]] = {}
        for x in sorted(parent):
            if x[0] == "in":
                linked.setdefault(find(x), []).append((graph.nodes[x[1]].name, x[2]))
        for x in sorted(parent):
            if x[0] != "op":
                continue
            root = find(x)
            comp = groups.setdefault(root, Component(-1))
            _, v, a = x
            if v in comp.axis_of or v in comp.ambiguous:
                comp.ambiguous.add(v)
                comp.axis_of.pop(v, None)
            else:
                comp.axis_of[v] = a
        for root, comp in groups.items():
            comp.inputs = linked.get(root, [])
        comps = [c for c in groups.values() if c.axis_of]
        comps.sort(key=lambda c: (-len(c.axis_of), min(c.axis_of)))
        self.components: list[Component] = []
        for i, c in enumerate(comps):
            c.id = i
            sizes = [self.dims[v].axes[a].size for v, a in c.axis_of.items()]
            c.size = 0
            for s in sizes:
                c.size = gcd(c.size, s)
            # Named after the data dim it splits ("x0[1]": dim 1 of the first user
            # input -- batch is usually x0[0]), else a weight's dim, else its length.
            data = [f"{n}[{d}]" for n, d in c.inputs if n.startswith("x")]
            weights = [f"{n}[{d}]" for n, d in c.inputs if not n.startswith("x")]
            c.name = (data or weights or [f"len{c.size}"])[0]
            self.components.append(c)

    def axis(self, v: int, comp: int):
        return self.dims[v].axes[self.components[comp].axis_of[v]]

    def summary(self) -> list[dict]:
        return [{"id": c.id, "name": c.name, "ops": len(c.axis_of), "size": c.size}
                for c in self.components]


def _rule(graph: Graph, n) -> OpDims | None:
    """A rule that raises is treated as no rule: an unknown op is a barrier."""
    if n.deps:  # ordered after other ops (a split region's join): never split again
        return None  # (RNG ops get no rule from op_dims itself)
    try:
        ins = [graph.tensor(r).shape for r in iter_refs((n.args, n.kwargs))]
        outs = [t.shape if t is not None else None for t in n.outputs]
        return op_dims(n, ins, outs)
    except Exception:  # noqa: BLE001
        return None
