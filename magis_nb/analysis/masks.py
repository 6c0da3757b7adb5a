"""Dropout masks packed 8 to a byte before a split region, unpacked per part.

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

import math

import torch

from ..ir.graph import Graph, Ref, Region, TensorInfo, contiguous
from .dgraph import DGraph
from .ftrans import FTrans
from .proto import External, ProtoBuilder

aten = torch.ops.aten


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
        refs = list(node.refs())
        for idx, d in dg.axis(v, f.comp, f.ops).inputs:
            r = refs[idx]
            t = g.tensor(r)
            if isinstance(d, tuple):
                continue    # a blocked dim (Note [blocked dims]): its parts are copies anyway
            if r.node in f.ops or r in found or t.dtype != torch.bool or not t.shape \
                    or d == len(t.shape) - 1 or t.shape[-1] % 8:
                continue
            base = g.storage_of(r)
            src = g.nodes[base.node]
            if src.target != "aten.empty_strided.default" or list(src.args[1]) != contiguous(t.shape) \
                    or tuple(src.args[0]) != tuple(t.shape) or base in outs:
                continue
            # the allocation itself or the draw into it (in place: same layout), no other view
            if r != base and (g.nodes[r.node].target != "aten.bernoulli_.float" or t.alias != base):
                continue
            if all(u in f.ops or u == r.node for u in rd.get(base, ())):
                found[r] = d
    return found


class PackedMask:
    """One mask packed 8 bools to a byte before the region; each reader in a part
    unpacks its own slice (see Note [packed masks])."""

    def __init__(self, packed: Ref, bits: Ref, t: TensorInfo, name: str, category: str, rid: int):
        self.packed, self.bits, self.t, self.name, self.category, self.rid = \
            packed, bits, t, name, category, rid
        self.narrows: dict[int, Ref] = {}

    def part(self, b: ProtoBuilder, k: int, n: int, d: int, key) -> Ref:
        """The bool slice of part ``k`` of ``n`` along ``d``, unpacked."""
        t, nm, cat = self.t, self.name, self.category
        shape = list(t.shape)
        c = shape[d] // n
        shape[d] = c
        pshape = shape[:-1] + [shape[-1] // 8]
        if k not in self.narrows:
            ps = b.op("aten.narrow.default", aten.narrow.default, [self.packed, d, k * c, c], {},
                      [TensorInfo(tuple(pshape), torch.uint8, 0, self.packed)], key,
                      f"{nm}_ps{k}", cat, Region(self.rid, k, n, c))
            self.narrows[k] = Ref(ps, 0)
        ps = self.narrows[k]
        reg = Region(self.rid, k, n, 0)
        u = b.op("aten.unsqueeze.default", aten.unsqueeze.default, [ps, -1], {},
                 [TensorInfo(tuple(pshape + [1]), torch.uint8, 0, ps)], key, f"{nm}_pu{k}", cat, reg)
        bits = TensorInfo(tuple(pshape + [8]), torch.uint8, math.prod(pshape) * 8)
        sh = b.op("aten.bitwise_right_shift.Tensor", aten.bitwise_right_shift.Tensor,
                  [Ref(u, 0), self.bits], {}, [bits], key, f"{nm}_unpack{k}", cat, reg)
        one = b.op("aten.bitwise_and_.Scalar", aten.bitwise_and_.Scalar, [Ref(sh, 0), 1], {},
                   [TensorInfo(bits.shape, torch.uint8, 0, Ref(sh, 0))], key, f"{nm}_bit{k}", cat, reg)
        flat = b.op("aten.view.default", aten.view.default, [Ref(one, 0), shape], {},
                    [TensorInfo(tuple(shape), torch.uint8, 0, Ref(one, 0))], key, f"{nm}_pv{k}", cat,
                    reg)
        m = b.op("aten.view.dtype", aten.view.dtype, [Ref(flat, 0), torch.bool], {},
                 [TensorInfo(tuple(shape), torch.bool, 0, Ref(flat, 0))], key, f"{nm}_pm{k}", cat, reg)
        return Ref(m, 0)


def pack_masks(b: ProtoBuilder, g: Graph, f: FTrans, dg: DGraph, rid: int, key) -> dict[Ref, PackedMask]:
    """Pack every mask of `packable_masks` right after its draw, all nodes keyed
    ``key``. -> {mask: its PackedMask}."""
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
        src = External(r.node, r.out)
        shape8 = list(t.shape[:-1]) + [t.shape[-1] // 8, 8]
        u8 = b.op("aten.view.dtype", aten.view.dtype, [src, torch.uint8], {},
                  [TensorInfo(tuple(t.shape), torch.uint8, 0, src)], key, f"{nm}_u8", cat)
        v8 = b.op("aten.view.default", aten.view.default, [Ref(u8, 0), shape8], {},
                  [TensorInfo(tuple(shape8), torch.uint8, 0, Ref(u8, 0))], key, f"{nm}_v8", cat)
        sh = b.op("aten.bitwise_left_shift.Tensor", aten.bitwise_left_shift.Tensor,
                  [Ref(v8, 0), Ref(bits, 0)], {}, [TensorInfo(tuple(shape8), torch.uint8, math.prod(shape8))],
                  key, f"{nm}_shift", cat)
        pk = b.op("aten.sum.dim_IntList", aten.sum.dim_IntList, [Ref(sh, 0), [-1], False],
                  {"dtype": torch.uint8}, [TensorInfo(tuple(shape8[:-1]), torch.uint8, math.prod(shape8[:-1]))],
                  key, f"{nm}_packed", cat)
        out[r] = PackedMask(Ref(pk, 0), Ref(bits, 0), t, nm, cat, rid)
    return out
