"""Scalar algebra: move a constant scale of a matmul's product onto its smaller input.

The only scalar algebra in the zoo's training graphs (see rules/algebra.py) is
attention's ``div(view(bmm(q, kᵀ)), sqrt(d))``: it reads and writes a
[B·H, T, T] tensor where ``bmm(div(q, sqrt(d)), kᵀ)`` scales a [B·H, T, d]
one (T/d times fewer bytes: 8x in tiny gpt, 4x in GPT-Neo at T=512). The
product is the same: exactly when the scale is a power of two (as 4.0 is in the
tiny models), to fp rounding otherwise. It drops one T·T-sized activation
from the forward; the peak usually stays (the masked_fill that follows has two
T·T tensors live anyway).

Measured with the RTX 3090 roofline (simulated step latency, peak unchanged):
-2.4% on tiny gpt, -1.8% on paper bert, -0.5% gpt, -0.8% vit, -0.7% btlm.

``sink_scale(g, d)`` rewrites ``d = scale(views(M))`` with ``M = mm/bmm(A, B)``
read by nothing else into ``M' = mm/bmm(scale(A), B)`` (or B, whichever is
smaller) and gives ``d``'s readers the same views of ``M'``. The new scale op
keeps ``d``'s name, ``M'`` keeps ``M``'s. ``lift_scale`` is the inverse and
restores the digest; to find the views again without a record, sink refuses a
``d`` that a view reads.

Not built: the backward's form ``bmm(.., view(div(ds, s)))`` -> ``div(bmm(..,
view(ds)), s)`` (one T·T op becomes two T·d ones), which would also free the
T·T ``div`` output that lives across both gradient bmms.
"""
from __future__ import annotations

import math

from ..ir.graph import Graph, Node, Ref, TensorInfo
from ..ir.passes import Rewriter
from .algebra import direct_readers, is_view
from .remat import written_in_place

SCALES = ("aten.div.Tensor", "aten.mul.Tensor")
PRODUCTS = ("aten.mm.default", "aten.bmm.default")


def _is_scale(n: Node) -> bool:
    return (n.kind == "op" and n.target in SCALES and not n.kwargs and len(n.args) == 2
            and isinstance(n.args[0], Ref) and isinstance(n.args[1], (int, float))
            and not isinstance(n.args[1], bool))


def _chain(g: Graph, r: Ref) -> list[int]:
    """Views from a base up to ``r`` (base first, as node ids; the base included)."""
    out = [r.node]
    while is_view(g.nodes[r.node]):
        refs = list(g.nodes[r.node].refs())
        if len(refs) != 1:
            break
        r = refs[0]
        out.append(r.node)
    return out[::-1]


def why_not_sink(g: Graph, d: int, rd=None) -> str | None:
    n = g.nodes[d]
    if not _is_scale(n):
        return f"{n.name} is not a tensor times a constant"
    chain = _chain(g, n.args[0])
    m = g.nodes[chain[0]]
    if m.target not in PRODUCTS or m.args[0] == m.args[1]:
        return f"{n.name} does not scale the product of two tensors"
    if n.region or m.region or n.deps or m.deps:
        return "inside a fission region"
    written = written_in_place(g)
    outs = {g.storage_of(r) for r in g.outputs}
    if {Ref(d, 0), Ref(m.id, 0)} & (set(written) | outs):
        return "written in place or a graph output"
    if g.readers().get(Ref(m.id, 0), set()) != set(chain[1:]) | {d}:
        return f"{m.name}'s product has other readers"
    if n.outputs[0].dtype != m.outputs[0].dtype:
        return "the scale changes the dtype"
    rd = direct_readers(g) if rd is None else rd
    readers = rd.get(Ref(d, 0), [])
    if not readers or any(is_view(g.nodes[u]) for u in readers):
        return f"{n.name} is unread or read through a view"
    return None


def sink_scale(g: Graph, d: int) -> Graph:
    return sink_all(g, [d])


def sink_all(g: Graph, ds) -> Graph:
    rd = direct_readers(g)
    at: dict[int, Node] = {}
    for d in ds:
        why = why_not_sink(g, d, rd)
        if why:
            raise ValueError(f"cannot sink {g.nodes[d].name}: {why}")
        at[_chain(g, g.nodes[d].args[0])[0]] = g.nodes[d]
    gone = {n.id for n in at.values()}

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id in gone:
            rw.remap[Ref(n.id, 0)] = rw.fix(n.args[0])
            return True
        d = at.get(n.id)
        if d is None:
            return False
        k = min((0, 1), key=lambda i: math.prod(g.tensor(n.args[i]).shape))
        a = g.tensor(n.args[k])
        s = rw.add(d.name, d.target, d.op, (rw.fix(n.args[k]), d.args[1]), {},
                   [TensorInfo(a.shape, a.dtype, math.prod(a.shape) * a.dtype.itemsize)],
                   n.category, keep_name=True)
        _product(rw, n, {k: Ref(s, 0)})
        return True

    return Rewriter(g).run(rule)


def _product(rw: Rewriter, m: Node, args: dict[int, Ref]) -> None:
    new = [args.get(i, rw.fix(x) if isinstance(x, Ref) else x) for i, x in enumerate(m.args)]
    nid = rw.add(m.name, m.target, m.op, new, dict(m.kwargs), list(m.outputs), m.category,
                 keep_name=True)
    rw.remap[Ref(m.id, 0)] = Ref(nid, 0)


def lift_scale(g: Graph, s: int) -> Graph:
    """The inverse of `sink_scale`: ``s`` is the scale op that now feeds the product."""
    sn = g.nodes[s]
    rd = direct_readers(g)
    users = rd.get(Ref(s, 0), [])
    if not _is_scale(sn) or len(users) != 1 or g.nodes[users[0]].target not in PRODUCTS:
        raise ValueError(f"{sn.name} is not a scale feeding one product")
    m = g.nodes[users[0]]
    k = [i for i, x in enumerate(m.args[:2]) if x == Ref(s, 0)]
    if len(k) != 1:
        raise ValueError(f"{m.name} reads {sn.name} twice")
    end = Ref(m.id, 0)
    while len(rd.get(end, [])) == 1 and is_view(g.nodes[rd[end][0]]):
        end = Ref(rd[end][0], 0)
    info = g.tensor(end)

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id == s:
            return True
        if n.id == m.id:
            _product(rw, n, {k[0]: rw.fix(sn.args[0])})
        else:
            rw.copy(n)
        if n.id == end.node:
            d = rw.add(sn.name, sn.target, sn.op, (rw.fix(end), sn.args[1]), {},
                       [TensorInfo(info.shape, info.dtype,
                                   math.prod(info.shape) * info.dtype.itemsize)],
                       n.category, keep_name=True)
            rw.remap[end] = Ref(d, 0)
        return True

    return Rewriter(g).run(rule)


def sink_sites(g: Graph) -> list[int]:
    """Every scale `why_not_sink` accepts, in program order."""
    rd = direct_readers(g)
    return [n.id for n in g.ops if _is_scale(n) and why_not_sink(g, n.id, rd) is None]
