"""Forward ops a backward region recomputes whole, once, before its parts.

Note [recomputed whole before the parts]
A block's backward split along the queries recomputes its forward in parts
(Note [recomputed in parts] in ftrans.py), but its attention reads k and v
whole: every query part needs every key. Those were kept whole from the
forward to the backward, for every block: at 2048 tokens the zoo GPT kept each
block's input, k and v (1 MiB each), the Llama-style model also the normalized
input and the k and v repeated for the grouped heads, and with every block
split these were most of what stood above eager's peak at 256 tokens.

A region can instead carry a ``prologue``: the forward ops that make what its
parts read whole, run once on whole tensors before part 0 and freed after the
last part reads them (a remat of k and v from the block's input, at the start
of the block's backward). `prologue_set` walks up from the forward tensors the
region and its recomputed ops read whole, taking each producer whose outputs
no part reads in slices (such a tensor is kept for the parts anyway: the
block's input) and nothing after the forward reads but the region, its
recomputed ops or the prologue, or a backward region that recomputes it in
parts (the norm feeding the k and v projections, which the block's
projection backward remakes); the backward's views of saved tensors (the
transposed k that dQ's matmul reads) are taken with them. An op the parts
recompute in slices (the block's norm) that the prologue needs whole joins it
too: its original dies in the forward. Ops computed from the data alone (a
causal mask, rotary tables) are read as they are: recomputed whole they can
be [T, T].
"""
from __future__ import annotations

import heapq

from ..ir.graph import Ref
from ..ir.passes import writes_into_input, written_in_place
from .dgraph import DGraph

PROLOGUE_MAX = 64       # more ops than that is not the few a block's k and v take


def prologue_set(dg: DGraph, region: frozenset[int], rec: frozenset[int], cid: int,
                 fwd: set[int], late: dict[Ref, set[int]],
                 from_inputs: dict[int, bool], remade: frozenset[int] = frozenset()
                 ) -> frozenset[int]:
    """Note [recomputed whole before the parts]: the forward ops backward
    region ``region`` (recomputing ``rec`` in parts) runs whole before its
    parts; empty when there are none or more than PROLOGUE_MAX. ``remade``:
    the ops any backward region recomputes in parts (their originals die in
    the forward when those regions are enabled, as they are together)."""
    g = dg.graph
    split = region | rec
    if not rec:
        return frozenset()
    axes = dg.region_axes(split, cid)
    if isinstance(axes, str):
        return frozenset()
    sliced: set[Ref] = set()
    heap: list[int] = []            # producers to decide, the latest first
    for v in split:
        cut = dict(dg.dims[v].axes[axes[v]].inputs)
        for k, r in enumerate(g.nodes[v].refs()):
            if r.node in split:
                continue
            if k in cut:
                sliced.add(Ref(r.node, r.out))
            else:
                heapq.heappush(heap, -r.node)
    written = written_in_place(g)
    pro: set[int] = set()
    seen: set[int] = set()
    while heap:
        p = -heapq.heappop(heap)
        if p in seen:
            continue
        seen.add(p)
        n = g.nodes[p]
        outs = [Ref(p, i) for i, t in enumerate(n.outputs) if t is not None]
        if n.kind != "op" or not outs or from_inputs.get(p, False) or n.rng \
                or writes_into_input(n) or not hasattr(n.op, "_schema") \
                or g.nodes[g.storage_of(outs[0]).node].kind == "input":
            continue            # (a view of a weight costs nothing to keep)
        if p not in fwd and not (all(g.tensor(r).alias is not None for r in outs)
                                 and all(r.node in fwd for r in n.refs())):
            continue            # a backward op, but a view of saved tensors (dQ's k.T)
        # readers have larger ids: every one that is in the prologue is decided
        if any(r in sliced for r in outs) or p not in rec | remade \
                and any(not late.get(r, set()) <= split | pro for r in outs):
            continue            # kept whole for someone anyway: read as it is
        if len(pro) >= PROLOGUE_MAX or any(g.storage_of(r) in written for r in n.refs()):
            # (a copy run in the backward would read what a later write left)
            return frozenset()
        pro.add(p)
        for r in n.refs():
            heapq.heappush(heap, -r.node)
    return frozenset(pro)
