"""The F-Tree (paper §4.3, Algorithm 1) and its mutation rules (§5.1).

Candidates are the subgraphs dominated by well-scoring ops, one D component at a
time; nesting by containment makes them a tree (leaves small, root large). The
search starts at the leaves and moves toward the root.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import rustworkx as rx

from ..ir.graph import Graph, Ref, iter_refs
from .dgraph import DGraph
from .ftrans import FTrans, check, divisors, max_parts, reentered, weak_pieces
from .masks import packable_masks

# Splitting into more parts than this only adds per-op overhead (and the split
# program is built part by part): n is the largest divisor of the axis length <= it.
MAX_PARTS = 64


def largest_parts(L: int, cap: int = MAX_PARTS) -> int:
    return max(d for d in divisors(L) if d <= cap)


def least_parts(L: int) -> int:
    """The smallest split of an axis of length L: its least divisor above 1."""
    return min(d for d in divisors(L) if d > 1)


@dataclass
class Candidate:
    id: int
    ops: frozenset[int]
    comp: int
    dominator: int          # the op whose dominated subgraph this is
    level: int              # score band, 1..L
    score: float
    heat: int
    max_n: int
    parent: int | None = None
    children: list[int] = field(default_factory=list)
    pack: bool = False      # its dropout masks packed (Note [packed masks] in masks.py)
    twin: int | None = None  # the same region with the other ``pack``

    def ftrans(self, n: int) -> FTrans:
        return FTrans(self.ops, self.comp, n, self.pack)


def _dominated(g: Graph, nodes: list[int]) -> dict[int, set[int]]:
    """Strict dominator-tree descendants of each node in G[nodes] (virtual root)."""
    sub = rx.PyDiGraph()
    idx = {v: sub.add_node(v) for v in nodes}
    root = sub.add_node(-1)
    inside = set(nodes)
    for v in nodes:
        ps = [p for p in g.preds(v) if p in inside]
        for p in ps:
            sub.add_edge(idx[p], idx[v], None)
        if not ps:
            sub.add_edge(root, idx[v], None)
    idom = rx.immediate_dominators(sub, root)
    children: dict[int, list[int]] = {}
    for x, d in idom.items():
        if x != d:
            children.setdefault(d, []).append(x)
    out: dict[int, set[int]] = {}

    def des(x) -> set[int]:  # iterative post-order: dominator trees can be deep chains
        stack, order = [x], []
        while stack:
            y = stack.pop()
            order.append(y)
            stack.extend(children.get(y, []))
        for y in reversed(order):
            s = set()
            for c in children.get(y, []):
                s.add(sub[c])
                s |= out[sub[c]]
            out[sub[y]] = s
        return out[sub[x]]

    des(root)
    return {v: out[v] for v in nodes}


def _convex_core(g: Graph, ops: set[int]) -> set[int]:
    """``ops`` minus everything reachable from outside it: a convex subset.

    Dominance is computed on one D component's subgraph, which cannot see paths
    through ops outside the component (the loss, a barrier op, a dropout draw): a
    dominated set can leave through them and come back. Dropping the part reached
    again leaves the convex prefix -- in a training graph, the forward part of a
    subgraph that would otherwise straddle the loss.
    """
    return ops - reentered(g, ops)


def _region(g: Graph, dominated: set[int], hot_by_op: dict[int, int]) -> set[int]:
    """The candidate region of a dominator: its dominated set made convex, and of
    the weakly connected pieces that leaves, the hottest (paper §4.3 requires both)."""
    core = _convex_core(g, dominated)
    if not core:
        return set()
    return max(weak_pieces(g, core), key=lambda p: (sum(hot_by_op.get(v, 0) for v in p), len(p), -min(p)))


def build_ftree(dg: DGraph, hotspots: dict[Ref, int], *, levels: int = 4, n: int = 2,
                min_ops: int = 1) -> list[Candidate]:
    """Algorithm 1. ``hotspots`` maps the storages live at the peak to their bytes."""
    g = dg.graph
    hot_by_op: dict[int, int] = {}
    for r, size in hotspots.items():
        if g.nodes[r.node].kind == "op":
            hot_by_op[r.node] = hot_by_op.get(r.node, 0) + size
    # Ops computed from the data alone, without parameters (a target count, a
    # causal mask, a reshaped input) are side entries: left in the dominator
    # subgraph they would make every op they feed an entry of its own, and no
    # forward op would dominate the backward it drives. A region reads them whole.
    from_inputs: dict[int, bool] = {}
    for nd in g.nodes:
        if nd.kind == "op":
            from_inputs[nd.id] = all(
                (g.nodes[p].kind == "input" and g.nodes[p].category != "weight")
                or from_inputs.get(p, False) for p in g.preds(nd.id))
    cands: list[Candidate] = []
    seen: set[tuple] = set()
    for comp in dg.components:
        nodes = [v for v in comp.ops if not from_inputs[v]]
        if not nodes:
            continue
        dom = {v: _region(g, d, hot_by_op) for v, d in _dominated(g, nodes).items()}
        score, heat = {}, {}
        for v in nodes:
            region = dom[v]
            if not region:
                continue
            heat[v] = sum(hot_by_op.get(w, 0) for w in region)
            # Inputs of the region that are neither hot nor resident stay live during
            # the whole split region: they count against it (eq. 4's input term).
            ins = set()
            for w in region:
                for r in iter_refs((g.nodes[w].args, g.nodes[w].kwargs)):
                    base = g.storage_of(r)
                    if r.node not in region and base not in hotspots \
                            and g.nodes[base.node].kind == "op":
                        ins.add(base)
            score[v] = (1 - 1 / n) * heat[v] - sum(g.tensor(b).nbytes for b in ins)
        if not score:
            continue
        smax = max(score.values())
        if smax <= 0:
            continue
        for lvl in range(1, levels + 1):
            band = {v for v, s in score.items()
                    if lvl / levels <= s / smax < (lvl + 1) / levels or (lvl == levels and s == smax)}
            for v in sorted(band):
                if dom[v] & band:
                    continue  # a descendant in the same band is chosen instead
                ops = frozenset(dom[v])
                if len(ops) < min_ops or (ops, comp.id) in seen:
                    continue
                top = largest_parts(max_parts(dg, ops, comp.id))
                if top > 1 and check(dg, ops, comp.id, 1) is None:
                    seen.add((ops, comp.id))
                    cands.append(Candidate(len(cands), ops, comp.id, v, lvl, score[v], heat[v], top))
    _link(cands)
    return cands


def add_pack_twins(dg: DGraph, cands: list[Candidate]) -> None:
    """Append to ``cands`` a twin with ``pack=True`` of every candidate whose split
    parts read dropout masks that can be packed (Note [packed masks] in masks.py).
    A twin sits outside the tree (no parent, no children): the "pack" rule of
    `mutations` is the only way in and out."""
    for c in list(cands):
        if c.twin is None and not c.pack and packable_masks(dg.graph, c.ftrans(c.max_n), dg):
            twin = dataclasses.replace(c, id=len(cands), parent=None, children=[], pack=True,
                                       twin=c.id)
            c.twin = twin.id
            cands.append(twin)


def _link(cands: list[Candidate]) -> None:
    """Parent = the smallest strictly larger candidate containing it."""
    for c in cands:
        best = None
        for p in cands:
            if p is not c and c.ops < p.ops and (best is None or len(p.ops) < len(best.ops)):
                best = p
        c.parent = best.id if best else None
        if best:
            best.children.append(c.id)


# -- mutation rules (§5.1) on a plan: candidate id -> n (n > 1 = enabled) ----------
def _ancestors(cands, i):
    while cands[i].parent is not None:
        i = cands[i].parent
        yield i


def _descendants(cands, i):
    stack = list(cands[i].children)
    while stack:
        j = stack.pop()
        yield j
        stack.extend(cands[j].children)


def _overlaps(cands, plan, i) -> bool:
    return any(cands[i].ops & cands[j].ops for j, n in plan.items() if n > 1 and j != i)


def mutations(cands: list[Candidate], plan: dict[int, int]) -> list[tuple[str, dict[int, int]]]:
    """Every plan one F-Tree rule away. Enabled regions never overlap: enabling an
    ancestor of an enabled node is done by lifting (nested fission is not executed).
    "pack" swaps an enabled region for its twin (same ops, dropout masks packed or
    not) at the same n."""
    on = {i for i, n in plan.items() if n > 1}
    out = []
    for c in cands:
        i = c.id
        if i in on:
            nxt = [d for d in divisors(c.max_n) if d > plan[i]]  # max_n's divisors divide L
            if nxt:
                out.append(("mutate", {**plan, i: nxt[0]}))
            if not any(j in on for j in _descendants(cands, i)):
                out.append(("disable", {k: v for k, v in plan.items() if k != i}))
            if c.twin is not None:
                out.append(("pack", {**{k: v for k, v in plan.items() if k != i}, c.twin: plan[i]}))
            p = c.parent
            if p is not None and not any(j in on for j in _ancestors(cands, i)):
                lifted = {k: v for k, v in plan.items() if k not in _descendants(cands, p)}
                lifted[p] = least_parts(cands[p].max_n)
                if not _overlaps(cands, lifted, p):
                    out.append(("lift", lifted))
        elif c.pack:
            continue        # a packed twin is reached from its region by "pack" only
        elif not c.children or any(j in on for j in c.children):
            if any(j in on for j in _ancestors(cands, i)):
                continue
            trial = {k: v for k, v in plan.items() if k not in set(_descendants(cands, i))}
            trial[i] = least_parts(c.max_n)
            if not _overlaps(cands, trial, i):
                out.append(("enable", trial))
    return out
