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

from ..ir.graph import Graph
from .dims import Axis, OpDims, op_dims


@dataclass
class Component:
    id: int
    axis_of: dict[int, int] = field(default_factory=dict)  # op id -> its one axis here
    ambiguous: set[int] = field(default_factory=set)       # ops with several axes here
    choices: dict[int, list[int]] = field(default_factory=dict)  # ambiguous op -> its axes here
    size: int = 0                                          # gcd of the axis sizes
    name: str = ""
    inputs: list[tuple[str, int]] = field(default_factory=list)  # graph-input dims linked

    @property
    def ops(self) -> list[int]:
        """Every op with an axis here; an ambiguous one gets its axis per region
        (Note [ambiguous ops])."""
        return sorted(set(self.axis_of) | set(self.choices))


class DGraph:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.dims: dict[int, OpDims | None] = {}
        self._resolved: dict[tuple, dict[int, int] | str] = {}
        for n in graph.ops:
            self.dims[n.id] = _rule(graph, n)
        _carry_blocks(graph, self.dims)
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
            refs = list(graph.nodes[v].refs())
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
        # A dim in blocks is (dim, block) (Note [blocked dims] in dims.py), next
        # to plain ints: a graph input viewed both ways has keys of both kinds
        # (LeViT's attention reshapes its input in blocks), so they sort as tuples.
        keys = sorted(parent, key=lambda x: x[:2] + (x[2] if isinstance(x[2], tuple) else (x[2],),))
        for x in keys:
            if x[0] == "in":
                linked.setdefault(find(x), []).append((graph.nodes[x[1]].name, x[2]))
        for x in keys:
            if x[0] != "op":
                continue
            root = find(x)
            comp = groups.setdefault(root, Component(-1))
            _, v, a = x
            if v in comp.axis_of or v in comp.ambiguous:
                comp.ambiguous.add(v)
                first = comp.axis_of.pop(v, None)
                comp.choices.setdefault(v, [] if first is None else [first]).append(a)
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
            data = [f"{n}[{_dim_label(d)}]" for n, d in c.inputs if n.startswith("x")]
            weights = [f"{n}[{_dim_label(d)}]" for n, d in c.inputs if not n.startswith("x")]
            c.name = (data or weights or [f"len{c.size}"])[0]
            self.components.append(c)

    def axis(self, v: int, comp: int, ops=None):
        """Op ``v``'s axis in component ``comp``; for an ambiguous op, the one it
        takes in region ``ops`` (Note [ambiguous ops])."""
        c = self.components[comp]
        if v in c.axis_of:
            return self.dims[v].axes[c.axis_of[v]]
        if ops is None:
            raise KeyError(f"op {v} has several axes in dimension {comp}: name the region")
        got = self.region_axes(ops, comp)
        if isinstance(got, str):
            raise ValueError(got)
        return self.dims[v].axes[got[v]]

    def axis_index(self, v: int, comp: int, ops) -> int:
        c = self.components[comp]
        return c.axis_of[v] if v in c.axis_of else self.region_axes(ops, comp)[v]

    def region_axes(self, ops, comp: int) -> dict[int, int] | str:
        """Note [ambiguous ops]: an op can have two axes in one component -- the
        query and the key positions of attention scores both come from the
        sequence dim of one tensor (``q @ k.T``, the mask, ``probs @ v`` and their
        backward). Splitting such an op is still exact along one of them when the
        region fixes which: its inputs made inside the region arrive split along
        some dim, its outputs read inside the region leave split along some dim,
        and exactly one of its axes slices and produces those. (With the
        projections of k and v outside the region, that is the query axis: k and
        v are read whole.) The choice is made by propagation to a fixed point (an
        op nothing pins down takes its first axis); an op left with no
        consistent axis makes the region invalid (the reason is returned as a
        string). `ftree` prunes a candidate region until its choices agree."""
        key = (frozenset(ops), comp)
        hit = self._resolved.get(key)
        if hit is not None:
            return hit
        c = self.components[comp]
        chosen = {v: c.axis_of[v] for v in key[0] if v in c.axis_of}
        left = {v: list(c.choices[v]) for v in key[0] if v in c.choices}
        g = self.graph
        res: dict[int, int] | str
        while left:
            progress = False
            for v in sorted(left):
                ok = [a for a in left[v] if self._fits(v, a, key[0], chosen)]
                left[v] = ok
                if len(ok) == 1:
                    chosen[v] = ok[0]
                    del left[v]
                    progress = True
                elif not ok:
                    res = f"{g.nodes[v].name} has no axis in dimension {comp} that fits the region"
                    self._resolved[key] = res
                    return res
            if not progress:    # nothing pins it down: its first axis (check() verifies)
                v = min(left)
                chosen[v] = left.pop(v)[0]
        self._resolved[key] = chosen
        return chosen

    def _fits(self, v: int, a: int, ops: frozenset, chosen: dict[int, int]) -> bool:
        """Axis ``a`` of op ``v`` agrees with the chosen axes of its neighbours in ``ops``."""
        g = self.graph
        ax = self.dims[v].axes[a]
        sliced = dict(ax.inputs)
        for k, r in enumerate(g.nodes[v].refs()):
            if r.node in ops and r.node in chosen:
                pax = self.dims[r.node].axes[chosen[r.node]]
                dims = [d for o, d in pax.outputs if o == r.out]
                if not dims or sliced.get(k) != dims[0]:
                    return False
        outs = {}
        for o, d in ax.outputs:
            outs.setdefault(o, d)
        for w in g.succs(v):
            if w not in ops or w not in chosen:
                continue
            wax = self.dims[w].axes[chosen[w]]
            wsl = dict(wax.inputs)
            for k, r in enumerate(g.nodes[w].refs()):
                if r.node == v and wsl.get(k) != outs.get(r.out):
                    return False
        return True

    def summary(self) -> list[dict]:
        return [{"id": c.id, "name": c.name, "ops": len(c.axis_of), "size": c.size}
                for c in self.components]


def _rule(graph: Graph, n) -> OpDims | None:
    """A rule that raises is treated as no rule: an unknown op is a barrier."""
    if n.deps:  # ordered after other ops (a split region's join): never split again
        return None  # (RNG ops get no rule from op_dims itself)
    try:
        ins = [graph.tensor(r).shape for r in n.refs()]
        outs = [t.shape if t is not None else None for t in n.outputs]
        return op_dims(n, ins, outs)
    except Exception:  # noqa: BLE001
        return None


def _dim_label(d) -> str:
    """A dim in a component's name: ``2``, or ``0:16`` for dim 0 in blocks of 16."""
    return f"{d[0]}:{d[1]}" if isinstance(d, tuple) else str(d)


def _carry_blocks(graph: Graph, dims: dict[int, OpDims | None]) -> None:
    """Note [blocked dims] in dims.py: where an op reads a dim its producer splits
    in blocks, and one of its axes treats that dim's positions alike (every dim
    it lists is as long as the axis), the op gets the same axis with every
    listed dim in those blocks (`OpDims.origin` names the axis it repeats).
    In topological order, so blocks carry on down a chain of such ops.
    Attention is left out: a causal part's mask rows follow its query offset."""
    pos = graph.topo_position()
    for v in sorted(dims, key=pos.__getitem__):
        od = dims[v]
        node = graph.nodes[v]
        if od is None or not od.axes or "scaled_dot_product" in node.target:
            continue
        refs = list(node.refs())
        shapes = {("in", k): graph.tensor(r).shape for k, r in enumerate(refs)}
        shapes.update({("out", o): t.shape for o, t in enumerate(node.outputs) if t is not None})
        have = {x for a in od.axes for x in a.inputs}
        for k, r in enumerate(refs):
            pd = dims.get(r.node)
            blocks = sorted({d for a in (pd.axes if pd else ()) for o, d in a.outputs
                             if o == r.out and isinstance(d, tuple)})
            for d, blk in blocks:
                if (k, (d, blk)) in have:
                    continue
                for ai, a in enumerate(list(od.axes)):
                    if ai in od.origin or (k, d) not in a.inputs:
                        continue
                    listed = [("in", j, dj) for j, dj in a.inputs] + [("out", o, do) for o, do in a.outputs]
                    if not all(isinstance(x, int) and shapes.get((w, t), ())[x:x + 1] == (a.size,)
                               for w, t, x in listed):
                        continue
                    new = Axis(blk, tuple((j, (dj, blk)) for j, dj in a.inputs),
                               tuple((o, (do, blk)) for o, do in a.outputs), a.combine, a.name)
                    od.origin[len(od.axes)] = ai
                    od.axes.append(new)
                    have |= set(new.inputs)
                    break

