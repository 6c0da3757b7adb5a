"""Apply enabled F-Trans to a graph: each region becomes n parts run one after another.

The result is an ordinary Graph, so the memory simulator, the schedulers and the
code generator need nothing special for fission: part k of a region reads
``narrow`` views of the inputs it splits (no copy), runs the region's ops on
part-sized tensors, and writes its outputs into the full result:
  - an output that carries the axis: ``empty`` of the full shape before part 0,
    then ``copy_`` of each part into its ``narrow`` slice;
  - an output reduced over the axis: part 0 is cloned, later parts are added
    (``add_``), or merged with ``maximum``/``minimum``, mean divides at the end.
A final ``alias`` node, ordered after every write, stands for the full result.

Note [packed masks]
Dropout masks are drawn whole before a region (see Note [dropout as a mask plus an
elementwise op] in ir/passes.py) and every part reads its slice twice, in the
forward and in the backward, so a region that spans the training step keeps
every mask of the step alive through all its parts: in GPT-Neo split in 16, 4.6
of the 12.5 GB peak. A bool spends a byte on a bit. A mask that nothing outside
the region reads is therefore packed right after its draw (``bitwise_left_shift``
of each group of 8 by 0..7, summed into a uint8: the bits are disjoint, so the
sum is their OR), the bool tensor is freed, and each reader in a part unpacks
its own slice (``bitwise_right_shift`` by 0..7, ``& 1``, viewed as bool): the
same bits, so results stay bit-identical. Packing is along the last dim, so
the mask must be contiguous, a multiple of 8 long there, and split along
another dim. It costs time (GPT-Neo split in 16 on the RTX 3090 roofline: the
peak 0.256 -> 0.175 of the unsplit one, the latency x1.064 -> x1.097), so it is
the search's choice: ``FTrans.pack``, set on a twin of each F-Tree candidate
that has such masks (``ftree.add_pack_twins``, which the search's Space calls),
swapped in and out by the "pack" rule of ``ftree.mutations``.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Iterable

import torch

from ..ir.build import _alias_arg, _ident
from ..ir.graph import Graph, Node, Ref, TensorInfo, iter_refs, map_refs
from .dgraph import DGraph
from .ftrans import FTrans, check, plan_outputs

aten = torch.ops.aten


def _itemsize(t: TensorInfo) -> int:
    try:
        return torch.empty((), dtype=t.dtype).element_size()
    except Exception:  # noqa: BLE001
        n = math.prod(t.shape)
        return t.nbytes // n if n else 4


def _info(shape, like: TensorInfo, alias: Ref | None = None, stride=None) -> TensorInfo:
    shape = tuple(shape)
    nbytes = 0 if alias is not None else math.prod(shape) * _itemsize(like)
    return TensorInfo(shape, like.dtype, nbytes, alias, None if stride is None else tuple(stride))


def _full_stride(t: TensorInfo) -> tuple[int, ...]:
    """The strides of the full-size result a region output is assembled into
    (DESIGN.md §11 "Layout is semantics": the views outside the region were
    traced against the original's strides). The original's when they are dense
    (a transposed or permuted layout: ``scaled_dot_product_attention``'s output);
    for a layout with gaps or overlaps (an expanded or sliced original), dense
    strides with the dims in the original's order (an expanded dim where a
    contiguous layout has it), since the parts are written into it (``copy_``
    cannot write overlapping elements) and every view valid on the original is
    valid on those; contiguous when the graph does not know."""
    shape = tuple(t.shape)
    if t.stride is None or len(t.stride) != len(shape):
        return tuple(_contiguous(shape))
    stride = tuple(t.stride)
    expect = 1
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1):
        if st != expect:
            break
        expect *= sz
    else:
        return stride
    # an expanded dim (stride 0) sits where a contiguous layout puts it
    eff = list(stride)
    for d in reversed(range(len(shape))):
        if eff[d] == 0:
            eff[d] = eff[d + 1] * shape[d + 1] if d + 1 < len(shape) else 1
    order = sorted(range(len(shape)), key=lambda d: (-eff[d], d))   # outermost first
    out, acc = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = acc
        acc *= shape[d]
    return tuple(out)


def _layout_seen(g: Graph, r: Ref, region: frozenset[int]) -> bool:
    """An op after the region reads output ``r`` (directly or through a view), so
    its strides are part of the program. Otherwise ``r`` is only returned (a weight
    gradient, split along the batch and summed): contiguous is then what eager's
    AccumulateGrad gives, and accumulating into a transposed buffer measured up to
    3x slower per part here."""
    return bool(g.readers().get(g.storage_of(r), set()) - region)


class _Builder:
    """Collects proto nodes (ids are provisional) with a sort key for the final order."""

    def __init__(self, g: Graph):
        self.g = g
        self.nodes: list[Node] = []
        self.keys: list[tuple] = []
        self.taken = {n.name for n in g.nodes}

    def add(self, node: Node, key: tuple, fresh_name: str | None = None) -> int:
        node.id = len(self.nodes)
        if fresh_name is not None:
            node.name = _ident(fresh_name, self.taken)
        self.nodes.append(node)
        self.keys.append(key)
        return node.id

    def op(self, target, op, args, kwargs, outputs, key, name, category, region=(), deps=()):
        return self.add(Node(0, "", "op", target, op, tuple(args), dict(kwargs), outputs,
                             category, region=region, deps=tuple(deps)), key, name)

    def finish(self, outputs: list[Ref], roles) -> Graph:
        """Topologically order the proto nodes (ties broken by key) and renumber."""
        n = len(self.nodes)
        preds = [set() for _ in range(n)]
        for v in self.nodes:
            for r in iter_refs((v.args, v.kwargs)):
                preds[v.id].add(r.node)
            preds[v.id].update(v.deps)
        succs = [[] for _ in range(n)]
        for v in range(n):
            for p in preds[v]:
                succs[p].append(v)
        indeg = [len(p) for p in preds]
        heap = [(self.keys[v], v) for v in range(n) if indeg[v] == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            _, v = heapq.heappop(heap)
            order.append(v)
            for w in succs[v]:
                indeg[w] -= 1
                if indeg[w] == 0:
                    heapq.heappush(heap, (self.keys[w], w))
        if len(order) != n:
            raise RuntimeError("fission produced a cyclic graph (please report this)")
        new = {old: i for i, old in enumerate(order)}
        remap = lambda r, _k: Ref(new[r.node], r.out)  # noqa: E731
        out_nodes = []
        for old in order:
            v = self.nodes[old]
            v.id = new[old]
            v.args = map_refs(v.args, remap)
            v.kwargs = map_refs(v.kwargs, remap)
            v.deps = tuple(sorted(new[d] for d in v.deps))
            v.outputs = [None if t is None else dataclasses.replace(
                t, alias=None if t.alias is None else Ref(new[t.alias.node], t.alias.out))
                for t in v.outputs]
            out_nodes.append(v)
        return Graph(out_nodes, [Ref(new[r.node], r.out) for r in outputs], roles)


def apply_fission(dg: DGraph, regions: Iterable[FTrans]) -> Graph:
    """A new Graph with every enabled region split; regions must not overlap."""
    g = dg.graph
    regions = [f for f in regions if f.enabled]
    owner: dict[int, int] = {}
    for i, f in enumerate(regions):
        why = check(dg, f.ops, f.comp, f.n)
        if why:
            raise ValueError(f"invalid fission region {i}: {why}")
        for v in f.ops:
            if v in owner:
                raise ValueError("fission regions overlap (nested fission is not supported)")
            owner[v] = i
    b = _Builder(g)
    proto: dict[int, int] = {}            # original node id -> proto id (unsplit nodes)
    joined: dict[Ref, Ref] = {}           # region output -> proto ref of the full result
    plans = [plan_outputs(dg, f) for f in regions]
    # Region outputs get their proto ids first so that later consumers can point to them.
    for n in g.nodes:
        if n.id in owner:
            continue
        proto[n.id] = b.add(_copy(n), (n.id, 0, 0, 0))
    for i, f in enumerate(regions):
        _expand_region(b, dg, f, i, plans[i], joined)

    def resolve(r: Ref, _k=None) -> Ref:
        # an _Ext never equals a Ref (dataclass eq checks the class): look it up as one
        r = Ref(r.node, r.out)
        if r in joined:
            return joined[r]
        return Ref(proto[r.node], r.out)

    for n in g.nodes:
        if n.id in owner:
            continue
        v = b.nodes[proto[n.id]]
        v.args = map_refs(n.args, resolve)
        v.kwargs = map_refs(n.kwargs, resolve)
        v.deps = tuple(proto[d] for d in n.deps)
        v.outputs = [None if t is None else dataclasses.replace(
            t, alias=None if t.alias is None else resolve(t.alias)) for t in n.outputs]
    # Region nodes were built with "external" refs in original ids: resolve them now.
    for v in b.nodes:
        if getattr(v, "_pending", False):
            v.args = map_refs(v.args, lambda r, _k: resolve(r) if isinstance(r, _Ext) else r)
            v.kwargs = map_refs(v.kwargs, lambda r, _k: resolve(r) if isinstance(r, _Ext) else r)
            v.outputs = [None if t is None else dataclasses.replace(
                t, alias=resolve(t.alias) if isinstance(t.alias, _Ext) else t.alias)
                for t in v.outputs]
            del v._pending
    return b.finish([resolve(r) for r in g.outputs], g.output_roles)


def _fused_matmuls(g: Graph, f: FTrans, plan) -> set[Ref]:
    """Summed region outputs that a plain ``mm`` makes and nothing in the region
    reads: each part's product can be added into the sum by the GEMM itself
    (``addmm_``). Weight gradients of a batch-split region are these; with a
    separate ``add_`` they cost a full read-modify-write of every weight per
    part (GPT-Neo at n=16: 5,088 adds, 7% of the simulated step)."""
    read = {r for v in f.ops for r in iter_refs((g.nodes[v].args, g.nodes[v].kwargs))}
    out = set()
    for r, (how, _) in plan.items():
        n = g.nodes[r.node]
        if how in ("sum", "mean") and n.target == "aten.mm.default" and r.out == 0 \
                and r not in read and not n.kwargs:
            out.add(r)
    return out


class _Ext(Ref):
    """A reference to a tensor of the original graph, resolved after all regions exist."""


def _contiguous(shape) -> list[int]:
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return st[::-1]


def packable_masks(g: Graph, f: FTrans, dg: DGraph) -> dict[Ref, int]:
    """Region inputs worth packing (Note [packed masks]): bool tensors split along
    a dim other than the last, contiguous (drawn into ``empty_strided`` with
    contiguous strides), a multiple of 8 long in the last dim, and read by nothing
    outside the region but the op that wrote them. -> {tensor: split dim}."""
    found: dict[Ref, int] = {}
    rd = g.readers()
    outs = {g.storage_of(r) for r in g.outputs}
    for v in sorted(f.ops):
        node = g.nodes[v]
        refs = list(iter_refs((node.args, node.kwargs)))
        for idx, d in dg.axis(v, f.comp).inputs:
            r = refs[idx]
            t = g.tensor(r)
            if r.node in f.ops or r in found or t.dtype != torch.bool or not t.shape \
                    or d == len(t.shape) - 1 or t.shape[-1] % 8:
                continue
            base = g.storage_of(r)
            src = g.nodes[base.node]
            if src.target != "aten.empty_strided.default" or list(src.args[1]) != _contiguous(t.shape) \
                    or tuple(src.args[0]) != tuple(t.shape) or base in outs:
                continue
            # the allocation itself or the draw into it (in place: same layout), no other view
            if r != base and (g.nodes[r.node].target != "aten.bernoulli_.float" or t.alias != base):
                continue
            if all(u in f.ops or u == r.node for u in rd.get(base, ())):
                found[r] = d
    return found


class _Packed:
    """One mask packed 8 bools to a byte before the region; each reader in a part
    unpacks its own slice (see Note [packed masks])."""

    def __init__(self, packed: Ref, bits: Ref, t: TensorInfo, name: str, category: str, rid: int):
        self.packed, self.bits, self.t, self.name, self.category, self.rid = \
            packed, bits, t, name, category, rid
        self.narrows: dict[int, Ref] = {}

    def part(self, b: "_Builder", k: int, n: int, d: int, key) -> Ref:
        t, nm, cat = self.t, self.name, self.category
        shape = list(t.shape)
        c = shape[d] // n
        shape[d] = c
        pshape = shape[:-1] + [shape[-1] // 8]
        if k not in self.narrows:
            ps = b.op("aten.narrow.default", aten.narrow.default, [self.packed, d, k * c, c], {},
                      [TensorInfo(tuple(pshape), torch.uint8, 0, self.packed)], key,
                      f"{nm}_ps{k}", cat, (self.rid, k, n, c))
            self.narrows[k] = Ref(ps, 0)
        ps = self.narrows[k]
        u = b.op("aten.unsqueeze.default", aten.unsqueeze.default, [ps, -1], {},
                 [TensorInfo(tuple(pshape + [1]), torch.uint8, 0, ps)], key, f"{nm}_pu{k}", cat,
                 (self.rid, k, n, 0))
        bits = TensorInfo(tuple(pshape + [8]), torch.uint8, math.prod(pshape) * 8)
        sh = b.op("aten.bitwise_right_shift.Tensor", aten.bitwise_right_shift.Tensor,
                  [Ref(u, 0), self.bits], {}, [bits], key, f"{nm}_unpack{k}", cat, (self.rid, k, n, 0))
        one = b.op("aten.bitwise_and_.Scalar", aten.bitwise_and_.Scalar, [Ref(sh, 0), 1], {},
                   [TensorInfo(bits.shape, torch.uint8, 0, Ref(sh, 0))], key, f"{nm}_bit{k}", cat,
                   (self.rid, k, n, 0))
        flat = b.op("aten.view.default", aten.view.default, [Ref(one, 0), shape], {},
                    [TensorInfo(tuple(shape), torch.uint8, 0, Ref(one, 0))], key, f"{nm}_pv{k}", cat,
                    (self.rid, k, n, 0))
        m = b.op("aten.view.dtype", aten.view.dtype, [Ref(flat, 0), torch.bool], {},
                 [TensorInfo(tuple(shape), torch.bool, 0, Ref(flat, 0))], key, f"{nm}_pm{k}", cat,
                 (self.rid, k, n, 0))
        return Ref(m, 0)


def _pack_masks(b: "_Builder", g: Graph, f: FTrans, dg: DGraph, rid: int, key) -> dict[Ref, _Packed]:
    masks = packable_masks(g, f, dg)
    if not masks:
        return {}
    bits = b.op("aten.arange.default", aten.arange.default, [8],
                {"dtype": torch.uint8, "layout": torch.strided, "device": torch.device("cpu"),
                 "pin_memory": False}, [TensorInfo((8,), torch.uint8, 8)], key, f"bits{rid}", "activation")
    out = {}
    for r in masks:
        t = g.tensor(r)
        nm, cat = g.nodes[r.node].name, g.nodes[r.node].category
        src = _Ext(r.node, r.out)
        shape8 = list(t.shape[:-1]) + [t.shape[-1] // 8, 8]
        u8 = b.op("aten.view.dtype", aten.view.dtype, [src, torch.uint8], {},
                  [TensorInfo(tuple(t.shape), torch.uint8, 0, src)], key, f"{nm}_u8", cat)
        b.nodes[u8]._pending = True
        v8 = b.op("aten.view.default", aten.view.default, [Ref(u8, 0), shape8], {},
                  [TensorInfo(tuple(shape8), torch.uint8, 0, Ref(u8, 0))], key, f"{nm}_v8", cat)
        sh = b.op("aten.bitwise_left_shift.Tensor", aten.bitwise_left_shift.Tensor,
                  [Ref(v8, 0), Ref(bits, 0)], {}, [TensorInfo(tuple(shape8), torch.uint8, math.prod(shape8))],
                  key, f"{nm}_shift", cat)
        pk = b.op("aten.sum.dim_IntList", aten.sum.dim_IntList, [Ref(sh, 0), [-1], False],
                  {"dtype": torch.uint8}, [TensorInfo(tuple(shape8[:-1]), torch.uint8, math.prod(shape8[:-1]))],
                  key, f"{nm}_packed", cat)
        out[r] = _Packed(Ref(pk, 0), Ref(bits, 0), t, nm, cat, rid)
    return out


def _copy(n: Node) -> Node:
    return Node(n.id, n.name, n.kind, n.target, n.op, n.args, dict(n.kwargs), list(n.outputs),
                n.category, n.role, n.rng, n.multi, n.deps, n.region)


def _expand_region(b: _Builder, dg: DGraph, f: FTrans, rid: int, plan, joined) -> None:
    g = dg.graph
    ops = sorted(f.ops)
    # Every input of the region comes from an op with a smaller id than its last
    # op, so keying the region there keeps its parts together in program order.
    last = ops[-1]
    n = f.n
    seq = [0]

    def key(phase, k):
        seq[0] += 1
        return (last, phase, k, seq[0])

    # Full-size destinations of concatenated outputs, allocated before part 0,
    # laid out as the outputs they stand for (`_full_stride`).
    dest: dict[Ref, int] = {}
    full_st: dict[Ref, tuple] = {}
    for r, (how, dim) in plan.items():
        t = g.tensor(r)
        st = full_st[r] = _full_stride(t) if _layout_seen(g, r, f.ops) else tuple(_contiguous(t.shape))
        plain = st == tuple(_contiguous(t.shape))
        nm, cat = g.nodes[r.node].name, g.nodes[r.node].category
        kw = {"dtype": t.dtype, "layout": torch.strided, "device": torch.device("cpu"),
              "pin_memory": False}
        if how == "cat":
            if plain:
                dest[r] = b.op("aten.empty.memory_format", aten.empty.memory_format,
                               [list(t.shape)], kw, [_info(t.shape, t, stride=st)], key(0, 0),
                               nm + "_full", cat)
            else:
                dest[r] = b.op("aten.empty_strided.default", aten.empty_strided.default,
                               [list(t.shape), list(st)], kw, [_info(t.shape, t, stride=st)],
                               key(0, 0), nm + "_full", cat)
            continue
        # Reductions accumulate in place into a full-size tensor made before part 0
        # (0 for sums, -inf/+inf for max/min), so every part runs the same code.
        fill = {"sum": 0.0, "mean": 0.0, "max": float("-inf"), "min": float("inf")}[how]
        if plain:
            dest[r] = b.op("aten.full.default", aten.full.default, [list(t.shape), fill], kw,
                           [_info(t.shape, t, stride=st)], key(0, 0), nm + "_acc", cat)
        else:
            # filled in memory order, then permuted to the original's dim order: one
            # allocating op and a view, no in-place fill the rules would have to respect
            order = sorted(range(len(st)), key=lambda d: (-st[d], d))
            shape_m = [t.shape[d] for d in order]
            e = b.op("aten.full.default", aten.full.default, [shape_m, fill], kw,
                     [_info(shape_m, t, stride=_contiguous(shape_m))], key(0, 0),
                     nm + "_acc", cat)
            dest[r] = b.op("aten.permute.default", aten.permute.default,
                           [Ref(e, 0), [order.index(d) for d in range(len(st))]], {},
                           [_info(t.shape, t, alias=Ref(e, 0), stride=st)], key(0, 0),
                           nm + "_acc0", cat)
    writes: dict[Ref, list[int]] = {r: [] for r in plan}
    fused = _fused_matmuls(g, f, plan)
    packed = _pack_masks(b, g, f, dg, rid, key(0, 0)) if f.pack else {}
    prev_part: list[int] = []
    for k in range(n):
        first_of_part = len(b.nodes)
        part: dict[Ref, Ref] = {}
        narrows: dict[tuple[Ref, int], Ref] = {}

        def sliced(r: Ref, d: int) -> Ref:
            if r in packed:
                return packed[r].part(b, k, n, d, key(1, k))
            if (r, d) not in narrows:
                t = g.tensor(r)
                c = t.shape[d] // n
                shape = list(t.shape)
                shape[d] = c
                src = _Ext(r.node, r.out)
                nid = b.op("aten.narrow.default", aten.narrow.default, [src, d, k * c, c], {},
                           [_info(shape, t, alias=src)], key(1, k),
                           f"{g.nodes[r.node].name}_s{k}", g.nodes[r.node].category, (rid, k, n, c))
                b.nodes[nid]._pending = True
                narrows[(r, d)] = Ref(nid, 0)
            return narrows[(r, d)]

        for v in ops:
            node = g.nodes[v]
            ax = dg.axis(v, f.comp)
            cut = dict(ax.inputs)
            shapes = []
            for i, t in enumerate(node.outputs):
                if t is None:
                    shapes.append(None)
                    continue
                s = list(t.shape)
                for o, d in ax.outputs:
                    if o == i:
                        s[d] //= n
                shapes.append(tuple(s))
            a_idx = dg.components[f.comp].axis_of[v]
            args, kwargs = dg.dims[v].chunk_args(node, a_idx, shapes)
            pending = [False]

            def sub(r: Ref, idx: int) -> Ref:
                if r.node in f.ops:
                    return part[r]
                if idx in cut:
                    return sliced(r, cut[idx])
                pending[0] = True
                return _Ext(r.node, r.out)

            counter = [0]
            args = map_refs(tuple(args), sub, counter)
            kwargs = map_refs(dict(kwargs), sub, counter)
            outs = []
            for i, t in enumerate(node.outputs):
                if t is None:
                    outs.append(None)
                    continue
                ai = _alias_arg(node.op, i)
                src = args[ai] if ai is not None and ai < len(args) and isinstance(args[ai], Ref) else None
                outs.append(_info(shapes[i], t, alias=src))
            nid = b.op(node.target, node.op, args, kwargs, outs, key(1, k),
                       f"{node.name}_p{k}", node.category, (rid, k, n, 0))
            b.nodes[nid].multi = node.multi
            if pending[0] or any(isinstance(t.alias, _Ext) for t in outs if t is not None):
                b.nodes[nid]._pending = True
            for i in range(len(node.outputs)):
                part[Ref(v, i)] = Ref(nid, i)
        # Merge this part's outputs into the full results.
        for r, (how, dim) in plan.items():
            t = g.tensor(r)
            pr = part[r]
            nm = g.nodes[r.node].name
            cat = g.nodes[r.node].category
            if how == "cat":
                c = t.shape[dim] // n
                shape = list(t.shape)
                shape[dim] = c
                full = Ref(dest[r], 0)
                sl = b.op("aten.narrow.default", aten.narrow.default, [full, dim, k * c, c], {},
                          [_info(shape, t, alias=full)], key(1, k), f"{nm}_w{k}", cat, (rid, k, n, c))
                w = b.op("aten.copy_.default", aten.copy_.default, [Ref(sl, 0), pr], {},
                         [_info(shape, t, alias=Ref(sl, 0))], key(1, k), f"{nm}_c{k}", cat,
                         (rid, k, n, 0))
            elif r in fused:
                # The part's matmul accumulates into the sum itself (a GEMM with
                # beta = 1): no part-sized product, no separate add_ pass.
                a = Ref(dest[r], 0)
                mm = b.nodes[pr.node]
                mm.target, mm.op = "aten.addmm_.default", aten.addmm_.default
                mm.args = (a,) + tuple(mm.args)
                mm.outputs = [_info(t.shape, t, alias=a)]
                w = pr.node
            else:
                a = Ref(dest[r], 0)
                if how in ("sum", "mean"):
                    w = b.op("aten.add_.Tensor", aten.add_.Tensor, [a, pr], {},
                             [_info(t.shape, t, alias=a)], key(1, k), f"{nm}_add{k}", cat,
                             (rid, k, n, 0))
                else:
                    fn = aten.maximum.out if how == "max" else aten.minimum.out
                    w = b.op(f"aten.{'maximum' if how == 'max' else 'minimum'}.out", fn,
                             [a, pr], {"out": a}, [_info(t.shape, t, alias=a)], key(1, k),
                             f"{nm}_{how}{k}", cat, (rid, k, n, 0))
            writes[r].append(w)
        # Parts run one after another (the definition of fission): part k+1 starts
        # after part k's last node, whatever order a scheduler picks.
        part_nodes = list(range(first_of_part, len(b.nodes)))
        if prev_part:
            for v in part_nodes:
                node = b.nodes[v]
                inner = any(not isinstance(r, _Ext) and r.node >= first_of_part
                            for r in iter_refs((node.args, node.kwargs)))
                if not inner:
                    node.deps = tuple(node.deps) + (prev_part[-1],)
        prev_part = part_nodes
    for r, (how, dim) in plan.items():
        t = g.tensor(r)
        nm = g.nodes[r.node].name
        cat = g.nodes[r.node].category
        base = Ref(dest[r], 0)
        deps = list(writes[r])
        if how == "mean":
            dv = b.op("aten.div_.Scalar", aten.div_.Scalar, [base, n], {},
                      [_info(t.shape, t, alias=base)], key(2, 0), f"{nm}_mean", cat, deps=deps)
            deps = [dv]
        j = b.op("aten.alias.default", aten.alias.default, [base], {},
                 [_info(t.shape, t, alias=base, stride=full_st[r])], key(2, 0), nm, cat,
                 deps=deps)
        joined[r] = Ref(j, 0)
