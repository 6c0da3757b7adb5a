"""Re-materialization and de-re-materialization (paper §5.2) as graph rewrites.

``rematerialize(g, a, users)``: the ``users`` of op ``a`` read a recomputed copy
``a'`` instead, inserted just before the first of them. ``a``'s outputs can then
die after its other users, and ``a'`` is alive only around the late users: the
scheduler decides exactly when. ``merge_recompute`` is the inverse (merge two ops
of the same kind with the same inputs); remat followed by it restores the digest.

Never recomputed: RNG ops (a recompute would draw a new dropout mask and train a
different model), ops that write into an input, and ops inside a fission region.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from ..ir.graph import Graph, Node, Ref, iter_refs, map_refs
from ..ir.passes import Rewriter


def _mutates(n: Node) -> bool:
    schema = getattr(n.op, "_schema", None)
    return bool(schema) and any(a.alias_info is not None and a.alias_info.is_write
                                for a in schema.arguments)


def can_rematerialize(g: Graph, a: int) -> str | None:
    """None when op ``a`` may be recomputed, else why not."""
    n = g.nodes[a]
    if n.kind != "op":
        return f"{n.name} is a graph input"
    if n.rng:
        return f"{n.name} draws random numbers"
    if _mutates(n) or n.deps or n.region:
        return f"{n.name} writes into a tensor or belongs to a fission region"
    if not isinstance(n.op, torch._ops.OpOverload):
        return f"{n.name} is not an ATen op"
    return None


def rematerialize(g: Graph, a: int, users: Iterable[int]) -> Graph:
    why = can_rematerialize(g, a)
    if why:
        raise ValueError(f"cannot rematerialize: {why}")
    users = set(users)
    consumers = {u.id for u in g.nodes
                 if any(r.node == a for r in iter_refs((u.args, u.kwargs)))}
    if not users or not users <= consumers:
        raise ValueError(f"users must be consumers of {g.nodes[a].name}")
    src = g.nodes[a]
    first = min(users)
    copy_of: dict[Ref, Ref] = {}

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id == first:
            fix = rw.fix
            outs = [None if t is None else dataclasses.replace(
                t, alias=None if t.alias is None else fix(t.alias)) for t in src.outputs]
            cid = rw.add(src.name + "_re", src.target, src.op, map_refs(src.args, fix),
                         map_refs(src.kwargs, fix), outs, src.category)
            rw.nodes[cid].multi = src.multi
            copy_of.update({Ref(a, i): Ref(cid, i) for i in range(len(src.outputs))})
        if n.id in users:
            saved = {r: rw.remap.get(r) for r in copy_of}
            rw.remap.update(copy_of)           # this user reads the recomputed copy
            rw.copy(n)
            for r, v in saved.items():
                rw.remap[r] = v
            return True
        return False

    return Rewriter(g).run(rule)


def merge_recompute(g: Graph, a: int, b: int) -> Graph:
    """Users of ``b`` read ``a`` instead and ``b`` is dropped; both must be the same
    op on the same inputs (``a`` before ``b``)."""
    na, nb = g.nodes[a], g.nodes[b]
    if not (a < b and na.target == nb.target and na.args == nb.args and na.kwargs == nb.kwargs):
        raise ValueError(f"{na.name} and {nb.name} are not the same op on the same inputs")

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id == b:
            for i in range(len(n.outputs)):
                rw.remap[Ref(b, i)] = rw.fix(Ref(a, i))
            return True
        return False

    return Rewriter(g).run(rule)
