"""The F-Tree (paper §4.3, Algorithm 1) and its mutation rules (§5.1).

Candidates are the subgraphs dominated by well-scoring ops, one D component at a
time; nesting by containment makes them a tree (leaves small, root large). The
search starts at the leaves and moves toward the root.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import rustworkx as rx

from ..ir.graph import Graph, Ref
from ..ir.phased_norm import PHASE_BARRIERS
from .dgraph import DGraph
from .ftrans import (FTrans, check, divisors, max_parts, recompute_fits, recompute_reads,
                     reentered, region_outputs, weak_pieces)
from .masks import packable_masks
from .prologue import prologue_set

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
    twin: int | None = None  # the same region with the other ``pack`` (or ``recompute``)
    recompute: frozenset[int] = frozenset()  # Note [recomputed in parts] in ftrans.py
    # image dims split into tiles, n per dim (Note [tiles with halos] in spatial.py);
    # such a candidate has no D component (comp -1)
    tiles: tuple[int, ...] = ()
    # what its recomputed ops read from outside them, and the region's outputs:
    # Note [recomputing what another region splits] in ftrans.py
    reads: frozenset[Ref] = frozenset()
    outs: frozenset[Ref] = frozenset()
    # run whole before part 0 (Note [recomputed whole before the parts] in prologue.py)
    prologue: frozenset[int] = frozenset()

    def ftrans(self, n: int) -> FTrans:
        return FTrans(self.ops, self.comp, n, self.pack, self.recompute, self.tiles,
                      self.prologue)

    @property
    def remade(self) -> frozenset[int]:
        """The forward ops it runs again, in parts or whole."""
        return self.recompute | self.prologue


def dominated_sets(g: Graph, nodes: list[int]) -> dict[int, set[int]]:
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


def _closure(g: Graph, seeds: set[int], ops: set[int], up: bool) -> set[int]:
    """``seeds`` and their ancestors (``up``) or descendants within ``ops``."""
    out, stack = set(seeds), list(seeds)
    while stack:
        v = stack.pop()
        for w in (g.preds(v) if up else g.succs(v)):
            if w in ops and w not in out:
                out.add(w)
                stack.append(w)
    return out


def _agreeing(dg: DGraph, comp: int, ops: set[int]) -> set[int]:
    """``ops`` pruned until every op's axis agrees with its producers' in ``ops``.

    Needed where the component has ambiguous ops (Note [ambiguous ops] in
    dgraph.py): a dominated set that holds a block's attention also holds the
    projections of q, k and v, and the scores op cannot be split along the
    query with k split too. Walking in topological order, each op takes the
    axis that costs the fewest ops to keep: the producers it would read whole
    leave the region with all their ancestors in it (so that no path leaves
    and comes back: the projections of k and v are computed whole before the
    region, and the region starts after them), unless dropping the op itself
    and its descendants is cheaper."""
    c = dg.components[comp]
    if not any(v in c.choices for v in ops):
        return ops
    g, ops, chosen = dg.graph, set(ops), {}
    pos = g.topo_position()
    for v in sorted(ops, key=pos.__getitem__):
        if v not in ops:
            continue
        refs = list(g.nodes[v].refs())
        best = None
        for a in ([c.axis_of[v]] if v in c.axis_of else c.choices[v]):
            sliced = dict(dg.dims[v].axes[a].inputs)
            bad = set()
            for k, r in enumerate(refs):
                if r.node in ops and r.node in chosen:
                    dims = [d for o, d in dg.dims[r.node].axes[chosen[r.node]].outputs if o == r.out]
                    if not dims or sliced.get(k) != dims[0]:
                        bad.add(r.node)
            cost = _closure(g, bad, ops, up=True) if bad else set()
            if best is None or len(cost) < len(best[1]):
                best = (a, cost)
        if best[1]:
            below = _closure(g, {v}, ops, up=False)
            if len(below) <= len(best[1]):
                ops -= below
                continue
        ops -= best[1]
        chosen[v] = best[0]
    return ops


def _conflicted(dg: DGraph, comp: int, nodes) -> bool:
    """The component has ambiguous ops, or an op that reads all of a tensor
    another op of it splits (attention reads k and v whole): dominated sets
    then straddle such edges, and `_segments` offers regions between them."""
    c, g = dg.components[comp], dg.graph
    if c.choices:
        return True
    inside = set(nodes)
    if any(g.nodes[v].target in PHASE_BARRIERS for v in inside):
        return True
    for v in nodes:
        sliced = dict(dg.axis(v, comp).inputs)
        for k, r in enumerate(g.nodes[v].refs()):
            if r.node in inside and r.node in c.axis_of:
                dims = [d for o, d in dg.axis(r.node, comp).outputs if o == r.out]
                if dims and sliced.get(k) != dims[0]:
                    return True
    return False


def _segments(dg: DGraph, comp: int, nodes) -> list[set[int]]:
    """The component's ops cut into convex regions whose axes agree.

    In topological order each op joins the earliest segment that is not before
    any segment of its ancestors (so no path leaves a segment and comes back)
    and where its axis agrees with the producers it reads there; else it opens
    a new one. For attention along the sequence this cuts each block between
    the projections of k and v (read whole by attention) and the attention, in
    the forward and in the backward: the regions the dominator tree cannot
    offer (no op dominates a block's attention without its k and v). What is
    computed from a phase barrier's combined result (a BatchNorm's statistics:
    Note [BatchNorm in phases] in ir/phased_norm.py) starts a later segment:
    each conv block splits into the phases between its normalizations."""
    c, g = dg.components[comp], dg.graph
    inside = set(nodes)
    pos = g.topo_position()
    depth: dict[int, int] = {}          # node -> the latest segment among it and its ancestors
    seg_of: dict[int, int] = {}
    chosen: dict[int, int] = {}
    segs: list[set[int]] = []
    # A source (no producer inside) that only ops inside read joins its first
    # reader's segment, with the axis that makes the slice the reader cuts: put
    # in the earliest segment, the transpose of the saved probabilities before
    # dV's matmul in a block's attention backward was left out of that block's
    # segment, and its read kept the forward's [T, T] probabilities whole.
    # Likewise an op the backward runs on saved tensors alone (SiLU's derivative,
    # sigmoid(x) * (1 + x * (1 - sigmoid(x))), from the saved gate output): put
    # with the forward it reads, the forward region made it whole for the
    # backward (a [T, ffn] tensor a block in the Llama-style model) and a
    # region of its own split it; it waits for its reader in the backward.
    waiting: set[int] = set()           # ops no reader has placed yet
    # (in program order, ids: the backward starts at the first gradient op made
    # from something, the loss's seed gradient being a source)
    backward = min((n.id for n in g.nodes
                    if n.kind == "op" and n.category == "gradient" and g.preds(n.id)),
                   default=len(g.nodes))
    for v in sorted(range(len(g.nodes)), key=pos.__getitem__):
        lo = max((depth[p] for p in g.preds(v)), default=0)
        if v not in inside:
            depth[v] = lo
            # combined statistics of a phase barrier's parts (BatchNorm's) are
            # read after all its parts: their readers start a later segment
            for p in g.preds(v):
                if p in seg_of and g.nodes[p].target in PHASE_BARRIERS:
                    depth[v] = max(depth[v], seg_of[p] + 1)
            continue
        refs = list(g.nodes[v].refs())
        axes = [c.axis_of[v]] if v in c.axis_of else c.choices[v]
        source = not any(p in inside for p in g.preds(v))
        saved_only = v > backward and g.nodes[v].category != "gradient" \
            and not any(g.nodes[p].category == "gradient" for p in g.preds(v))
        if (source or saved_only) and g.succs(v) and all(w in inside for w in g.succs(v)):
            waiting.add(v)
            depth[v] = lo
            continue
        def agrees(s, a):
            # each producer in segment s splits the tensor v reads, along the
            # dim v's axis slices (a reduced output or one read whole cannot stay)
            sliced = dict(dg.dims[v].axes[a].inputs)
            for k, r in enumerate(refs):
                if seg_of.get(r.node) == s:
                    d = next((d for o, d in dg.dims[r.node].axes[chosen[r.node]].outputs
                              if o == r.out), None)
                    if d is None or sliced.get(k) != d:
                        return False
            return True

        placed = next(((s, a) for s in range(lo, len(segs)) for a in axes if agrees(s, a)), None)
        if placed is None:
            segs.append(set())
            placed = (len(segs) - 1, axes[0])
        s, a = placed
        segs[s].add(v)
        seg_of[v], chosen[v], depth[v] = s, a, max(lo, s)
        todo = [(v, a)]
        while todo:             # the waiting ops it reads, and those they read
            w, b = todo.pop()
            sliced = dict(dg.dims[w].axes[b].inputs)
            for k, r in enumerate(g.nodes[w].refs()):
                u = r.node
                if u not in waiting:
                    continue
                w_axes = [c.axis_of[u]] if u in c.axis_of else c.choices[u]
                fit = next((x for x in w_axes if k in sliced
                            and (r.out, sliced[k]) in dg.dims[u].axes[x].outputs), None)
                # only its first reader places it: one placed before it would read
                # from a later segment
                waiting.discard(u)
                if fit is not None:
                    segs[s].add(u)
                    seg_of[u], chosen[u], depth[u] = s, fit, s
                    todo.append((u, fit))
    # no reader took it (they read it whole, like attention's k and v): it is
    # left out of every segment, and its readers read it as a region input
    out = []
    for seg in segs:
        core = _convex_core(g, seg)
        out += [p for p in weak_pieces(g, core) if len(p) > 1]
    return out


def _region(g: Graph, dominated: set[int], hot_by_op: dict[int, int],
            agree=lambda ops: ops) -> set[int]:
    """The candidate region of a dominator: its dominated set made convex (and
    its axes agreeing, `_agreeing`), and of the weakly connected pieces that
    leaves, the hottest (paper §4.3 requires both)."""
    core = _convex_core(g, agree(_convex_core(g, dominated)))
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
    fwd = forward_ops(g)
    late = None                         # late_readers(g, fwd), made on first use
    for comp in dg.components:
        nodes = [v for v in comp.ops if not from_inputs[v]]
        if not nodes:
            continue
        agree = lambda ops, _c=comp.id: _agreeing(dg, _c, ops)
        dom = {v: _region(g, d, hot_by_op, agree) for v, d in dominated_sets(g, nodes).items()}

        def scored(region):
            """(score, heat) of a region: eq. 4's gain minus its inputs that are
            neither hot nor resident (they stay live during the whole split region)."""
            h = sum(hot_by_op.get(w, 0) for w in region)
            ins = set()
            for w in region:
                for r in g.nodes[w].refs():
                    base = g.storage_of(r)
                    if r.node not in region and base not in hotspots \
                            and g.nodes[base.node].kind == "op":
                        ins.add(base)
            return (1 - 1 / n) * h - sum(g.tensor(b).nbytes for b in ins), h

        score, heat = {}, {}
        for v in nodes:
            if dom[v]:
                score[v], heat[v] = scored(dom[v])
        segs = []                       # (first op, ops, score, heat, recomputed, prologue)
        # A training step's forward phases (Note [BatchNorm in phases]) make
        # whole what the backward reads, so a region of them alone lowers no
        # peak (paper U-Net, U-Net++ and ResNet-50 get the same plans at 60 s
        # without them, from 26 batch candidates instead of 45 on tiny U-Net).
        # Their backward phases, remaking the normalize in parts, stay.
        phased = bool(fwd) and any(g.nodes[v].target in PHASE_BARRIERS for v in nodes)
        if _conflicted(dg, comp.id, nodes):
            for seg in _segments(dg, comp.id, nodes):
                if phased and seg <= fwd:
                    continue
                segs.append((min(seg), frozenset(seg), *scored(seg), frozenset(), frozenset()))
            # the forward alone: the last block's attention, whose cut above runs
            # on into the loss's backward, as a region of its own; each part
            # makes its rows of the causal mask
            for seg in ([] if phased else _segments(dg, comp.id, [v for v in nodes if v in fwd])):
                seg = frozenset(seg)
                rec = side_recompute(dg, seg, comp.id, from_inputs)
                if rec and check(dg, seg, comp.id, 1, rec) is not None:
                    rec = frozenset()
                segs.append((min(seg), seg, *scored(seg), rec, frozenset()))
            # the backward alone, cut the same way, each segment remaking its slices
            # of the forward it reads (Note [recomputed in parts] in ftrans.py); a
            # segment the cut above also gave is offered again with them (a block's
            # attention backward: kept whole, the forward's [T, T] probabilities)
            back = []
            bsegs = [frozenset(seg) for seg in _segments(dg, comp.id,
                                                        [v for v in nodes if v not in fwd])]
            bops = frozenset().union(*bsegs)
            for seg in bsegs:
                if late is None:
                    late = late_readers(g, fwd)
                rec = recompute_set(dg, seg, comp.id, fwd, late, bops)
                if rec and check(dg, seg, comp.id, 1, rec) is None:
                    back.append((seg, rec))
            remade = frozenset().union(*(rec for _, rec in back))
            for seg, rec in back:
                pro = prologue_set(dg, seg, rec, comp.id, fwd, late, from_inputs, remade)
                freed = sum(hot_by_op.get(w, 0) for w in rec | pro)
                segs.append((min(seg), seg, (1 - 1 / n) * freed, freed, rec, pro))
        smax = max([*score.values(), *(x[2] for x in segs)], default=0)
        if smax <= 0:
            continue

        def add(ops, v, lvl, sc, h, rec=frozenset(), pro=frozenset()):
            ops = _without_saved_views(g, ops, fwd)
            if len(ops) < min_ops or (ops, comp.id, rec) in seen or check(dg, ops, comp.id, 1, rec):
                return
            top = largest_parts(max_parts(dg, ops | rec, comp.id))
            if top > 1:
                seen.add((ops, comp.id, rec))
                cands.append(Candidate(len(cands), ops, comp.id, v, lvl, sc, h, top, recompute=rec,
                                       reads=recompute_reads(g, rec) | recompute_reads(g, pro),
                                       outs=frozenset(region_outputs(g, ops)), prologue=pro))

        for lvl in range(1, levels + 1):
            band = {v for v, s in score.items()
                    if lvl / levels <= s / smax < (lvl + 1) / levels or (lvl == levels and s == smax)}
            for v in sorted(band):
                if dom[v] & band:
                    continue  # a descendant in the same band is chosen instead
                add(frozenset(dom[v]), v, lvl, score[v], heat[v])
        for v, ops, sc, h, rec, pro in sorted(segs, key=lambda x: (x[0], len(x[4]))):
            if sc > 0:
                add(ops, v, max(1, min(levels, int(levels * sc / smax))), sc, h, rec, pro)
    _link(cands)
    return cands


def _without_saved_views(g: Graph, ops: frozenset[int], fwd: set[int]) -> frozenset[int]:
    """A forward region whose only backward ops are views of its tensors (the
    transposes aten's backward reads the saved probabilities, q and k through)
    leaves them out: split with it, each would be joined into a whole tensor for
    the backward (a [T, T] one for attention), where a backward region can read
    or recompute the slices itself."""
    back = ops - fwd
    if not back or back == ops:
        return ops
    for v in back:
        n = g.nodes[v]
        if not n.outputs or any(t is None or t.alias is None for t in n.outputs) \
                or not all(p in fwd for p in g.preds(v)):
            return ops
    return ops - back


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


def forward_ops(g: Graph) -> set[int]:
    """The ops the loss depends on (the forward of a training step)."""
    loss = [r.node for r, role in zip(g.outputs, g.output_roles) if role and role[0] == "loss"]
    return _closure(g, set(loss), {n.id for n in g.ops}, up=True) if loss else set()


def late_readers(g: Graph, fwd: set[int]) -> dict[Ref, set[int]]:
    """A forward tensor -> the ops outside the forward that read it."""
    late: dict[Ref, set[int]] = {}
    for n in g.ops:
        if n.id not in fwd:
            for r in n.refs():
                if r.node in fwd:
                    late.setdefault(r, set()).add(n.id)
    return late


def recompute_set(dg: DGraph, region: frozenset[int], cid: int, fwd: set[int],
                  late: dict[Ref, set[int]], backward: frozenset[int] = frozenset()
                  ) -> frozenset[int]:
    """Note [recomputed in parts] in ftrans.py: the forward ops whose outputs the
    region reads in slices and nothing else after the forward reads, and so on
    upward while that holds: each part can remake its slice of them, and the
    whole tensors need not be kept from the forward to the region.

    ``backward``: the ops of every backward region of the component. A tensor
    other backward regions read too is also remade when it is computed from
    what the region keeps anyway: an RMSNorm's normalized input (x * rsqrt(
    mean(x^2) + eps)), which the norm's weight gradient in the next region reads
    as well, is remade from the block's input x, which both keep. Past that
    (the block's input itself, from the block before) nothing is added."""
    if region & fwd:
        return frozenset()          # a region in the backward only
    g = dg.graph
    rec = _walk_up(dg, region, cid, lambda r: r.node in fwd and late.get(r, set()) <= region)
    if not backward:
        return rec
    split = region | rec
    kept = {Ref(r.node, r.out) for v in split for r in g.nodes[v].refs() if r.node not in split}
    wider = _walk_up(dg, split, cid,
                     lambda r: r.node in fwd and late.get(r, set()) <= region | backward)
    made: set[int] = set()          # computed from what the region keeps, and weights
    for p in sorted(wider):         # ids are a topological order
        if all(g.nodes[r.node].kind != "op" or Ref(r.node, r.out) in kept or r.node in made
               for r in g.nodes[p].refs()):
            made.add(p)
    useful: set[int] = set()        # ... and read by the region or by those it remakes
    for p in sorted(made, reverse=True):
        if any(w in split or w in useful for w in g.succs(p)):
            useful.add(p)
    if not useful or check(dg, region, cid, 1, rec | useful) is not None:
        return rec
    return rec | frozenset(useful)


def side_recompute(dg: DGraph, region: frozenset[int], cid: int,
                   from_inputs: dict[int, bool]) -> frozenset[int]:
    """The ops computed from the data alone (a causal mask, positions) that the
    region reads in slices: each part makes its own rows of them (at 2048
    tokens the zoo GPT's mask is made from a [T, T] int64 difference, 32 MiB).
    The originals still run for other readers; where every reader remakes its
    slices, the split program drops them (`apply._recomputed_only`)."""
    return _walk_up(dg, region, cid, lambda r: from_inputs.get(r.node, False))


def _walk_up(dg: DGraph, region: frozenset[int], cid: int, ok) -> frozenset[int]:
    """Producers of what ``region`` reads in slices, and upward, while ``ok``
    holds of the tensor read and the producer can make that slice."""
    g, comp = dg.graph, dg.components[cid]
    axes = dg.region_axes(region, cid)
    if isinstance(axes, str):
        return frozenset()
    got: set[int] = set()
    todo = []                       # (a tensor read in slices, the dim it is cut along)
    for v in region:
        refs = list(g.nodes[v].refs())
        todo += [(refs[k], d) for k, d in dg.dims[v].axes[axes[v]].inputs]
    while todo:
        r, d = todo.pop()
        p = r.node
        if p in got or p in region or g.nodes[p].rng or g.nodes[p].kind != "op" or not ok(r):
            continue
        # an ambiguous op (attention's scores, the causal mask) takes the axis
        # that makes the slice its reader cuts: the query rows (Note [ambiguous
        # ops] in dgraph.py); `check` verifies the whole region agrees
        a = next((dg.dims[p].axes[i] for i in
                  ([comp.axis_of[p]] if p in comp.axis_of else comp.choices.get(p, ()))
                  if (r.out, d) in dg.dims[p].axes[i].outputs), None)
        if a is None:
            continue
        got.add(p)
        refs = list(g.nodes[p].refs())
        todo += [(refs[k], dk) for k, dk in a.inputs]
    return frozenset(got)


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


def overlaps(cands, plan, i) -> bool:
    """Region i shares an op with another enabled one. Two regions may recompute
    the same op (each makes its own slices, the original runs unsplit: the causal
    mask every block's backward remakes), and one may recompute ops another
    splits when its copies read only that region's outputs (Note [recomputing
    what another region splits] in ftrans.py)."""
    c = cands[i]
    return any(_clash(c, cands[j]) for j, n in plan.items() if n > 1 and j != i)


def _clash(a: Candidate, b: Candidate) -> bool:
    return bool(a.ops & b.ops) or not recompute_fits(a.reads, a.remade, b.ops, b.outs) \
        or not recompute_fits(b.reads, b.remade, a.ops, a.outs)


def coarsenings(cands: list[Candidate], plan: dict[int, int]) -> list[tuple[str, dict[int, int]]]:
    """Every plan with one enabled region at the next smaller n above 1: the
    reverse of "mutate", not a rule of the paper's (its search walks n upward
    one divisor at a time). A search under a memory budget that jumped to many
    parts at once (`Search.every_block`: all blocks in 16) spends the memory it
    has left on fewer parts where the peak is not, and fewer parts are faster."""
    out = []
    for i, n in sorted(plan.items()):
        if n > 1:
            lower = [d for d in divisors(cands[i].max_n) if 1 < d < n]
            if lower:
                out.append(("coarsen", {**plan, i: lower[-1]}))
    return out


def mutations(cands: list[Candidate], plan: dict[int, int]) -> list[tuple[str, dict[int, int]]]:
    """Every plan one F-Tree rule away. Enabled regions never overlap: enabling an
    ancestor of an enabled node is done by lifting (nested fission is not executed).
    "pack" swaps an enabled region for its packed twin (same ops, dropout masks
    packed) at the same n, "unpack" the packed twin back for its region."""
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
                out.append(("unpack" if c.pack else "pack",
                            {**{k: v for k, v in plan.items() if k != i}, c.twin: plan[i]}))
            p = c.parent
            if p is not None and not any(j in on for j in _ancestors(cands, i)):
                lifted = {k: v for k, v in plan.items() if k not in _descendants(cands, p)}
                lifted[p] = least_parts(cands[p].max_n)
                if not overlaps(cands, lifted, p):
                    out.append(("lift", lifted))
        elif c.pack:
            continue        # a packed twin is reached from its region by "pack" only
        elif not c.children or any(j in on for j in c.children):
            if any(j in on for j in _ancestors(cands, i)):
                continue
            trial = {k: v for k, v in plan.items() if k not in set(_descendants(cands, i))}
            trial[i] = least_parts(c.max_n)
            if not overlaps(cands, trial, i):
                out.append(("enable", trial))
    return out
