"""BatchNorm's phases fused back into ATen's kernels where a plan runs them whole.

Note [whole phases run as one kernel]
A training BatchNorm is captured in phases (Note [BatchNorm in phases] in
phased_norm.py) so that fission can split a region between them. Where a plan
splits no region through a BatchNorm, its phases run whole: four ops forward
(bn_stats, bn_finalize, bn_running, bn_elemt) and three backward
(bn_backward_reduce, bn_backward_elemt, bn_backward_affine) doing what ATen's
training kernels do in one each, with a Python call and a few small tensors per
op (the tiny BN U-Net's unoptimized program ran x1.046 of eager's time on this
CPU, x1.003-1.017 with ATen's op; on a GPU, a dozen small kernels for one).
`fuse_whole_phases` puts the kernels back into a finished plan: the forward
group becomes ``_native_batch_norm_legit_functional`` at bn_elemt's place in the
order, the backward group ``native_batch_norm_backward`` at bn_backward_elemt's,
their outputs the TensorInfos the capture gave the original ops. A group is
fused only when it is whole (no op of it in a split region), its statistics
read by nothing else, and everything that reads what it makes runs after the
place it moves to; recomputed copies of the normalize (remat) stay, reading the
fused op's saved statistics. The caller re-simulates the plan and keeps the
fused one only where it is no higher and no slower.
"""
from __future__ import annotations

import torch

from .graph import Graph, Node, Ref
from .passes import Rewriter
from .phased_norm import target

aten = torch.ops.aten
_STATS, _FIN, _RUN, _ELEMT = (target(n) for n in ("bn_stats", "bn_finalize", "bn_running",
                                                  "bn_elemt"))
_REDUCE, _BELEMT, _AFFINE = (target(n) for n in ("bn_backward_reduce", "bn_backward_elemt",
                                                 "bn_backward_affine"))


def _groups(g: Graph, order: list[int]) -> tuple[dict[int, tuple], dict[int, tuple]]:
    """Forward groups {bn_elemt id: (stats, finalize, running)} and backward
    groups {bn_backward_elemt id: (reduce, affine or None, [affine's outputs read])}
    that can be fused."""
    pos = {v: i for i, v in enumerate(order)}
    returned = {r.node for r in g.outputs}
    waited = {d for n in g.nodes for d in n.deps}
    ok = lambda v: not g.nodes[v].region and v in pos and v not in waited  # noqa: E731
    # the readers of an op nothing waits for (the phase ops asked about are
    # not RNG ops): its successors, which the graph keeps
    rd = lambda v: set(g.succs(v))  # noqa: E731

    def after(v: int, at: int) -> bool:
        # what reads v runs after ``at`` (where v's outputs will be made)
        return all(w == at or (pos.get(w, -1) > pos[at] and w > at) for w in rd(v))

    fwd, bwd = {}, {}
    for s in g.ops:
        if s.target == _STATS and ok(s.id):
            users = rd(s.id)
            fin = [w for w in users if g.nodes[w].target == _FIN]
            run = [w for w in users if g.nodes[w].target == _RUN]
            if len(fin) != 1 or len(run) != 1 or users != {fin[0], run[0]}:
                continue
            f, r = fin[0], run[0]
            elemts = sorted((w for w in rd(f) if g.nodes[w].target == _ELEMT
                             and w in pos and g.nodes[w].refs()[0] == s.refs()[0]),
                            key=pos.__getitem__)
            if not elemts:
                continue
            e = elemts[0]
            if ok(f) and ok(r) and ok(e) and f not in returned and s.id not in returned \
                    and isinstance(g.nodes[r].args[4], float) and after(f, e) and after(r, e):
                fwd[e] = (s.id, f, r)
        elif s.target == _REDUCE and ok(s.id) and s.id not in returned:
            users = rd(s.id)
            el = [w for w in users if g.nodes[w].target == _BELEMT]
            af = [w for w in users if g.nodes[w].target == _AFFINE]
            if len(el) != 1 or len(af) > 1 or users != set(el) | set(af) or not ok(el[0]):
                continue
            e, a = el[0], (af[0] if af else None)
            if a is not None and not (ok(a) and after(a, e)):
                continue
            used = [a is not None and (Ref(a, i) in g.outputs or any(
                r == Ref(a, i) for u in rd(a) for r in g.nodes[u].refs())) for i in (0, 1)]
            bwd[e] = (s.id, a, used)
    return fwd, bwd


def fuse_whole_phases(g: Graph, order: list[int]) -> tuple[Graph, list[int]] | None:
    """Note [whole phases run as one kernel]: ``(graph, order)`` with every
    fusable BatchNorm group as ATen's op, or None when there is none."""
    fwd, bwd = _groups(g, order)
    if not fwd and not bwd:
        return None
    drop = {v for s, f, r in fwd.values() for v in (s, f, r)}
    drop |= {v for red, a, _ in bwd.values() for v in (red, a) if v is not None}
    fix = lambda rw, v: rw.fix(v) if isinstance(v, Ref) else v  # noqa: E731

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id in drop:
            return True
        if n.id in fwd:
            s, f, r = fwd[n.id]
            run = g.nodes[r]
            args = (n.args[0], n.args[1], n.args[2], run.args[2], run.args[3], True,
                    run.args[4], float(g.nodes[f].args[2]))
            # a name of its own: a multi-output op's results are named
            # <name>_<i>, which another BatchNorm's single result may be called
            nid = rw.add(n.name + "_fused", "aten._native_batch_norm_legit_functional.default",
                         aten._native_batch_norm_legit_functional.default,
                         [fix(rw, v) for v in args], {},
                         [n.outputs[0], *g.nodes[f].outputs, *run.outputs], n.category)
            rw.nodes[nid].multi = True
            for i, src in enumerate([Ref(n.id, 0), Ref(f, 0), Ref(f, 1), Ref(r, 0), Ref(r, 1)]):
                rw.remap[src] = Ref(nid, i)
            return True
        if n.id in bwd:
            _, a, used = bwd[n.id]
            dy, x, w, mean, invstd = n.args[:5]
            outs = [n.outputs[0]] + [g.nodes[a].outputs[i] if used[i] else None for i in (0, 1)]
            # train=True: the saved statistics, not running ones or eps, are read
            args = (dy, x, w, None, None, mean, invstd, True, 0.0, [True, used[0], used[1]])
            nid = rw.add(n.name + "_fused", "aten.native_batch_norm_backward.default",
                         aten.native_batch_norm_backward.default,
                         [fix(rw, v) for v in args], {}, outs, n.category)
            rw.nodes[nid].multi = True
            rw.remap[Ref(n.id, 0)] = Ref(nid, 0)
            for i in (0, 1):
                if used[i]:
                    rw.remap[Ref(a, i)] = Ref(nid, i + 1)
            return True
        return False

    rw = Rewriter(g)
    g2 = rw.run(rule)
    by_name = {n.name: n.id for n in g2.nodes}     # copies keep their names
    new = lambda v: rw.remap[Ref(v, 0)].node if Ref(v, 0) in rw.remap \
        else by_name[g.nodes[v].name]  # noqa: E731
    return g2, [new(v) for v in order if v not in drop]
