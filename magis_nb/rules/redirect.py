"""Redirect readers of a tensor, directly or through views, to a replacement.

Swap and remat give some readers of tensor ``a`` a new copy of it (loaded back,
or recomputed). A reader may see ``a`` through views (the backward reads saved
activations through ``detach``): those views are rebuilt on the copy, so that
``a``'s storage is no longer read after its remaining readers.
"""
from __future__ import annotations

import dataclasses

from ..ir.graph import Graph, Node, Ref
from ..ir.passes import Rewriter


def view_chain(g: Graph, r: Ref, base: Ref) -> list[Ref]:
    """The views from ``base`` to ``r`` (``r`` last), following alias links."""
    chain = []
    while r != base:
        chain.append(r)
        t = g.tensor(r)
        if t.alias is None:
            raise ValueError(f"{g.nodes[r.node].name} is not a view of {g.nodes[base.node].name}")
        r = t.alias
    return chain[::-1]


class Redirect:
    """Inside a Rewriter rule: copy node ``n`` so that its reads of the tensors in
    ``bases`` (or of views of them) go to their replacements (or to the same views
    rebuilt on them)."""

    def __init__(self, g: Graph, bases):
        self.g, self.bases = g, set(bases)
        self.rebuilt: dict[Ref, Ref] = {}

    def _on(self, rw: Rewriter, r: Ref, copy: Ref) -> Ref:
        prev = copy
        for v in view_chain(self.g, r, self.g.storage_of(r)):
            if v not in self.rebuilt:
                vn = self.g.nodes[v.node]
                alias = self.g.tensor(v).alias
                args = tuple(prev if x == alias else rw.fix(x) if isinstance(x, Ref) else x
                             for x in vn.args)
                # every output of the view op, each a view of the copy (split,
                # unbind and chunk return several): output k stays output k
                infos = [None if t is None else dataclasses.replace(t, alias=prev)
                         for t in vn.outputs]
                nid = rw.add(vn.name + "_re", vn.target, vn.op, args, dict(vn.kwargs), infos,
                             vn.category)
                rw.nodes[nid].multi = vn.multi
                rw.nodes[nid].region = vn.region    # a part's view stays in its part
                for k, t in enumerate(vn.outputs):
                    if t is not None:
                        self.rebuilt.setdefault(Ref(v.node, k), Ref(nid, k))
            prev = self.rebuilt[v]
        return prev

    def copy(self, rw: Rewriter, n: Node, copy_of: dict[Ref, Ref]) -> None:
        """``copy_of`` maps each base (and any other replaced tensor) to its copy."""
        mine = {r for r in n.refs()
                if self.g.storage_of(r) in copy_of or r in copy_of}
        saved = {r: rw.remap.get(r) for r in mine}
        for r in mine:
            rw.remap[r] = copy_of[r] if r in copy_of else self._on(rw, r, copy_of[self.g.storage_of(r)])
        rw.copy(n)
        for r, v in saved.items():
            if v is None:
                del rw.remap[r]
            else:
                rw.remap[r] = v
