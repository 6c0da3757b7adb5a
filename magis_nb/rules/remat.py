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

Note [BatchNorm recomputed from its statistics]
A training BatchNorm's recompute does not run the training op again: its copy
normalizes with the batch statistics the original saved for its backward
(``save_mean``, ``save_invstd``), through the eval-mode kernel
(``_native_batch_norm_legit_no_training``; the variance it wants is
``save_invstd ** -2`` with eps 0). The statistics are not reduced again and the
running statistics are not updated twice: the copy's other outputs are the
original's. On this CPU the normalize takes 0.29 ms where the training op takes
2.48 ms ([16, 8, 128, 128] fp32; outputs within 1e-6), so recomputing a conv
block's BatchNorm and ReLU costs a fifth of what it did. `recompute_graph` is
the same copy alone, for pricing a remat before it is applied.

Note [recomputed from a loaded copy]
A recompute may start from a swapped tensor: its copy reads the tensor's Load,
not the original (which the swap lets die after its last reader before the
peak). Where the Load came after the recompute in node order, it is moved up
to just before it, and the swap's other readers read it from there: a conv
block's ReLU is remade from its conv output's loaded copy, so the ReLU output
need not be swapped too (paper U-Net at lat 1.10 swapped both, and the copy
stream is what a latency budget runs out of first).

Never recomputed: RNG ops (a recompute would draw a new dropout mask and train a
different model) and ops that write into an input. An op of a split fission
region is recomputed for readers in its own part only (Note [rewrites inside
the parts] in `search.space`); its copy belongs to that part.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from ..ir.graph import Graph, Node, Ref, Region, TensorInfo, iter_refs, map_refs
from ..ir.passes import Rewriter, prune_dead_views, writes_into_input, written_in_place
from ..simulate.cost import is_training_batch_norm
from .redirect import Redirect
from .swap import is_load, rd_region


def can_rematerialize(g: Graph, a: int) -> str | None:
    """None when op ``a`` may be recomputed, else why not."""
    n = g.nodes[a]
    if n.kind != "op":
        return f"{n.name} is a graph input"
    if n.rng:
        return f"{n.name} draws random numbers"
    if writes_into_input(n):
        return f"{n.name} writes into a tensor"
    # A split region's part ops carry deps that only order the parts
    # (`proto.order_after`); their copy reads the part's own tensors, so it
    # runs after them anyway. Elsewhere deps order in-place writes.
    if n.deps and not isinstance(n.region, Region):
        return f"{n.name} is ordered after an in-place write"
    if not isinstance(n.op, torch._ops.OpOverload):
        return f"{n.name} is not an ATen op"
    # An output filled in place later (a dropout mask: empty, then bernoulli_ into
    # it) holds data its producer never computed: a recompute would not have it.
    written = written_in_place(g)
    for i, t in enumerate(n.outputs):
        if t is not None and Ref(a, i) in written:
            return f"{n.name}'s output is written in place by {written[Ref(a, i)]}"
    if isinstance(n.region, Region):
        # Parts add into full-size sums in place (`add_`, `addmm_`): a copy run
        # later than the original would read a sum that has moved on.
        for r in n.refs():
            if g.storage_of(r) in written:
                return f"{n.name} reads {g.nodes[r.node].name}, written in place"
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
        for r in n.refs():
            base = g.storage_of(r)
            if g.nodes[base.node].kind == "input" or base in live or r.node in chain:
                continue
            if can_rematerialize(g, r.node) is not None or len(chain) >= limit:
                return None
            chain.add(r.node)
            todo.append(r.node)
    return sorted(chain)          # node ids are a topological order


_NORMALIZE = torch.ops.aten._native_batch_norm_legit_no_training.default
_POW = torch.ops.aten.pow.Tensor_Scalar


def _add_normalize(rw: Rewriter, src: Node, fix) -> dict[Ref, Ref]:
    """``src``'s recompute (a training BatchNorm) added to ``rw``: the variance
    from the saved inverse std, then the eval-mode normalize. ``fix`` maps the
    original's input refs. Returns src's output refs -> the copy's (the saved
    statistics and running statistics stay the original's)."""
    x, w, b = (fix(r) if isinstance(r, Ref) else r for r in src.args[:3])
    mean, invstd = fix(Ref(src.id, 1)), fix(Ref(src.id, 2))
    it = rw.nodes[invstd.node].outputs[invstd.out]
    var = rw.add(src.name + "_var", "aten.pow.Tensor_Scalar", _POW, (invstd, -2), {},
                 [TensorInfo(it.shape, it.dtype, it.nbytes, device=it.device)], src.category)
    out = src.outputs[0]
    empty = TensorInfo((0,), it.dtype, 0, device=it.device)
    nid = rw.add(src.name + "_re", "aten._native_batch_norm_legit_no_training.default", _NORMALIZE,
                 (x, w, b, mean, Ref(var, 0), float(src.args[-2]), 0.0), {},
                 [TensorInfo(out.shape, out.dtype, out.nbytes, device=out.device), empty, empty],
                 src.category)
    rw.nodes[nid].multi = True
    made = {Ref(src.id, i): fix(Ref(src.id, i)) for i in range(1, len(src.outputs))}
    made[Ref(src.id, 0)] = Ref(nid, 0)
    return made


def swapped_copies(g: Graph) -> dict[Ref, int]:
    """Swapped tensors -> their Load (node id)."""
    out = {}
    for n in g.ops:
        if is_load(g, n.id):
            out[g.nodes[n.args[0].node].args[1]] = n.id
    return out


def recompute_graph(g: Graph, v: int) -> Graph | None:
    """The ops op ``v``'s recompute runs, alone in a graph of their inputs (for
    pricing it), when they are not ``v`` itself; else None."""
    src = g.nodes[v]
    if not is_training_batch_norm(src):
        return None
    rw = Rewriter(Graph([], [], []))
    rw.taken = set()
    ins: dict[Ref, Ref] = {}
    for r in list(iter_refs(src.args[:3])) + [Ref(v, 1), Ref(v, 2)]:
        t = g.tensor(r)
        nid = len(rw.nodes)
        rw.nodes.append(Node(nid, f"in{nid}", "input", "input",
                             outputs=[dataclasses.replace(t, alias=None)], category="activation"))
        ins[r] = Ref(nid, 0)
    _add_normalize(rw, src, lambda r: ins.get(r, r))
    return Graph(rw.nodes, [], [])


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
    loads = swapped_copies(g)
    hoisted: dict[int, int] = {}        # Load -> its copy made ahead of it

    def loaded(rw: Rewriter, n: Node, a: int, r: Ref) -> Ref | None:
        """Note [recomputed from a loaded copy]: the Load of swapped ``r`` a
        copy of ``a`` made before ``n`` reads, moved up to there if it came later."""
        ld = loads.get(r)
        if ld is None or rd_region(g, ld) != rd_region(g, a) or g.nodes[ld].args[0].node >= n.id:
            return None
        if ld < n.id:
            return rw.fix(Ref(ld, 0))
        if ld not in hoisted:
            src = g.nodes[ld]
            nid = rw.add(src.name, src.target, src.op, map_refs(src.args, rw.fix), src.kwargs,
                         src.outputs, src.category, keep_name=True)
            rw.nodes[nid].region = src.region
            rw.remap[Ref(ld, 0)] = Ref(nid, 0)
            hoisted[ld] = nid
        return Ref(hoisted[ld], 0)

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id in hoisted:
            return True         # made earlier, for a recompute that reads it
        for k in by_first.get(n.id, ()):
            a, _, chain = specs[k]
            made: dict[Ref, Ref] = {}       # chain outputs -> their copies

            def fix(r: Ref, *rest) -> Ref:
                if r in made:
                    return made[r]
                return loaded(rw, n, a, r) or rw.fix(r, *rest)

            start = len(rw.nodes)
            for v in chain + (a,):
                src = g.nodes[v]
                if is_training_batch_norm(src):
                    made.update(_add_normalize(rw, src, fix))
                    continue
                new_outs = [None if t is None else dataclasses.replace(
                    t, alias=None if t.alias is None else fix(t.alias)) for t in src.outputs]
                cid = rw.add(src.name + "_re", src.target, src.op, map_refs(src.args, fix),
                             map_refs(src.kwargs, fix), new_outs, src.category)
                rw.nodes[cid].multi = src.multi
                made.update({Ref(v, i): Ref(cid, i) for i in range(len(src.outputs))})
            for i in range(start, len(rw.nodes)):    # a part's copies are that part's
                rw.nodes[i].region = g.nodes[a].region
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
