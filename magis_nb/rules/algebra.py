"""TASO-style algebra (paper §3 "M-Rules"): merge matmuls that share an input.

What the zoo's training graphs contain (tiny and paper configs, counted on the
captured ATen joint graphs):

- gpt, bert: the Q/K/V projections are three ``mm(view(x), t(W))`` (gpt, no
  bias) or ``addmm(b, view(x), t(W))`` (bert) whose ``view(x)`` are three
  identical views of one layer-norm output: mergeable as
  ``mm(x, cat([t(Wq), t(Wk), t(Wv)], 1))`` + column slices. The backward's
  weight gradients ``mm(t(dQ), view(x))``, ... share the right operand:
  mergeable as ``mm(cat([t(dQ), ...], 0), x)`` + row slices. btlm's SwiGLU
  ``gate`` and ``up`` linears share their input too. vit already has one
  ``qkv`` linear: nothing to merge.
- No ``mul`` at all, no ``add(x, 0)`` or ``mul(x, 1)``; the only scalar algebra
  is the attention scale ``div(view(bmm(q, k)), sqrt(d))`` (forward) and its
  gradient ``bmm(.., view(div(ds, sqrt(d))))`` (backward): see rules/scale.py.
- The backward's ``dX = mm(dQ, Wq) + mm(dK, Wk) + mm(dV, Wv)`` (TASO's
  ``A@B + C@D = cat(A, C) @ cat(B, D)``) needs a cat of three activation-sized
  gradients to save two launches: not built.

``merge_matmuls(g, ops)`` replaces the ops by one matmul over a ``cat`` of their
other operands, and each op by a ``slice`` view of the merged output that keeps
the op's name. The merged output is one storage: the slices keep it alive until
the last of them dies, which the simulator sees (the search decides whether the
saved launches are worth it). ``split_matmul`` is the inverse and restores the
digest. Measured with the RTX 3090 roofline (simulated step latency): merging
saves 33 us (0.8%) on tiny gpt's forward, and costs time on every paper-size
model (weights change every step, so their cat is paid every step: +0.04% to
+0.16% forward, +0.5% to +1.0% backward), so the search proposes a merge only
where the cost model says its own ops get cheaper.

Merged ops run where the first of them ran; ops feeding the later ones
(``t(W)``) are hoisted before it, keeping the RNG ops' order.

A shared operand is the same value read through equal view chains (each linear
reads its own ``view(x)``): the merged op reads the first op's chain and leaves
the others in place even when nobody reads them any more (a view costs nothing
and codegen drops an unread one at once) so that ``split_matmul`` can give each
op its own chain back.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import rustworkx as rx
import torch

from ..ir.digest import node_labels
from ..ir.graph import Graph, Node, Ref, TensorInfo, map_refs
from ..ir.passes import Rewriter, written_in_place

aten = torch.ops.aten
MM, ADDMM = "aten.mm.default", "aten.addmm.default"
_SLICE, _CAT = "aten.slice.Tensor", "aten.cat.default"


def is_view(n: Node) -> bool:
    return (n.kind == "op" and len(n.outputs) == 1 and n.outputs[0] is not None
            and n.outputs[0].alias is not None and not n.rng)


def operand_key(g: Graph, r: Ref):
    """Equal keys: the same value with the same layout (equal view chains on one base)."""
    n = g.nodes[r.node]
    refs = list(n.refs())
    if not is_view(n) or len(refs) != 1:
        return r
    consts = map_refs((n.args, n.kwargs), lambda x, _k: "#")
    return (n.target, repr(consts), operand_key(g, refs[0]))


def direct_readers(g: Graph) -> dict[Ref, list[int]]:
    out: dict[Ref, list[int]] = {}
    for n in g.ops:
        for r in set(n.refs()):
            out.setdefault(r, []).append(n.id)
    return out


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _side(g: Graph, ops: Sequence[Node]) -> int | None:
    """Index of the shared operand in the args (1 for addmm's x), or None."""
    first = 1 if ops[0].target == ADDMM else 0
    for i in (first, first + 1) if ops[0].target == MM else (first,):
        if len({operand_key(g, n.args[i]) for n in ops}) == 1:
            return i
    return None


def _other(target: str, side: int) -> int:
    """The operand that is concatenated: mm(x, B) -> B, mm(A, x) -> A, addmm(b, x, B) -> B."""
    return 1 - side if target == MM else 2


def _views_ok(g: Graph, rd, r: Ref, t: torch.Tensor) -> bool:
    """Every view chain read from ``r`` still works on ``t`` (a strided slice)."""
    for v in rd.get(r, ()):
        n = g.nodes[v]
        if not is_view(n):
            continue
        if n.target.startswith("aten.as_strided") or len(list(n.refs())) != 1:
            return False
        try:
            out = n.op(*map_refs(n.args, lambda x, _k: t), **map_refs(n.kwargs, lambda x, _k: t))
        except RuntimeError:
            return False
        if not _views_ok(g, rd, Ref(v, 0), out):
            return False
    return True


def why_not_merge(g: Graph, ops: Sequence[int], rd=None) -> str | None:
    """None when ``ops`` can be merged into one matmul, else why not."""
    if len(set(ops)) != len(ops) or len(ops) < 2:
        return "need two or more distinct ops"
    ns = [g.nodes[i] for i in ops]
    if any(n.kind != "op" or n.target not in (MM, ADDMM) for n in ns):
        return "only mm and addmm merge"
    if any(n.target != ns[0].target or n.kwargs != ns[0].kwargs for n in ns):
        return "different ops or scalars"
    if any(n.region or n.deps for n in ns):
        return "an op belongs to a fission region"
    written = written_in_place(g)
    if any(Ref(n.id, 0) in written for n in ns):
        return "an output is written in place"
    side = _side(g, ns)
    if side is None:
        return "no shared operand"
    other = _other(ns[0].target, side)
    ts = [g.tensor(n.args[other]) for n in ns]
    if any(len(t.shape) != 2 or t.dtype != ts[0].dtype for t in ts):
        return "operands of different kinds"
    cat_dim = 1 if other > side else 0
    if len({t.shape[1 - cat_dim] for t in ts}) != 1:
        return "operands of different inner sizes"
    if ns[0].target == ADDMM:
        for n in ns:
            b = g.tensor(n.args[0])
            if tuple(b.shape) != (n.outputs[0].shape[1],):
                return "addmm bias is not one value per column"
    anc = set()
    for n in ns:
        anc |= rx.ancestors(g.dag, n.id)
    if anc & set(ops):
        return "one op depends on another"
    rd = direct_readers(g) if rd is None else rd
    out = [n.outputs[0].shape for n in ns]
    total = sum(s[cat_dim] for s in out)
    full = list(out[0])
    full[cat_dim] = total
    merged = torch.empty(full, dtype=ns[0].outputs[0].dtype, device="meta")
    off = 0
    for n, s in zip(ns, out):
        piece = merged.narrow(cat_dim, off, s[cat_dim])
        off += s[cat_dim]
        if not _views_ok(g, rd, Ref(n.id, 0), piece):
            return f"a view of {n.name} does not work on a slice"
    return None


def merge_matmuls(g: Graph, ops: Sequence[int]) -> Graph:
    return merge_all(g, [ops])


def merge_all(g: Graph, groups: Iterable[Sequence[int]]) -> Graph:
    """Merge each group (see `why_not_merge`) in one pass over the graph."""
    groups = [list(gr) for gr in groups]
    rd = direct_readers(g)
    group_of: dict[int, int] = {}
    for k, gr in enumerate(groups):
        why = why_not_merge(g, gr, rd)
        if why:
            raise ValueError(f"cannot merge {[g.nodes[i].name for i in gr]}: {why}")
        for i in gr:
            if i in group_of:
                raise ValueError(f"{g.nodes[i].name} is in two groups")
            group_of[i] = k
    rw = Rewriter(g)

    def emit(unit) -> None:
        if unit[0] == "n":
            rw.copy(g.nodes[unit[1]])
        else:
            _emit_group(rw, g, [g.nodes[i] for i in groups[unit[1]]])

    def unit_of(nid):
        return ("g", group_of[nid]) if nid in group_of else ("n", nid)

    def preds(unit):
        members = groups[unit[1]] if unit[0] == "g" else [unit[1]]
        return sorted({unit_of(p) for m in members for p in g.preds(m)} - {unit},
                      key=lambda u: min(groups[u[1]]) if u[0] == "g" else u[1])

    # Program order, except that a group waits for all its members' inputs
    # (an iterative post-order DFS: hoisted nodes keep their relative order).
    done, active = set(), set()
    for n in g.nodes:
        root = unit_of(n.id)
        if root in done:
            continue
        stack = [(root, iter(preds(root)))]
        active.add(root)
        while stack:
            u, it = stack[-1]
            nxt = next((p for p in it if p not in done), None)
            if nxt is None:
                stack.pop()
                active.discard(u)
                done.add(u)
                emit(u)
            elif nxt in active:
                raise ValueError("merging these groups would make a cycle")
            else:
                active.add(nxt)
                stack.append((nxt, iter(preds(nxt))))
    return Graph(rw.nodes, [rw.fix(r) for r in g.outputs], g.output_roles)


def _emit_group(rw: Rewriter, g: Graph, ns: list[Node]) -> None:
    side = _side(g, ns)
    addmm = ns[0].target == ADDMM
    other = _other(ns[0].target, side)
    cat_dim = 1 if other > side else 0
    dtype = ns[0].outputs[0].dtype
    fix = rw.fix
    parts = [fix(n.args[other]) for n in ns]
    pshape = list(g.tensor(ns[0].args[other]).shape)
    pshape[cat_dim] = sum(g.tensor(n.args[other]).shape[cat_dim] for n in ns)
    cat = rw.add(ns[0].name + "_cat", _CAT, aten.cat.default, (parts, cat_dim), {},
                 [TensorInfo(tuple(pshape), dtype, _nbytes(pshape, dtype))], ns[0].category)
    args = list(ns[0].args)
    args[side] = fix(args[side])
    args[other] = Ref(cat, 0)
    if addmm:
        blen = sum(n.outputs[0].shape[1] for n in ns)
        bias = rw.add(ns[0].name + "_bias_cat", _CAT, aten.cat.default,
                      ([fix(n.args[0]) for n in ns], 0), {},
                      [TensorInfo((blen,), dtype, _nbytes((blen,), dtype))], ns[0].category)
        args[0] = Ref(bias, 0)
    oshape = list(ns[0].outputs[0].shape)
    oshape[cat_dim] = sum(n.outputs[0].shape[cat_dim] for n in ns)
    merged = rw.add(ns[0].name + "_merged", ns[0].target, ns[0].op, args, dict(ns[0].kwargs),
                    [TensorInfo(tuple(oshape), dtype, _nbytes(oshape, dtype))], ns[0].category)
    off = 0
    for n in ns:
        w = n.outputs[0].shape[cat_dim]
        sid = rw.add(n.name, _SLICE, aten.slice.Tensor, (Ref(merged, 0), cat_dim, off, off + w),
                     {}, [TensorInfo(tuple(n.outputs[0].shape), dtype, 0, Ref(merged, 0))],
                     n.category, keep_name=True)
        rw.remap[Ref(n.id, 0)] = Ref(sid, 0)
        off += w


def split_matmul(g: Graph, merged: int) -> Graph:
    """The inverse of a merge: each slice of ``merged`` becomes its own matmul again."""
    m = g.nodes[merged]
    rd = direct_readers(g)
    slices = [g.nodes[v] for v in rd.get(Ref(merged, 0), ())]
    if m.target not in (MM, ADDMM) or not slices or any(
            s.target != _SLICE or s.args[0] != Ref(merged, 0) for s in slices):
        raise ValueError(f"{m.name} is not a merged matmul read only by slices")
    slices.sort(key=lambda s: s.args[2])
    dim = slices[0].args[1]
    addmm = m.target == ADDMM
    if dim not in (0, 1) or any(s.args[1] != dim for s in slices) or addmm and dim != 1:
        raise ValueError(f"{m.name}'s slices are not along one merged dim")
    other = (2 if dim == 1 else 1) if addmm else (1 if dim == 1 else 0)
    side = other - 1 if dim == 1 else other + 1
    cats = [m.args[other]] + ([m.args[0]] if addmm else [])
    for c in cats:
        cn = g.nodes[c.node]
        if cn.target != _CAT or len(cn.args[0]) != len(slices) or rd.get(c) != [merged]:
            raise ValueError(f"{m.name}'s operand is not a cat of one piece per slice")
    parts = g.nodes[cats[0].node].args[0]
    biases = g.nodes[cats[1].node].args[0] if addmm else None
    # each op but the first gets back an unread view chain equal to the shared one
    label = node_labels(g)
    shared = m.args[side]
    spare = [n.id for n in g.ops if is_view(n) and Ref(n.id, 0) not in rd
             and n.id != shared.node and label[n.id] == label[shared.node]]
    skip = {c.node for c in cats}

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id in skip:
            return True
        if n.id != merged:
            return n.target == _SLICE and n.args[0] == Ref(merged, 0)
        for k, s in enumerate(slices):
            args = list(m.args)
            use = Ref(spare.pop(0), 0) if k and spare and shared.out == 0 else shared
            args[side] = rw.fix(use)
            args[other] = rw.fix(parts[k])
            if addmm:
                args[0] = rw.fix(biases[k])
            t = s.outputs[0]
            nid = rw.add(s.name, m.target, m.op, args, dict(m.kwargs),
                         [TensorInfo(t.shape, t.dtype, _nbytes(t.shape, t.dtype))],
                         s.category, keep_name=True)
            rw.remap[Ref(s.id, 0)] = Ref(nid, 0)
        return True

    return Rewriter(g).run(rule)


def merge_groups(g: Graph) -> list[tuple[int, ...]]:
    """Every group of two or more matmuls that `why_not_merge` accepts, in program
    order; a matmul sharing both operands with others is grouped on its left one."""
    by_key: dict[tuple, list[int]] = {}
    for n in g.ops:
        if n.target not in (MM, ADDMM) or n.region:
            continue
        lo = 1 if n.target == ADDMM else 0
        for i in ((lo,) if n.target == ADDMM else (0, 1)):
            key = (n.target, repr(n.kwargs), i, operand_key(g, n.args[i]))
            by_key.setdefault(key, []).append(n.id)
    rd = direct_readers(g)
    out, used = [], set()
    for key in sorted(by_key, key=lambda k: (min(by_key[k]), k[2])):
        ids = tuple(i for i in by_key[key] if i not in used)
        if len(ids) >= 2 and why_not_merge(g, ids, rd) is None:
            out.append(ids)
            used.update(ids)
    return out
