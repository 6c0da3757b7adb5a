"""Pricing the TASO subset for the search: merges of matmuls sharing an input
and scale sinks whose own ops cost less by the cost model, all together and the
best one alone. The state's simulated latency and peak then decide, like every
other child."""
from __future__ import annotations

from ..ir.graph import iter_refs
from ..rules.algebra import merge_all, merge_groups
from ..rules.scale import sink_all, sink_sites
from .space import Merge, Sink, Space, State


def product_of(g, name: str) -> str:
    """The op whose output a scale reads through views (a Sink's product)."""
    n = next((m for m in g.nodes if m.name == name), None)
    if n is None:
        return name
    r = n.args[0]
    while g.tensor(r).alias is not None:
        r = g.tensor(r).alias
    return g.nodes[r.node].name


class AlgebraGains:
    """(seconds saved by the rewritten ops, kind, spec) of every merge and sink on
    a plan's fission graph that saves time, best first; priced once per plan
    (every state of a plan shares its fission graph)."""

    def __init__(self, space: Space):
        self.space = space
        self._by_plan: dict[tuple, list[tuple[float, str, object]]] = {}

    def of(self, plan: tuple) -> list[tuple[float, str, object]]:
        if plan not in self._by_plan:
            self._by_plan[plan] = self._price(plan)
        return self._by_plan[plan]

    def _price(self, plan: tuple) -> list[tuple[float, str, object]]:
        g = self.space.fission_graph(plan)
        of = self.space.costs.of
        out = []
        groups = merge_groups(g)
        if groups:
            g2 = merge_all(g, groups)
            ids = {n.name: n.id for n in g2.nodes}
            for gr in groups:
                merged = g2.nodes[ids[g.nodes[gr[0]].name]].args[0].node   # a slice of it
                new = [merged] + [r.node for r in iter_refs(g2.nodes[merged].args)
                                  if g2.nodes[r.node].target == "aten.cat.default"]
                saved = sum(of(g, i) for i in gr) - sum(of(g2, i) for i in new)
                out.append((saved, "merge", Merge(tuple(g.nodes[i].name for i in gr))))
        sites = sink_sites(g)
        ids_g = {n.name: n.id for n in g.nodes}
        if sites:
            g2 = sink_all(g, sites)
            ids = {n.name: n.id for n in g2.nodes}
            for d in sites:
                old = [d, ids_g[product_of(g, g.nodes[d].name)]]
                new = [ids[g.nodes[i].name] for i in old]
                saved = sum(of(g, i) for i in old) - sum(of(g2, i) for i in new)
                out.append((saved, "sink", Sink(g.nodes[d].name)))
        return sorted((t for t in out if t[0] > 0), key=lambda t: (-t[0], t[1], t[2]))

    def children(self, st: State) -> list[tuple[str, list]]:
        """(kind, specs) children: every saving rewrite of a kind at once, and the
        best alone."""
        if not self.space.algebra:
            return []
        done = {s for b in st.batches if b.kind in ("merge", "sink") for s in b.specs}
        out = []
        for kind in ("merge", "sink"):
            cand = [s for _, k, s in self.of(st.plan) if k == kind and s not in done]
            if len(cand) > 1:
                out.append((f"{kind}x{len(cand)}", cand))
            if cand:
                out.append((kind, cand[:1]))
        return out
