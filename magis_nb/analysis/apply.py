"""Apply enabled F-Trans to a graph: each region becomes n parts run one after another.

The result is an ordinary Graph, so the memory simulator, the schedulers and the
code generator need nothing special for fission: part k of a region reads
``narrow`` views of the inputs it splits (no copy), runs the region's ops on
part-sized tensors, and writes its outputs into the full result:
  - an output that carries the axis: ``empty`` of the full shape before part 0,
    then ``copy_`` of each part into its ``narrow`` slice;
  - an output reduced over the axis: a ``full`` of 0 (sum, mean) or -inf/+inf
    (max, min) before part 0, into which every part adds (``add_``, or ``addmm_``
    for a matmul) or merges (``maximum``/``minimum``); mean divides at the end.
A final ``alias`` node, ordered after every write, stands for the full result.

Dropout masks a region reads can be packed 8 to a byte first: see Note [packed
masks] in analysis/masks.py.

Note [one sum for a tied weight]
A weight used twice gets the sum of two gradients: a language model whose
output head is its input embedding adds the head's ``mm`` gradient and the
embedding's ``embedding_dense_backward`` after the backward. Split along the
batch, each is a sum over the parts with its own full-size result, and the add
reads both: two vocabulary-sized buffers through the whole region (GPT-Neo:
196 MiB more at the peak than one). When the add's two operands are sums of one
region, laid out alike (contiguous, same shape and dtype) and read by nothing
else but views, both accumulate into one full result and the add becomes an
alias of it, ordered after every write. The sum is the same up to the order of
the additions (fp32 tolerance, as every split sum).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from ..ir.build import alias_arg
from ..ir.graph import Graph, Node, Ref, Region, TensorInfo, contiguous, iter_refs, map_refs
from ..simulate.cost import is_free
from .causal import CAUSAL_MASK, CAUSAL_MASK_TARGET, CausalPart
from .dgraph import DGraph
from .dims_base import dim_index
from .ftrans import (FTrans, check, plan_outputs, recompute_fits, recompute_reads,
                     region_outputs)
from .masks import PackedMask, pack_masks
from .part_layout import RESHAPES, PartLayouts
from .proto import (External, ProtoBuilder, full_result, full_stride, layout_seen, order_after,
                    tensor_info)
from .spatial import check as check_tiles
from .spatial import expand_tiles

aten = torch.ops.aten


def apply_fission(dg: DGraph, regions: Iterable[FTrans]) -> Graph:
    """A new Graph with every enabled region split; regions must not overlap."""
    g = dg.graph
    regions = [f for f in regions if f.enabled]
    owner = _owners(dg, regions)
    b = ProtoBuilder(g)
    proto: dict[int, int] = {}            # original node id -> proto id (unsplit nodes)
    joined: dict[Ref, Ref] = {}           # region output -> proto ref of the full result
    plans = [None if f.tiles else plan_outputs(dg, f) for f in regions]
    _drop_recomputed_outputs(g, regions, plans, owner)
    shared = [{} if f.tiles else shared_sums(g, f, plans[i], owner) for i, f in enumerate(regions)]
    packs: list[tuple[int, int]] = []     # (a packed mask's allocation, its pack op's proto id)
    dead = _recomputed_only(g, regions, owner)
    # Region outputs get their proto ids first so that later consumers can point to them.
    for n in g.nodes:
        if n.id in owner or n.id in dead:
            continue
        proto[n.id] = b.add(_copy(n), (n.id, 0, 0, 0))
    for i, f in enumerate(regions):
        if f.tiles:
            expand_tiles(b, g, f.ops, f.tiles, f.n, i, joined, f.recompute)
        else:
            _expand_region(b, dg, f, i, plans[i], joined, shared[i], packs)

    def resolve(r: Ref, _k=None) -> Ref:
        # an External never equals a Ref (dataclass eq checks the class): look it up as one
        r = Ref(r.node, r.out)
        if r in joined:
            return joined[r]
        return Ref(proto[r.node], r.out)

    for n in g.nodes:
        if n.id in owner or n.id in dead:
            continue
        v = b.nodes[proto[n.id]]
        v.args = map_refs(n.args, resolve)
        v.kwargs = map_refs(n.kwargs, resolve)
        v.deps = tuple(proto[d] for d in n.deps)
        v.outputs = [None if t is None else dataclasses.replace(
            t, alias=None if t.alias is None else resolve(t.alias)) for t in n.outputs]
    # Each packed mask is drawn after the one before it is packed: left free, the
    # scheduler drew every mask first (paper BTLM split in 16: all 97 bool masks,
    # 10.8 GB, alive at the first pack, its peak before the region starts).
    packs.sort()
    for (_, prev), (alloc, _) in zip(packs, packs[1:]):
        v = b.nodes[proto[alloc]]
        v.deps = tuple(v.deps) + (prev,)
    for i in range(len(regions)):
        for aid, (r1, r2) in shared[i].items():
            _stand_for_sum(b.nodes[proto[aid]], g.tensor(Ref(aid, 0)), joined[r1], joined[r2])
    # Region nodes were built with External refs in original ids: resolve them now.
    b.resolve_external(resolve)
    return b.finish([resolve(r) for r in g.outputs], g.output_roles)


def _recomputed_only(g: Graph, regions: list[FTrans], owner) -> set[int]:
    """Recomputed ops no region splits whose outputs nothing reads whole: every
    region reading them recomputes them, and every unsplit reader is one of
    them too. Their originals would make whole tensors nobody reads (the zoo
    GPT's causal mask, [T, T] int64 at 8L: every block's attention forward and
    backward remake their rows of it; the backward's transpose of a block's k,
    which its prologue remakes)."""
    rec_any = set().union(*(f.recompute | f.prologue for f in regions))
    if not rec_any:
        return set()
    returned = {r.node for r in g.outputs}
    dead: set[int] = set()
    for v in sorted(rec_any, reverse=True):      # readers first (ids are topological)
        if v not in owner and v not in returned and not g.nodes[v].rng \
                and not _read_whole(g, v, regions, owner, dead, None):
            dead.add(v)
    return dead


def _read_whole(g: Graph, v: int, regions: list[FTrans], owner, dead, mine: int | None,
                out: int | None = None) -> bool:
    """Something in the split program reads op ``v``'s original output (``out``,
    or any): an unsplit op that stays, or a region other than ``mine`` whose ops
    or recomputed copies read it without recomputing ``v`` themselves."""
    for w in g.succs(v):
        n = g.nodes[w]
        if v in n.deps:
            return True
        if not any(r.node == v and (out is None or r.out == out) for r in n.refs()):
            continue
        if w not in owner and w not in dead:
            return True                 # an unsplit op, or a recomputed op's original
        for k, f in enumerate(regions):
            if k == mine or v in f.prologue and w not in f.prologue:
                continue                # its parts read the prologue's copy
            if w in f.prologue or (w in f.ops or w in f.recompute) \
                    and v not in f.recompute and v not in f.ops:
                return True
    return False


def _drop_recomputed_outputs(g: Graph, regions: list[FTrans], plans: list, owner) -> None:
    """An output of a region read only by regions that recompute it is not made
    whole (Note [recomputing what another region splits] in ftrans.py: the
    forward's probabilities die in its parts)."""
    for i, plan in enumerate(plans):
        if not plan:
            continue
        for r in list(plan):
            if r not in g.outputs and not _read_whole(g, r.node, regions, owner, set(), i, r.out):
                del plan[r]


def _owners(dg: DGraph, regions: list[FTrans]) -> dict[int, int]:
    """Op id -> index of the region that holds it; raises on an invalid or
    overlapping region."""
    owner: dict[int, int] = {}
    for i, f in enumerate(regions):
        why = check_tiles(dg.graph, f.ops, f.tiles, f.n, f.recompute) if f.tiles \
            else check(dg, f.ops, f.comp, f.n, f.recompute)
        if why:
            raise ValueError(f"invalid fission region {i}: {why}")
        for v in f.ops:
            if v in owner:
                raise ValueError("fission regions overlap (nested fission is not supported)")
            owner[v] = i
    g = dg.graph
    for i, f in enumerate(regions):
        remade = f.recompute | f.prologue
        hit = {owner[v] for v in remade if v in owner}
        if hit:
            reads = recompute_reads(g, f.recompute) | recompute_reads(g, f.prologue)
            for j in hit:
                ops = regions[j].ops
                if j == i or not recompute_fits(reads, remade, ops,
                                                frozenset(region_outputs(g, ops))):
                    raise ValueError(f"fission region {i} recomputes an op region {j} "
                                     "splits, from tensors inside that region")
    return owner


def _copy(n: Node) -> Node:
    return Node(n.id, n.name, n.kind, n.target, n.op, n.args, dict(n.kwargs), list(n.outputs),
                n.category, n.role, n.rng, n.multi, n.deps, n.region)


def _fused_matmuls(g: Graph, f: FTrans, plan) -> set[Ref]:
    """Summed region outputs that a plain ``mm`` makes and nothing in the region
    reads: each part's product can be added into the sum by the GEMM itself
    (``addmm_``). Weight gradients of a batch-split region are these; with a
    separate ``add_`` they cost a full read-modify-write of every weight per
    part (GPT-Neo at n=16: 5,088 adds, 7% of the simulated step)."""
    read = {r for v in f.ops for r in g.nodes[v].refs()}
    out = set()
    for r, (how, _) in plan.items():
        n = g.nodes[r.node]
        if how in ("sum", "mean") and n.target == "aten.mm.default" and r.out == 0 \
                and r not in read and not n.kwargs:
            out.add(r)
    return out


def shared_sums(g: Graph, f: FTrans, plan, owner: dict[int, int]) -> dict[int, tuple[Ref, Ref]]:
    """Note [one sum for a tied weight]: the ``add`` ops outside every region
    whose two operands are sums of region ``f``, both laid out alike and read by
    nothing but that add and views. -> {add node id: (first sum, second sum)}."""
    sums = {r for r, (how, _) in plan.items() if how == "sum" and g.tensor(r).alias is None}
    if len(sums) < 2:
        return {}
    rd = g.readers()
    kept = {g.storage_of(r) for r in g.outputs}
    out: dict[int, tuple[Ref, Ref]] = {}
    used: set[Ref] = set()
    for n in g.ops:
        if n.target != "aten.add.Tensor" or n.id in owner or n.kwargs or len(n.args) != 2 \
                or not all(isinstance(a, Ref) for a in n.args):
            continue
        bases = [g.storage_of(a) for a in n.args]
        if bases[0] == bases[1] or not all(r in sums and r not in used and r not in kept
                                           for r in bases):
            continue
        t = g.tensor(Ref(n.id, 0))
        dense = tuple(contiguous(t.shape))
        if not all(_laid_out(g.tensor(a), t, dense) and _laid_out(g.tensor(r), t, dense, True)
                   for a, r in zip(n.args, bases)):
            continue
        if any(u != n.id and not is_free(g.nodes[u]) for r in bases for u in rd.get(r, ())):
            continue
        out[n.id] = (bases[0], bases[1])
        used.update(bases)
    return out


def _laid_out(a: TensorInfo, t: TensorInfo, dense: tuple, unknown_ok: bool = False) -> bool:
    """``a`` has ``t``'s shape and dtype with contiguous strides (a view with
    those covers its whole base from offset 0); ``unknown_ok``: or unknown strides
    (a region output: its full result is then contiguous, `full_stride`)."""
    if tuple(a.shape) != tuple(t.shape) or a.dtype != t.dtype:
        return False
    return (a.stride is None and unknown_ok) or (a.stride is not None and tuple(a.stride) == dense)


def _stand_for_sum(v: Node, t: TensorInfo, j1: Ref, j2: Ref) -> None:
    """Turn the ``add`` of two shared sums (proto node ``v``) into an alias of
    their one full result, after both joins (Note [one sum for a tied weight])."""
    v.target, v.op = "aten.alias.default", aten.alias.default
    v.args, v.kwargs = (j2,), {}
    v.deps = tuple(v.deps) + (j1.node,)
    v.outputs = [tensor_info(t.shape, t, alias=j2, stride=contiguous(t.shape))]


def _expand_region(b: ProtoBuilder, dg: DGraph, f: FTrans, rid: int, plan, joined,
                   shared: dict[int, tuple[Ref, Ref]] | None = None,
                   packs: list | None = None) -> None:
    """Add region ``f``'s parts to ``b``: full-size results first, then each part
    (its ops on part-sized tensors, its outputs merged into the results), then one
    node per output that stands for the full result (into ``joined``).
    ``shared``: pairs of sums that add into one full result (`shared_sums`)."""
    x = _Expansion(b, dg, f, rid, plan)
    for r1, r2 in (shared or {}).values():
        x.mates[r1], x.mates[r2] = r2, r1
    for r in plan:
        x.allocate(r)
    if f.pack:
        x.pack()
        if packs is not None:
            packs.extend((x.g.storage_of(r).node, m.packed.node) for r, m in x.packed.items())
    x.prologue()
    prev_last: int | None = None
    for k in range(x.n):
        first = len(b.nodes)
        part: dict[Ref, Ref] = {}         # region tensor -> its part-k proto ref
        narrows: dict[tuple[Ref, int], Ref] = {}
        for v in x.ops:
            x.split_op(v, k, part, narrows)
        for r in plan:
            x.merge(r, k, part[r])
        # Parts run one after another (the definition of fission): part k+1 starts
        # after part k's last node, whatever order a scheduler picks.
        if prev_last is not None:
            order_after(b, first, prev_last)
        prev_last = len(b.nodes) - 1 if len(b.nodes) > first else None
    for r in plan:
        joined[r] = x.join(r)


def _part_shapes(node: Node, split: tuple[tuple[int, int], ...], n: int) -> list[tuple | None]:
    """The shapes of ``node``'s outputs in one of n parts; ``split`` lists the
    (output, dim) pairs that carry the axis."""
    shapes = []
    for i, t in enumerate(node.outputs):
        if t is None:
            shapes.append(None)
            continue
        s = list(t.shape)
        for o, d in split:
            if o == i:
                s[dim_index(d)] //= n
        shapes.append(tuple(s))
    return shapes


class _Expansion:
    """What the steps of expanding one region share: the region, its output plan,
    the full-size results and the writes into them."""

    def __init__(self, b: ProtoBuilder, dg: DGraph, f: FTrans, rid: int, plan):
        self.b, self.dg, self.g, self.f, self.rid, self.plan = b, dg, dg.graph, f, rid, plan
        # recomputed ops first: each part makes its own slice of what the region
        # reads of them (Note [recomputed in parts])
        self.ops = sorted(f.recompute) + sorted(f.ops)
        self.n = f.n
        # Every input of the region comes from an op with a smaller id than its last
        # op, so keying the region there keeps its parts together in program order.
        self.last = self.ops[-1]
        self.seq = 0
        self.dest: dict[Ref, int] = {}        # region output -> proto id of its full result
        self.full_st: dict[Ref, tuple] = {}   # region output -> strides of its full result
        self.writes: dict[Ref, list[int]] = {r: [] for r in plan}
        self.fused = _fused_matmuls(self.g, f, plan)
        self.packed: dict[Ref, PackedMask] = {}
        self.mates: dict[Ref, Ref] = {}      # a sum -> the sum it shares its full result with
        # op -> (input dims cut, part shapes, chunked args, kwargs): `split_op`
        self.per_op: dict[int, tuple] = {}
        self.layouts = PartLayouts(b, self.g)
        self.view_ok: dict[int, bool] = {}     # view op -> its parts' inputs allow it
        self.whole: dict[Ref, Ref] = {}        # a prologue op's output -> its copy's
        # a sum over the parts of the keys a causal part saw -> its rows per part
        # (Note [the keys a causal part sees] in causal.py)
        self.prefixed: dict[Ref, int] = {}

    def key(self, phase: int, k: int) -> tuple:
        """The sort key of the next node: phase 0 before the parts, 1 in part k, 2 after."""
        self.seq += 1
        return (self.last, phase, k, self.seq)

    def allocate(self, r: Ref) -> None:
        """The full-size destination of output ``r``, made before part 0 and laid
        out as the output it stands for (`full_stride`)."""
        b, g, t = self.b, self.g, self.g.tensor(r)
        mate = self.mates.get(r)
        if mate in self.dest:
            # one full result for both sums (Note [one sum for a tied weight])
            self.dest[r], self.full_st[r] = self.dest[mate], self.full_st[mate]
            return
        how = self.plan[r][0]
        st = self.full_st[r] = full_stride(t) if layout_seen(g, r, self.f.ops) \
            else tuple(contiguous(t.shape))
        plain = st == tuple(contiguous(t.shape))
        nm, cat = g.nodes[r.node].name, g.nodes[r.node].category
        kw = {"dtype": t.dtype, "layout": torch.strided, "device": torch.device("cpu"),
              "pin_memory": False}
        if how == "cat":
            self.dest[r] = full_result(b, t, st, self.key(0, 0), nm + "_full", cat)
            return
        # Reductions accumulate in place into a full-size tensor made before part 0
        # (0 for sums, -inf/+inf for max/min), so every part runs the same code.
        fill = {"sum": 0.0, "mean": 0.0, "max": float("-inf"), "min": float("inf")}[how]
        if plain:
            self.dest[r] = b.op("aten.full.default", aten.full.default, [list(t.shape), fill], kw,
                                [tensor_info(t.shape, t, stride=st)], self.key(0, 0), nm + "_acc", cat)
            return
        # filled in memory order, then permuted to the original's dim order: one
        # allocating op and a view, no in-place fill the rules would have to respect
        order = sorted(range(len(st)), key=lambda d: (-st[d], d))
        shape_m = [t.shape[d] for d in order]
        e = b.op("aten.full.default", aten.full.default, [shape_m, fill], kw,
                 [tensor_info(shape_m, t, stride=contiguous(shape_m))], self.key(0, 0), nm + "_acc", cat)
        self.dest[r] = b.op("aten.permute.default", aten.permute.default,
                            [Ref(e, 0), [order.index(d) for d in range(len(st))]], {},
                            [tensor_info(t.shape, t, alias=Ref(e, 0), stride=st)], self.key(0, 0),
                            nm + "_acc0", cat)

    def outside(self, r: Ref) -> Ref:
        """A tensor made outside the parts, as they read it: its copy in the
        region's prologue, else the original (an External ref)."""
        r = Ref(r.node, r.out)
        return self.whole.get(r) or External(r.node, r.out)

    def producer(self, r: Ref) -> Node:
        """The node that makes ``r``: the original graph's for an External ref,
        else one built here (a part's op, a prologue's copy)."""
        return self.g.nodes[r.node] if isinstance(r, External) else self.b.nodes[r.node]

    def prologue(self) -> None:
        """The region's prologue, run whole before part 0 (Note [recomputed
        whole before the parts] in prologue.py): a copy of each op reading the
        copies of the ones before it and the originals of the rest."""
        for v in sorted(self.f.prologue):
            node = self.g.nodes[v]

            def fix(r: Ref, _k=None) -> Ref:
                return self.outside(r)

            outs = [None if t is None else dataclasses.replace(
                t, alias=None if t.alias is None else self.outside(t.alias)) for t in node.outputs]
            nid = self.b.op(node.target, node.op, map_refs(node.args, fix),
                            map_refs(node.kwargs, fix), outs, self.key(0, 0), f"{node.name}_rw",
                            node.category)
            self.b.nodes[nid].multi = node.multi
            self.layouts.origin[nid] = v
            for i in range(len(node.outputs)):
                self.whole[Ref(v, i)] = Ref(nid, i)

    def pack(self) -> None:
        """Pack the masks the parts read (Note [packed masks]), before part 0."""
        self.packed = pack_masks(self.b, self.g, self.f, self.dg, self.rid, self.key(0, 0))

    def sliced(self, r: Ref, d, k: int, narrows: dict[tuple[Ref, int], Ref]) -> Ref:
        """Part k's slice along ``d`` of region input ``r`` (one per part and dim)."""
        if r in self.packed:
            return self.packed[r].part(self.b, k, self.n, d, self.key(1, k))
        if (r, d) not in narrows:
            t = self.g.tensor(r)
            node = self.g.nodes[r.node]
            src = self.outside(r)
            if isinstance(d, tuple):
                narrows[(r, d)] = self._blocked_slice(src, t, d, k, node)
            else:
                c = t.shape[d] // self.n
                shape = list(t.shape)
                shape[d] = c
                nid = self.b.op("aten.narrow.default", aten.narrow.default, [src, d, k * c, c], {},
                                [tensor_info(shape, t, alias=src)], self.key(1, k), f"{node.name}_s{k}",
                                node.category, Region(self.rid, k, self.n, c))
                narrows[(r, d)] = Ref(nid, 0)
        return narrows[(r, d)]

    def dense(self, pr: Ref, d, k: int, narrows: dict) -> Ref:
        """``pr``, a part read by an op that needs it contiguous (`OpDims.contiguous`):
        a copy when it was narrowed along an inner dim of a region input (a view
        into the whole), else itself. Parts made inside the region are fresh
        tensors, and a blocked slice is a copy already."""
        if isinstance(d, tuple) or (pr, "dense") in narrows:
            return narrows.get((pr, "dense"), pr)
        node = self.b.nodes[pr.node]
        if node.target != "aten.narrow.default" or not isinstance(node.region, Region) \
                or not node.region.chunk:
            return pr
        a0 = node.args[0]
        src = self.producer(a0).outputs[a0.out]     # the original, or a prologue's copy
        if src is None or all(s == 1 for s in src.shape[:node.args[1]]):
            narrows[(pr, "dense")] = pr     # a narrow of the outermost dim is contiguous
            return pr
        narrows[(pr, "dense")] = self.copy(pr, k, "_d")
        return narrows[(pr, "dense")]

    def copy(self, pr: Ref, k: int, suffix: str) -> Ref:
        """A contiguous copy of part k's ``pr``, named after its producer."""
        src = self.b.nodes[pr.node]
        t = src.outputs[pr.out]
        cp = self.b.op("aten.clone.default", aten.clone.default, [pr],
                       {"memory_format": torch.contiguous_format},
                       [tensor_info(t.shape, t)], self.key(1, k), f"{src.name}{suffix}", src.category,
                       Region(self.rid, k, self.n, 0))
        return Ref(cp, 0)

    def _blocked(self, src: Ref, t: TensorInfo, d: tuple, k: int, name: str, cat: str):
        """Part k's chunk of every block of dim ``d`` = (dim, block) of ``src``, as a
        view [.., L/block, block/n, ..] (Note [blocked dims] in dims.py)."""
        dim, blk = d
        shape = list(t.shape)
        c = blk // self.n
        un = shape[:dim] + [shape[dim] // blk, blk] + shape[dim + 1:]
        u = self.b.op("aten.view.default", aten.view.default, [src, un], {},
                      [tensor_info(un, t, alias=src)], self.key(1, k), f"{name}_b{k}", cat,
                      Region(self.rid, k, self.n, 0))
        part = list(un)
        part[dim + 1] = c
        nid = self.b.op("aten.narrow.default", aten.narrow.default, [Ref(u, 0), dim + 1, k * c, c], {},
                        [tensor_info(part, t, alias=Ref(u, 0))], self.key(1, k), f"{name}_s{k}", cat,
                        Region(self.rid, k, self.n, c))
        return Ref(nid, 0), part

    def _blocked_slice(self, src: Ref, t: TensorInfo, d: tuple, k: int, node: Node) -> Ref:
        """A region input's part along a blocked dim: the chunks copied together
        (they are not one strided view unless L == block)."""
        nm, cat = node.name, node.category
        view, part = self._blocked(src, t, d, k, nm, cat)
        flat = list(t.shape)
        flat[d[0]] //= self.n
        reg = Region(self.rid, k, self.n, 0)
        cp = self.b.op("aten.clone.default", aten.clone.default, [view],
                       {"memory_format": torch.contiguous_format},
                       [tensor_info(part, t)], self.key(1, k), f"{nm}_bc{k}", cat, reg)
        fl = self.b.op("aten.view.default", aten.view.default, [Ref(cp, 0), flat], {},
                       [tensor_info(flat, t, alias=Ref(cp, 0))], self.key(1, k), f"{nm}_bf{k}", cat, reg)
        return Ref(fl, 0)

    def split_op(self, v: int, k: int, part: dict[Ref, Ref],
                 narrows: dict[tuple[Ref, int], Ref]) -> None:
        """Op ``v`` on part k's tensors; its outputs go into ``part``."""
        node = self.g.nodes[v]
        every = self.f.split_ops
        if v not in self.per_op:
            # the same in every part: worked out once per op (part 0)
            ax = self.dg.axis(v, self.f.comp, every)
            shapes = _part_shapes(node, ax.outputs, self.n)
            a_idx = self.dg.axis_index(v, self.f.comp, every)
            self.per_op[v] = (dict(ax.inputs), shapes,
                              *self.dg.dims[v].chunk_args(node, a_idx, shapes))
        cut, shapes, args, kwargs = self.per_op[v]
        need = self.dg.dims[v].contiguous

        def sub(r: Ref, idx: int) -> Ref:
            if r.node in every:
                got = part[r]
                return self.dense(got, cut[idx], k, narrows) if idx in need and idx in cut else got
            if idx in cut:
                got = self.sliced(r, cut[idx], k, narrows)
                return self.dense(got, cut[idx], k, narrows) if idx in need else got
            return self.outside(r)

        counter = [0]   # map_refs numbers the refs of args and kwargs as one sequence
        args = map_refs(tuple(args), sub, counter)
        kwargs = map_refs(dict(kwargs), sub, counter)
        args, kwargs, cp = self.causal_mask(node, args, kwargs, k)
        if node.target in RESHAPES:
            # every part's input has the same strides: asked once, in part 0
            if v not in self.view_ok:
                self.view_ok[v] = self.layouts.viewable(node, args, kwargs)
            if not self.view_ok[v]:     # Note [views of parts] in part_layout.py
                args = (self.copy(args[0], k, "_vc"),) + tuple(args[1:])
        outs = []
        for i, t in enumerate(node.outputs):
            if t is None:
                outs.append(None)
                continue
            ai = alias_arg(node.op, i)
            src = args[ai] if ai is not None and ai < len(args) and isinstance(args[ai], Ref) else None
            shape = shapes[i]
            if cp is not None and i in cp.prefix_outs:      # a gradient of the keys it saw
                shape = shape[:2] + (cp.keys_of(k),) + tuple(shape[3:])
                self.prefixed[Ref(v, i)] = cp.rows
            outs.append(tensor_info(shape, t, alias=src))
        again = "_r" if v in self.f.recompute else ""
        nid = self.b.op(node.target, node.op, args, kwargs, outs, self.key(1, k),
                        f"{node.name}{again}_p{k}", node.category, Region(self.rid, k, self.n, 0))
        self.b.nodes[nid].multi = node.multi
        self.layouts.origin[nid] = v
        for i in range(len(node.outputs)):
            part[Ref(v, i)] = Ref(nid, i)

    def causal_mask(self, node: Node, args, kwargs, k: int):
        """A rule's `CausalPart` placeholder becomes part k's own causal mask op
        (analysis/causal.py), made just before the op reads it; returns the
        arguments and the `CausalPart` (None when the op has none)."""
        where = [(i, a) for i, a in enumerate(args) if isinstance(a, CausalPart)] \
            + [(n, a) for n, a in kwargs.items() if isinstance(a, CausalPart)]
        if not where:
            return args, kwargs, None
        (at, cp), = where
        q = list(iter_refs((args, kwargs)))[cp.q]
        like = self.g.tensor(list(node.refs())[cp.q])
        keys = cp.keys_of(k)
        mid = self.b.op(CAUSAL_MASK_TARGET, CAUSAL_MASK, [q, k * cp.rows, keys], {},
                        [tensor_info((cp.rows, keys), like)], self.key(1, k),
                        f"{node.name}_mask{k}", node.category,
                        Region(self.rid, k, self.n, cp.rows, bool(cp.prefix)))
        if isinstance(at, int):
            args = args[:at] + (Ref(mid, 0),) + args[at + 1:]
        else:
            kwargs = {**kwargs, at: Ref(mid, 0)}
        if cp.prefix:       # Note [the keys a causal part sees]
            def first(r, i):
                return self.prefix(r, keys, k, cp.rows, f"{node.name}_kv{i}") \
                    if i in cp.prefix else r
            counter = [0]
            args = map_refs(tuple(args), first, counter)
            kwargs = map_refs(dict(kwargs), first, counter)
        return args, kwargs, cp

    def prefix(self, r: Ref, keys: int, k: int, rows: int, name: str) -> Ref:
        """The first ``keys`` rows (dim 2) of part k's ``r``: a view."""
        src = self.producer(r)
        t = src.outputs[r.out]
        shape = list(t.shape)
        shape[2] = keys
        nid = self.b.op("aten.narrow.default", aten.narrow.default, [r, 2, 0, keys], {},
                        [tensor_info(shape, t, alias=r)], self.key(1, k), f"{name}_{k}",
                        src.category, Region(self.rid, k, self.n, rows, True))
        return Ref(nid, 0)

    def merge(self, r: Ref, k: int, pr: Ref) -> None:
        """Write part k's ``pr`` of output ``r`` into the full result."""
        self.writes[r].append(self._write(r, k, pr))

    def _write(self, r: Ref, k: int, pr: Ref) -> int:
        """The node that writes ``pr`` into output ``r``'s full result."""
        b, t = self.b, self.g.tensor(r)
        how, dim = self.plan[r]
        nm, cat = self.g.nodes[r.node].name, self.g.nodes[r.node].category
        reg = Region(self.rid, k, self.n, 0)
        a = Ref(self.dest[r], 0)
        if how == "cat" and isinstance(dim, tuple):
            # each block's chunk: the part seen as [.., L/block, block/n, ..]
            sl, shape = self._blocked(a, t, dim, k, f"{nm}_w", cat)
            pv = b.op("aten.view.default", aten.view.default, [pr, shape], {},
                      [tensor_info(shape, t, alias=pr)], self.key(1, k), f"{nm}_pv{k}", cat, reg)
            return b.op("aten.copy_.default", aten.copy_.default, [sl, Ref(pv, 0)], {},
                        [tensor_info(shape, t, alias=sl)], self.key(1, k), f"{nm}_c{k}", cat, reg)
        if how == "cat":
            c = t.shape[dim] // self.n
            shape = list(t.shape)
            shape[dim] = c
            sl = b.op("aten.narrow.default", aten.narrow.default, [a, dim, k * c, c], {},
                      [tensor_info(shape, t, alias=a)], self.key(1, k), f"{nm}_w{k}", cat,
                      Region(self.rid, k, self.n, c))
            return b.op("aten.copy_.default", aten.copy_.default, [Ref(sl, 0), pr], {},
                        [tensor_info(shape, t, alias=Ref(sl, 0))], self.key(1, k), f"{nm}_c{k}", cat, reg)
        if r in self.fused:
            # The part's matmul accumulates into the sum itself (a GEMM with
            # beta = 1): no part-sized product, no separate add_ pass.
            mm = b.nodes[pr.node]
            mm.target, mm.op = "aten.addmm_.default", aten.addmm_.default
            mm.args = (a,) + tuple(mm.args)
            mm.outputs = [tensor_info(t.shape, t, alias=a)]
            return pr.node
        if how == "sum" and r in self.prefixed:
            # the keys a causal part saw: into the first rows of the sum (Note
            # [the keys a causal part sees] in causal.py), the last part's all
            # of them (a narrow too: every part runs the same code)
            rows = self.prefixed[r]
            a = self.prefix(a, (k + 1) * rows, k, rows, f"{nm}_pre")
        if how in ("sum", "mean"):
            return b.op("aten.add_.Tensor", aten.add_.Tensor, [a, pr], {},
                        [tensor_info(t.shape, t, alias=a)], self.key(1, k), f"{nm}_add{k}", cat, reg)
        fn = aten.maximum.out if how == "max" else aten.minimum.out
        return b.op(f"aten.{'maximum' if how == 'max' else 'minimum'}.out", fn,
                    [a, pr], {"out": a}, [tensor_info(t.shape, t, alias=a)], self.key(1, k),
                    f"{nm}_{how}{k}", cat, reg)

    def join(self, r: Ref) -> Ref:
        """The node that stands for output ``r``'s full result, after every write
        (and, for a mean, the division by n)."""
        t, node = self.g.tensor(r), self.g.nodes[r.node]
        base = Ref(self.dest[r], 0)
        deps = list(self.writes[r])
        if self.plan[r][0] == "mean":
            dv = self.b.op("aten.div_.Scalar", aten.div_.Scalar, [base, self.n], {},
                           [tensor_info(t.shape, t, alias=base)], self.key(2, 0), f"{node.name}_mean",
                           node.category, deps=deps)
            deps = [dv]
        j = self.b.op("aten.alias.default", aten.alias.default, [base], {},
                      [tensor_info(t.shape, t, alias=base, stride=self.full_st[r])], self.key(2, 0),
                      node.name, node.category, deps=deps)
        return Ref(j, 0)
