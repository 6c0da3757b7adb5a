"""F-Trans f = (S, D, n) (paper §4.2): which op sets may be split, and how.

Validity, checked explicitly:
  (1) G[S] is weakly connected;
  (2) S is convex: no path leaves S and comes back;
  (3) no redundant computation: every op of S has exactly one axis in D (an op
      with several takes the one its neighbours in S agree on, Note [ambiguous
      ops] in dgraph.py), and every tensor flowing inside S is split along that
      axis on both ends.
Plus what execution needs: every tensor leaving S either carries the axis (parts
are concatenated) or is a reduction over it with a known combine (sum/max/min/mean),
and n divides every axis length in S.

Note [recomputed in parts]
A backward region split along the sequence reads slices of tensors the forward
saved for it (attention outputs, an MLP's hidden activations, norms' inputs).
Kept whole, they are what a long context fills memory with; recomputed whole
(re-materialization, which the search applies after fission), each is briefly
whole again. A region can instead carry ``recompute``: forward ops whose outputs
it reads in slices and nothing after the forward reads but the region, followed
upward while that holds (`ftree.recompute_set`). Each part runs its slices of
them first, from slices (or, where their axis passes them whole, all) of what
they read, then its own ops; the originals still run in the forward, but their
outputs die there. This is checkpointing and chunking at once: what flash
attention does for the scores and chunked MLPs do by hand, found for every
backward segment of the sequence component (`ftree._segments` over the
backward ops alone). A recomputed op must not draw random numbers; the region
and its recomputed ops must agree on their axes as one region would.

Note [recomputing what another region splits]
A block's attention forward split along the queries and its backward region
recomputing the same scores and probabilities per query part are both needed
at long context: the first keeps the forward from making [T, T] tensors whole,
the second keeps the backward from reading them whole. The recomputed copies
read only what the recompute set reads from outside itself (q, k, v, the
mask); where those come from the forward region they are its outputs, made
whole there, so the copies need nothing of the forward region's parts and the
two regions can both be enabled (`recompute_fits`). The forward region's
originals still run; only their outputs die inside it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import gcd

from ..ir.graph import Graph, Ref
from .dgraph import DGraph


@dataclass(frozen=True)
class FTrans:
    ops: frozenset[int]
    comp: int
    n: int = 1
    pack: bool = False      # pack the dropout masks the parts read (Note [packed masks])
    # forward ops each part recomputes its own slice of (Note [recomputed in parts])
    recompute: frozenset[int] = frozenset()
    # image dims tiled with halos, n parts per dim (Note [tiles with halos] in spatial.py)
    tiles: tuple[int, ...] = ()
    # forward ops run whole once before part 0 (Note [recomputed whole before
    # the parts] in prologue.py)
    prologue: frozenset[int] = frozenset()

    @cached_property
    def split_ops(self) -> frozenset[int]:
        """The ops run in parts: the region's and those it recomputes (kept: asked
        once per op and part, 80K times building paper BTLM split in 16)."""
        return self.ops | self.recompute

    @property
    def enabled(self) -> bool:
        return self.n > 1


def region_outputs(g: Graph, ops: frozenset[int]) -> list[Ref]:
    """Tensors made in ``ops`` that are read outside it or returned."""
    used = set(r for r in g.outputs if r.node in ops)
    readers = {w for v in ops for w in g.succs(v) if w not in ops}  # every reader is a successor
    for w in readers:
        n = g.nodes[w]
        for r in n.refs():
            if r.node in ops:
                used.add(r)
    return sorted(used)


def max_parts(dg: DGraph, ops, comp: int) -> int:
    ops = frozenset(ops)
    if isinstance(dg.region_axes(ops, comp), str):
        return 0
    L = 0
    for v in ops:
        L = gcd(L, dg.axis(v, comp, ops).size)
    return L


def divisors(L: int) -> list[int]:
    return [d for d in range(1, L + 1) if L % d == 0]


def reentered(g: Graph, ops) -> set[int]:
    """Ops of ``ops`` reachable again after a path has left ``ops`` (empty: convex)."""
    if not ops:
        return set()
    pos = g.topo_position()
    last = max(pos[v] for v in ops)  # nothing placed after it leads back into ops
    frontier = {w for v in ops for w in g.succs(v) if w not in ops and pos[w] <= last}
    seen, stack = set(frontier), list(frontier)
    while stack:
        v = stack.pop()
        for w in g.succs(v):
            if w not in seen and pos[w] <= last:
                seen.add(w)
                stack.append(w)
    return seen & set(ops)


def weak_pieces(g: Graph, ops) -> list[set[int]]:
    """The weakly connected pieces of G[ops]."""
    left, out = set(ops), []
    while left:
        start = min(left)
        piece, stack = {start}, [start]
        while stack:
            v = stack.pop()
            for w in g.preds(v) + g.succs(v):
                if w in left and w not in piece:
                    piece.add(w)
                    stack.append(w)
        left -= piece
        out.append(piece)
    return out


def check(dg: DGraph, ops, comp: int, n: int = 2, recompute=frozenset()) -> str | None:
    """None when (ops, comp, n) is a valid F-Trans, else the reason it is not.
    ``recompute``: forward ops each part recomputes (Note [recomputed in parts]):
    split along with the region, their outputs never leave it."""
    g = dg.graph
    region = frozenset(ops)
    ops = region | frozenset(recompute)
    if not region:
        return "empty region"
    c = dg.components[comp]
    for v in ops:
        if g.nodes[v].kind != "op":
            return f"{g.nodes[v].name} is not an op"
        if v not in c.axis_of and v not in c.choices:
            return f"{g.nodes[v].name} has no axis in dimension {comp}"
    why = dg.region_axes(ops, comp)
    if isinstance(why, str):
        return why
    if n > 1 and max_parts(dg, ops, comp) % n:
        return f"{n} does not divide the axis length {max_parts(dg, ops, comp)}"
    if len(weak_pieces(g, region)) != 1:
        return "not weakly connected"
    if reentered(g, region):
        return "not convex: a path leaves the region and comes back"
    if any(g.nodes[v].rng for v in recompute):
        return "a recomputed op draws random numbers"
    for v in ops:
        ax = dg.axis(v, comp, ops)
        sliced = {k: d for k, d in ax.inputs}
        for k, r in enumerate(g.nodes[v].refs()):
            if r.node not in ops:
                continue
            pax = dg.axis(r.node, comp, ops)
            dims = [d for (o, d) in pax.outputs if o == r.out]
            if not dims or sliced.get(k) != dims[0]:
                return (f"{g.nodes[v].name} would need all of {g.nodes[r.node].name}'s "
                        "output (redundant computation)")
    for r in region_outputs(g, region):
        ax = dg.axis(r.node, comp, ops)
        if not any(o == r.out for o, _ in ax.outputs) and ax.combine is None:
            return f"output of {g.nodes[r.node].name} cannot be merged across parts"
    return None


def recompute_reads(g: Graph, recompute) -> frozenset[Ref]:
    """The tensors a region's recomputed ops read from outside them."""
    rec = frozenset(recompute)
    return frozenset(Ref(r.node, r.out) for v in rec for r in g.nodes[v].refs()
                     if r.node not in rec)


def recompute_fits(reads: frozenset[Ref], rec: frozenset[int], ops: frozenset[int],
                   outs: frozenset[Ref]) -> bool:
    """Note [recomputing what another region splits]: a region whose recomputed
    ops ``rec`` (reading ``reads``) include ops of another region (``ops``, its
    outputs ``outs``) is still exact when everything the recomputed copies read
    of that region is one of its outputs, made whole."""
    return not (rec & ops) or all(r in outs for r in reads if r.node in ops)


def plan_outputs(dg: DGraph, f: FTrans) -> dict[Ref, tuple[str, int]]:
    """How each region output is assembled: ("cat", dim) or (combine, -1)."""
    out = {}
    for r in region_outputs(dg.graph, f.ops):
        ax = dg.axis(r.node, f.comp, f.split_ops)
        dims = [d for o, d in ax.outputs if o == r.out]
        out[r] = ("cat", dims[0]) if dims else (ax.combine, -1)
    return out
