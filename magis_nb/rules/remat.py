"""Re-materialization and de-re-materialization (paper §5.2) as graph rewrites.

``rematerialize(g, a, users)``: the ``users`` of op ``a`` read a recomputed copy
``a'`` instead, inserted just before the first of them. ``a``'s outputs can then
die after its other users, and ``a'`` is alive only around the late users: the
scheduler decides exactly when. ``merge_recompute`` is the inverse (merge two ops
of the same kind with the same inputs); remat followed by it restores the digest.

A remat may carry a *chain*: ancestors of ``a`` recomputed with it, so that the
copy reads only tensors that are alive anyway (`chain_to_live`). Attention's
softmax is recomputed from the saved q and k through bmm, view, scale and mask;
a conv block's ReLU from the saved conv output through BatchNorm. The chain's
copies live only while ``a``'s copy is computed.

Never recomputed: RNG ops (a recompute would draw a new dropout mask and train a
different model), ops that write into an input, and ops inside a fission region.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Iterable

import torch

from ..ir.graph import Graph, Node, Ref, iter_refs, map_refs
from ..ir.passes import Rewriter, prune_dead_views, writes_into_input
from .redirect import Redirect


_WRITTEN: "weakref.WeakKeyDictionary[Graph, dict[Ref, str]]" = weakref.WeakKeyDictionary()


def written_in_place(g: Graph) -> dict[Ref, str]:
    """Base tensors that some op writes into -> that op's name (once per graph:
    the search asks it of the same graph for every candidate)."""
    if g in _WRITTEN:
        return _WRITTEN[g]
    out: dict[Ref, str] = {}
    for m in g.ops:
        if not writes_into_input(m):
            continue
        for i, arg in enumerate(m.op._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            val = m.args[i] if i < len(m.args) else m.kwargs.get(arg.name)
            for r in iter_refs(val):
                out.setdefault(g.storage_of(r), m.name)
    _WRITTEN[g] = out
    return out


def can_rematerialize(g: Graph, a: int) -> str | None:
    """None when op ``a`` may be recomputed, else why not."""
    n = g.nodes[a]
    if n.kind != "op":
        return f"{n.name} is a graph input"
    if n.rng:
        return f"{n.name} draws random numbers"
    if writes_into_input(n) or n.deps or n.region:
        return f"{n.name} writes into a tensor or belongs to a fission region"
    if not isinstance(n.op, torch._ops.OpOverload):
        return f"{n.name} is not an ATen op"
    # An output filled in place later (a dropout mask: empty, then bernoulli_ into
    # it) holds data its producer never computed: a recompute would not have it.
    written = written_in_place(g)
    for i, t in enumerate(n.outputs):
        if t is not None and Ref(a, i) in written:
            return f"{n.name}'s output is written in place by {written[Ref(a, i)]}"
    return None


def chain_to_live(g: Graph, a: int, live, limit: int = 6) -> list[int] | None:
    """Ancestors of op ``a`` to recompute with it so that every tensor the
    recomputation reads is a graph input or has its storage in ``live``
    (a set of base Refs): in topological order, [] when ``a``'s own inputs
    qualify, None when that takes more than ``limit`` ops or an op that cannot
    be recomputed."""
    chain: set[int] = set()
    todo = [a]
    while todo:
        v = todo.pop()
        n = g.nodes[v]
        for r in iter_refs((n.args, n.kwargs)):
            base = g.storage_of(r)
            if g.nodes[base.node].kind == "input" or base in live or r.node in chain:
                continue
            if can_rematerialize(g, r.node) is not None or len(chain) >= limit:
                return None
            chain.add(r.node)
            todo.append(r.node)
    return sorted(chain)          # node ids are a topological order


def rematerialize(g: Graph, a: int, users: Iterable[int], chain: Iterable[int] = ()) -> Graph:
    return rematerialize_all(g, [(a, users, chain)])


def rematerialize_all(g: Graph, specs: Iterable[tuple]) -> Graph:
    """Several remats (op, users[, chain]) in one pass: the same result as
    applying `rematerialize` to each in turn, without rebuilding the graph each
    time. ``chain``: ancestors recomputed first, in topological order (see
    `chain_to_live`); the copy of ``a`` reads their copies."""
    specs = [(s[0], set(s[1]), tuple(s[2]) if len(s) > 2 else ()) for s in specs]
    if len({a for a, _, _ in specs}) != len(specs):
        raise ValueError("an op is rematerialized twice in one batch")
    outs: list[list[Ref]] = []
    rd = g.readers()
    for a, users, chain in specs:
        for c in chain + (a,):
            why = can_rematerialize(g, c)
            if why:
                raise ValueError(f"cannot rematerialize: {why}")
        if list(chain) != sorted(chain) or (chain and chain[-1] >= a):
            raise ValueError("a chain lists ancestors of the op in topological order")
        src = g.nodes[a]
        outs_of_a = [Ref(a, i) for i, t in enumerate(src.outputs) if t is not None]
        if not users or not users <= set().union(*(rd.get(r, set()) for r in outs_of_a)):
            raise ValueError(f"users must read {src.name}'s outputs (directly or through views)")
        outs.append(outs_of_a)
    by_first: dict[int, list[int]] = {}
    by_user: dict[int, list[int]] = {}
    for k, (a, users, _) in enumerate(specs):
        by_first.setdefault(min(users), []).append(k)
        for u in users:
            by_user.setdefault(u, []).append(k)
    copy_of: list[dict[Ref, Ref]] = [{} for _ in specs]
    # Views of a's outputs that users read are rebuilt on the copy's outputs.
    redirect = Redirect(g, [r for o in outs for r in o if g.tensor(r).alias is None])

    def rule(rw: Rewriter, n: Node) -> bool:
        for k in by_first.get(n.id, ()):
            a, _, chain = specs[k]
            made: dict[Ref, Ref] = {}       # chain outputs -> their copies

            def fix(r: Ref, *rest) -> Ref:
                return made[r] if r in made else rw.fix(r, *rest)

            for v in chain + (a,):
                src = g.nodes[v]
                new_outs = [None if t is None else dataclasses.replace(
                    t, alias=None if t.alias is None else fix(t.alias)) for t in src.outputs]
                cid = rw.add(src.name + "_re", src.target, src.op, map_refs(src.args, fix),
                             map_refs(src.kwargs, fix), new_outs, src.category)
                rw.nodes[cid].multi = src.multi
                made.update({Ref(v, i): Ref(cid, i) for i in range(len(src.outputs))})
            copy_of[k].update({r: made[r] for r in outs[k]})
        if n.id in by_user:
            mine: dict[Ref, Ref] = {}
            for k in by_user[n.id]:
                mine.update(copy_of[k])
            redirect.copy(rw, n, mine)
            return True
        return False

    return prune_dead_views(Rewriter(g).run(rule))


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
