"""Spatial fission: a region of image ops split into tiles along height (and width).

Note [tiles with halos]
A batch or channel split cuts every tensor of a region into equal slices. A
tile of an image cannot be cut that way: a convolution's output rows read a
window of input rows a little larger than their own (halo.py), so a region
split along the height runs each tile on overlapping input rows, and the
overlap grows through the chain (two 3x3 convolutions read 2 rows beyond the
tile on each side; a max pool doubles what comes before it).

So a tiled region's parts are not equal. For tile t, each region output's
rows [t*H/n, (t+1)*H/n) are what the tile must make (every output is cut into
n equal bands of its own height: a U-Net's levels are cut alike). Walking the
region's ops backwards, each op's output range is the hull of the rows its
readers in the region need (``Window.need``) and, for a region output, its
band; each op then runs on exactly the input rows its range needs. Input rows
beyond the image are the op's own padding, which the tile adds with
``constant_pad_nd`` (the op runs with padding 0 there, so the first and last
tiles pad and the inner ones do not). Upsampling and transposed convolutions
make a few rows more than asked; the tile narrows them away. Region outputs are
written into full-size tensors at their bands. Width tiles work the same way,
and a 2-D split runs n x n tiles.

The redundant rows are real work: the programs count them (each tile's ops
have the tile's shapes, so the latency model prices the halo), and so does
the memory model. Tiles are not looped in the generated code: their slice
offsets and paddings differ.

Random numbers and a max pool's indices read later are barriers.

Note [gradients in tiles]
A training step tiles its backward (the forward's tensors are what the
backward reads, kept whole; a region of forward ops alone would lower no
peak). The backward is tiled in the same gather form as the forward: each op
makes exactly its own rows of its output from a window of its inputs, so every
row a tile makes equals the whole op's, and nothing overlapping needs adding
up. Elementwise backward ops (ReLU's threshold_backward, BatchNorm's
bn_backward_elemt) read their rows. A convolution's grad_input rows [a, e)
are what the grad_output rows whose windows reach them add up: a transposed
convolution of those rows (padding 0 along the split dim; rows made beyond the
band narrowed away, rows no output reaches padded with zeros); a transposed
convolution's grad_input is, the other way round, a convolution of
grad_output's window. Weight and bias gradients are sums: each tile owns one
equal band of grad_output (of a transposed convolution: of its input) and adds
``convolution_backward`` of that band and the window it pairs with into a
full-size sum made before the first tile, so every (input row, output row)
pair counts once. A transposed convolution's bias sums grad_output's bands
apart: its rows that no input reaches (a stride wider than the kernel, an
output padding) add to the bias alone.
What a tile region stops at: BatchNorm's reductions (their sums must be whole
before bn_backward_elemt reads them), a max pool's backward (its indices
index the whole image), and the ops without rules (upsampling's backward,
the loss's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

import torch

from ..ir.graph import Graph, Node, Ref, Region, TensorInfo, contiguous, iter_refs, map_refs
from .ftrans import recompute_reads, reentered, region_outputs, weak_pieces
from .halo import HALO_TARGETS, Window, spatial_dims, window
from .dims_base import Bound
from .proto import (External, ProtoBuilder, full_result, full_stride, layout_seen, order_after,
                    tensor_info)

aten = torch.ops.aten
# the image dims' names, by tensor rank (NCL, NCHW, NCDHW)
DIM_NAMES = {3: ("length",), 4: ("height", "width"), 5: ("depth", "height", "width")}
MAX_TILES = {1: 16, 2: 8, 3: 4}    # parts per split dim, by how many dims are split


def tiles_name(dims, rank: int = 4) -> str:
    return "×".join(DIM_NAMES[rank][d - 2] for d in dims)


def region_rank(g: Graph, ops) -> int:
    """The rank of a tiled region's images (its first op's output, or the
    grad_output of a convolution's backward that makes no grad_input)."""
    node = g.nodes[min(ops)]
    if node.outputs[0] is None:
        return len(g.tensor(node.refs()[0]).shape)
    return len(node.outputs[0].shape)


GRAD_CONV = "aten.convolution_backward.default"


@dataclass
class Tiling:
    """The windows of a candidate region's ops along each split dim."""
    ops: frozenset[int]
    dims: tuple[int, ...]
    wins: dict[int, dict[int, Window]]        # op -> dim -> window
    outputs: list[Ref]                        # made in bands, tile by tile
    sums: list[Ref] = ()                      # summed over the tiles (weight gradients)
    # forward ops each tile remakes its rows of (Note [gradients in tiles])
    recompute: frozenset[int] = frozenset()

    @property
    def split(self) -> frozenset[int]:
        """The ops each tile runs: the region's and the forward ops it remakes."""
        return self.ops | self.recompute


def _shapes(g: Graph, node: Node):
    ins = [g.tensor(r).shape for r in node.refs()]
    outs = [None if t is None else t.shape for t in node.outputs]
    return ins, outs


def op_windows(g: Graph, v: int, dims, readers=None) -> dict[int, Window] | None:
    """Op ``v``'s window along each of ``dims``, or None where one has no rule."""
    node = g.nodes[v]
    if node.kind != "op" or not node.outputs \
            or (node.outputs[0] is None and node.target != GRAD_CONV):
        return None
    readers = g.readers() if readers is None else readers
    idx_read = len(node.outputs) > 1 and node.outputs[1] is not None \
        and bool(readers.get(Ref(v, 1)))
    ins, outs = _shapes(g, node)
    got = {}
    for d in dims:
        w = window(node, ins, outs, d, idx_read)
        if w is None:
            return None
        got[d] = w
    return got


def tiling(g: Graph, ops, dims, recompute=frozenset()) -> Tiling | str:
    """The region's windows, or why it cannot be tiled along ``dims``
    (``recompute``: forward ops each tile remakes its rows of)."""
    ops, recompute = frozenset(ops), frozenset(recompute)
    if not ops:
        return "empty region"
    if ops & recompute:
        return "an op both in the region and recomputed"
    if len(weak_pieces(g, ops)) != 1:
        return "not weakly connected"
    if reentered(g, ops):
        return "not convex"
    rd = g.readers()
    rank = region_rank(g, ops)
    wins = {}
    split = ops | recompute
    for v in split:
        w = op_windows(g, v, dims, rd)
        if w is None:
            return f"{g.nodes[v].name} has no window rule along dims {dims}"
        wins[v] = w
    for v in recompute:
        if g.nodes[v].target == GRAD_CONV or len(g.nodes[v].outputs[0].shape) != rank:
            return f"{g.nodes[v].name} cannot be remade in tiles"
    for v in split:
        node = g.nodes[v]
        for j, r in enumerate(node.refs()):
            if r.node in split and (r.out != 0 or any(j not in wins[v][d].inputs for d in dims)):
                return f"{node.name} reads a tensor of the region whole"
            if r.node not in ops and any(j in wins[v][d].inputs for d in dims) \
                    and len(g.tensor(r).shape) != rank:
                return f"{node.name} reads a windowed input of another rank"
    outs, sums = [], []
    for r in region_outputs(g, ops):
        if r.out != 0 and g.nodes[r.node].target == GRAD_CONV:
            sums.append(r)
            continue
        if r.out != 0:
            return f"{g.nodes[r.node].name}'s output {r.out} leaves the region"
        if g.tensor(r).alias is not None:
            return f"{g.nodes[r.node].name}'s output is a view"
        outs.append(r)
    return Tiling(ops, tuple(dims), wins, outs, sums, recompute)


def _banded(g: Graph, t: Tiling) -> list[Ref]:
    """The tensors cut into n equal bands per split dim: the region's outputs,
    and the grad_output of each summed op (the band a tile adds up)."""
    out = list(t.outputs)
    for v in sorted(t.ops):
        node = g.nodes[v]
        if node.target == GRAD_CONV:
            out.append(node.refs()[t.wins[v][t.dims[0]].sum_own])
            if _bias_apart(node):
                out.append(node.refs()[0])
    return out


def _bias_apart(node: Node) -> bool:
    """A transposed convolution's bias gradient sums grad_output's bands apart
    from the weight's (which sums the input's bands): rows no input reaches
    (a stride wider than the kernel, an output padding) add to the bias alone."""
    b = Bound(node)
    return bool(b["transposed"] and b["output_mask"][2])


def _band(shape, dims, n: int, tile) -> dict[int, tuple[int, int]]:
    return {d: (tile[i] * shape[d] // n, (tile[i] + 1) * shape[d] // n) for i, d in enumerate(dims)}


def max_tiles(g: Graph, t: Tiling) -> int:
    L = 0
    for r in _banded(g, t):
        for d in t.dims:
            L = math.gcd(L, g.tensor(r).shape[d])
    cap = MAX_TILES[len(t.dims)]
    return max([k for k in range(1, cap + 1) if L % k == 0], default=1)


def check(g: Graph, ops, dims, n: int, recompute=frozenset()) -> str | None:
    t = tiling(g, ops, dims, recompute)
    if isinstance(t, str):
        return t
    for r in _banded(g, t):
        for d in t.dims:
            if g.tensor(r).shape[d] % n:
                name = DIM_NAMES[len(g.tensor(r).shape)][d - 2]
                return f"{n} does not divide {g.nodes[r.node].name}'s {name}"
    return None


def input_needs(g: Graph, t: Tiling, v: int, rng, n: int, tile) -> dict[int, dict]:
    """The rows (per split dim, padding rows included) that op ``v`` reads in
    tile ``tile`` of each input it windows, for its output rows ``rng`` (None:
    the tile needs none of them); a summed op also reads its band of
    grad_output and the input window that band was made from."""
    node, wins = g.nodes[v], t.wins[v]
    refs = node.refs()
    needs = {}
    if node.target != GRAD_CONV:
        if rng is not None:
            for j in range(len(refs)):
                wd = [d for d in t.dims if j in wins[d].inputs]
                if wd:
                    needs[j] = {d: wins[d].need(*rng[d]) for d in wd}
        return needs
    b = Bound(node)
    gi, xi, mask = b.t("grad_output"), b.t("input"), b["output_mask"]
    if rng is not None and mask[0]:
        needs[gi] = {d: wins[d].need(*rng[d]) for d in t.dims}
    if mask[1] or mask[2]:
        oi = wins[t.dims[0]].sum_own
        own = _band(g.tensor(refs[oi]).shape, t.dims, n, tile)
        for j, rows in ((oi, own), (xi if oi == gi else gi,
                                    {d: wins[d].sum_need(*own[d]) for d in t.dims})):
            had = needs.get(j, rows)
            needs[j] = {d: (min(had[d][0], rows[d][0]), max(had[d][1], rows[d][1]))
                        for d in t.dims}
        if _bias_apart(node):
            own = _band(g.tensor(refs[gi]).shape, t.dims, n, tile)
            had = needs[gi]
            needs[gi] = {d: (min(had[d][0], own[d][0]), max(had[d][1], own[d][1]))
                         for d in t.dims}
    return needs


def tile_ranges(g: Graph, t: Tiling, n: int, tile: tuple[int, ...]) -> dict[int, dict | None]:
    """Each op's output rows (per split dim) that tile ``tile`` computes; ops the
    tile does not need are absent (a summed op runs in every tile: None when
    the tile wants none of its output 0)."""
    want: dict[int, dict[int, tuple[int, int]]] = {
        r.node: _band(g.tensor(r).shape, t.dims, n, tile) for r in t.outputs}
    out = {}
    split = t.split
    for v in sorted(split, reverse=True):
        rng = want.get(v)
        if rng is None and g.nodes[v].target != GRAD_CONV:
            continue
        out[v] = rng
        refs = g.nodes[v].refs()
        for j, rows in input_needs(g, t, v, rng, n, tile).items():
            r = refs[j]
            if r.node not in split:
                continue
            rows = _clip(rows, g.tensor(r).shape)
            if rows is None:
                continue        # the reader's window is padding alone here
            got = want.setdefault(r.node, {})
            for d, (lo, hi) in rows.items():
                got[d] = (min(lo, got[d][0]), max(hi, got[d][1])) if d in got else (lo, hi)
    return out


def _clip(rows: dict, size) -> dict | None:
    """``rows`` inside the input; None when along some dim they are padding alone."""
    out = {}
    for d, (lo, hi) in rows.items():
        lo, hi = max(lo, 0), min(hi, size[d])
        if hi <= lo:
            return None
        out[d] = (lo, hi)
    return out


class _Tiles:
    """Expanding one tiled region into a ProtoBuilder (Note [tiles with halos])."""

    def __init__(self, b: ProtoBuilder, g: Graph, t: Tiling, n: int, rid: int):
        self.b, self.g, self.t, self.n, self.rid = b, g, t, n, rid
        self.ops = sorted(t.split)               # the remade forward ops first
        self.last = max(t.ops)
        self.count = n ** len(t.dims)
        self.seq = 0
        self.meta: dict = {}
        self.full_st: dict[Ref, tuple] = {}   # region output -> strides of its full result

    def key(self, phase: int, k: int) -> tuple:
        self.seq += 1
        return (self.last, phase, k, self.seq)

    def add(self, target, op, args, kwargs, outs, k, name, cat, deps=()):
        return self.b.op(target, op, args, kwargs, outs, self.key(1, k), name, cat,
                         Region(self.rid, k, self.count, 0), deps)

    def narrow(self, src, like: TensorInfo, shape, d, start, length, k, name, cat):
        if start == 0 and length == shape[d]:
            return src, shape
        shape = list(shape)
        shape[d] = length
        nid = self.add("aten.narrow.default", aten.narrow.default, [src, d, start, length], {},
                       [tensor_info(shape, like, alias=src)], k, name, cat)
        return Ref(nid, 0), tuple(shape)

    def part_shapes(self, node: Node, args, kwargs):
        """The op's output shapes on the part's inputs (run on the meta device)."""
        refs = iter_refs((args, kwargs))
        specs = [(self.shape_of(r), self.g.tensor(Ref(r.node, r.out)).dtype
                  if isinstance(r, External) else self.b.nodes[r.node].outputs[r.out].dtype)
                 for r in refs]
        # tiles of one shape share the answer: the key has no tensor identities
        pos = lambda r, k: k  # noqa: E731
        key = (node.id, tuple(specs), repr(map_refs(tuple(args), pos, [0])),
               repr(map_refs(dict(kwargs), pos, [0])))
        got = self.meta.get(key)
        if got is None:
            mk = lambda r, k: torch.empty(specs[k][0], dtype=specs[k][1], device="meta")  # noqa: E731
            ctr = [0]
            res = node.op(*map_refs(tuple(args), mk, ctr), **map_refs(dict(kwargs), mk, ctr))
            res = res if isinstance(res, (tuple, list)) else (res,)
            got = self.meta[key] = [tuple(x.shape) if isinstance(x, torch.Tensor) else None
                                    for x in res]
        return got

    def shape_of(self, r: Ref) -> tuple:
        if isinstance(r, External):
            return tuple(self.g.tensor(Ref(r.node, r.out)).shape)
        return tuple(self.b.nodes[r.node].outputs[r.out].shape)

    def allocate(self, r: Ref) -> int:
        """The full-size result of output ``r``, laid out as the output it stands
        for where later ops see its strides (views traced on a permuted layout:
        rotary embeddings on [B, H, S, D] made by a transpose), as in apply.py."""
        t, node = self.g.tensor(r), self.g.nodes[r.node]
        st = full_stride(t) if layout_seen(self.g, r, self.t.ops) else tuple(contiguous(t.shape))
        self.full_st[r] = st
        return full_result(self.b, t, st, self.key(0, 0), node.name + "_full", node.category)

    def fetch(self, r: Ref, rows: dict, w0: Window, k: int, name: str, cat: str) -> Ref:
        """Input ``r``'s ``rows`` (per windowed dim, padding rows included) for
        tile ``k``: a slice of its producer's tile or of the whole input, padded
        with ``w0.pad`` beyond the image, made contiguous where the kernel wants."""
        g, t = self.g, self.t
        full = g.tensor(r).shape
        clip = _clip(rows, full)
        if clip is None:
            # nothing but padding rows: the tile makes them (a conv's first
            # output row may read only its top padding)
            shape = [rows[d][1] - rows[d][0] if d in rows else s for d, s in enumerate(full)]
            tt = g.tensor(r)
            fid = self.add("aten.full.default", aten.full.default, [shape, w0.pad],
                           {"dtype": tt.dtype, "layout": torch.strided,
                            "device": torch.device("cpu"), "pin_memory": False},
                           [tensor_info(shape, tt)], k, f"{name}_pad{k}", cat)
            return Ref(fid, 0)
        if r.node in t.split:
            src, shape = self.made[r.node], self.shape_of(self.made[r.node])
            for d in rows:
                src, shape = self.narrow(src, g.tensor(r), shape, d,
                                         clip[d][0] - self.rng[r.node][d][0],
                                         clip[d][1] - clip[d][0], k, f"{name}_h{k}", cat)
        else:
            sk = (r, tuple(sorted(clip.items())))
            if sk not in self.sliced:
                src, shape = External(r.node, r.out), tuple(full)
                for d in rows:
                    src, shape = self.narrow(src, g.tensor(r), shape, d, clip[d][0],
                                             clip[d][1] - clip[d][0], k,
                                             f"{g.nodes[r.node].name}_t{k}",
                                             g.nodes[r.node].category)
                self.sliced[sk] = src
            src = self.sliced[sk]
            shape = self.shape_of(src)
        pads = {d: (clip[d][0] - rows[d][0], rows[d][1] - clip[d][1]) for d in rows}
        if any(pads[d] != (0, 0) for d in rows):
            return self.pad(src, g.tensor(r), shape, pads, w0.pad, k, f"{name}_pad{k}", cat)
        if w0.dense and self.is_view(src):
            cid = self.add("aten.clone.default", aten.clone.default, [src],
                           {"memory_format": torch.contiguous_format},
                           [tensor_info(shape, g.tensor(r))], k, f"{name}_d{k}", cat)
            return Ref(cid, 0)
        return src

    def pad(self, src: Ref, like: TensorInfo, shape, pads: dict, value, k, name, cat) -> Ref:
        """``constant_pad_nd`` by (before, after) rows per dim; negative crops."""
        flat = []
        for d in reversed(range(2, len(shape))):
            flat += list(pads.get(d, (0, 0)))
        shape = tuple(s + sum(pads.get(d, (0, 0))) for d, s in enumerate(shape))
        pid = self.add("aten.constant_pad_nd.default", aten.constant_pad_nd.default,
                       [src, flat, value], {}, [tensor_info(shape, like)], k, name, cat)
        return Ref(pid, 0)

    def run_tile(self, k: int, tile: tuple[int, ...], dest: dict[Ref, int],
                 writes: dict[Ref, list[int]]) -> None:
        g, t = self.g, self.t
        self.rng = rng = tile_ranges(g, t, self.n, tile)
        self.made = made = {}               # op -> its tile output 0 (rows rng[op])
        self.sliced = {}                    # (region input, rows) -> its slice
        for v in self.ops:
            if v not in rng:
                continue
            node = g.nodes[v]
            if node.target == GRAD_CONV:
                self.grad_conv(v, tile, k, dest, writes)
                continue
            needs = input_needs(g, t, v, rng[v], self.n, tile)
            new_refs = []
            for j, r in enumerate(node.refs()):
                if j not in needs:
                    new_refs.append(External(r.node, r.out))
                    continue
                w0 = t.wins[v][next(iter(needs[j]))]
                new_refs.append(self.fetch(r, needs[j], w0, k, node.name, node.category))
            # per dim, the rows fed by an input windowed along it (each op has one)
            fed = {d: next(j for j in needs if d in needs[j]) for d in t.dims}
            size = {d: self.shape_of(new_refs[fed[d]])[d] for d in t.dims}
            args, kwargs = self.edited(node, size)
            it = iter(new_refs)
            ctr = [0]
            args = map_refs(tuple(args), lambda r, _k: next(it), ctr)
            kwargs = map_refs(dict(kwargs), lambda r, _k: next(it), ctr)
            shapes = self.part_shapes(node, args, kwargs)
            # an extra output that is not an image (eval batch norm's saved
            # statistics: empty on the CPU, per channel on the meta device) is
            # the whole op's; a max pool's indices are the tile's
            outs = [None if tt is None or s is None else
                    tt if i and len(tt.shape) != len(node.outputs[0].shape) else tensor_info(s, tt)
                    for i, (tt, s) in enumerate(zip(node.outputs, shapes))]
            nid = self.add(node.target, node.op, args, kwargs, outs, k,
                           f"{node.name}_t{k}", node.category)
            self.b.nodes[nid].multi = node.multi
            out, shape = Ref(nid, 0), shapes[0]
            for d in t.dims:
                first = t.wins[v][d].origin(needs[fed[d]][d][0])
                a, e = rng[v][d]
                out, shape = self.narrow(out, node.outputs[0], shape, d, a - first, e - a, k,
                                         f"{node.name}_o{k}", node.category)
            made[v] = out
        for r in t.outputs:
            full = g.tensor(r)
            src, shape = made[r.node], self.shape_of(made[r.node])
            dst, dshape = Ref(dest[r], 0), tuple(full.shape)
            nm, cat = g.nodes[r.node].name, g.nodes[r.node].category
            for i, d in enumerate(t.dims):
                a = tile[i] * full.shape[d] // self.n
                e = (tile[i] + 1) * full.shape[d] // self.n
                src, shape = self.narrow(src, full, shape, d, a - rng[r.node][d][0], e - a, k,
                                         f"{nm}_x{k}", cat)
                dst, dshape = self.narrow(dst, full, dshape, d, a, e - a, k, f"{nm}_w{k}", cat)
            writes[r].append(self.add("aten.copy_.default", aten.copy_.default, [dst, src], {},
                                      [tensor_info(dshape, full, alias=dst)], k, f"{nm}_c{k}", cat))

    def grad_conv(self, v: int, tile, k: int, dest: dict[Ref, int],
                  writes: dict[Ref, list[int]]) -> None:
        """A convolution's backward in tile ``k`` (Note [gradients in tiles]):
        its grad_input rows by a transposed convolution of the grad_output rows
        that reach them, its weight and bias gradients from the band of
        grad_output the tile owns, added into their sums."""
        g, t, node = self.g, self.t, self.g.nodes[v]
        b = Bound(node)
        refs = node.refs()
        gi, xi = b.t("grad_output"), b.t("input")
        mask = b["output_mask"]
        wins = t.wins[v]
        weight = External(refs[b.t("weight")].node, refs[b.t("weight")].out)
        stride, dil = list(b["stride"]), list(b["dilation"])
        padding = list(b["padding"])
        padding = padding * (len(stride) // len(padding))
        nm, cat = node.name, node.category
        x_shape = g.tensor(refs[xi]).shape
        w_shape = g.tensor(refs[b.t("weight")]).shape
        # split dims have padding 0: a tile's window carries its own padding rows
        pad0 = [0 if i + 2 in t.dims else p for i, p in enumerate(padding)]
        rng = self.rng[v]
        if rng is not None and mask[0]:
            rows = {d: wins[d].need(*rng[d]) for d in t.dims}
            gin = node.outputs[0]
            band = [rng[d][1] - rng[d][0] if d in rng else s for d, s in enumerate(gin.shape)]
            if any(hi <= lo for lo, hi in rows.values()):
                # no output row reaches these rows (a stride wider than the kernel)
                zid = self.add("aten.full.default", aten.full.default, [band, 0.0],
                               {"dtype": gin.dtype, "layout": torch.strided,
                                "device": torch.device("cpu"), "pin_memory": False},
                               [tensor_info(band, gin)], k, f"{nm}_z{k}", cat)
                self.made[v] = Ref(zid, 0)
            else:
                src = self.fetch(refs[gi], rows, wins[t.dims[0]], k, nm, cat)
                # a convolution's grad_input is a transposed convolution of
                # grad_output, with output padding for the rows along unsplit
                # dims that no output reaches; a transposed one's, a convolution
                opad = [0 if i + 2 in t.dims or b["transposed"] else
                        (x_shape[i + 2] + 2 * padding[i] - dil[i] * (w_shape[i + 2] - 1) - 1) % stride[i]
                        for i in range(len(stride))]
                args = [src, weight, None, stride, pad0, dil, not b["transposed"], opad, b["groups"]]
                shape = self.part_shapes_of(aten.convolution.default, args)
                cid = self.add("aten.convolution.default", aten.convolution.default, args, {},
                               [tensor_info(shape, gin)], k, f"{nm}_gt{k}", cat)
                out, shape = Ref(cid, 0), tuple(shape)
                # made rows start at lo*s - p: narrow to the band, or (rows past
                # the last one any output reaches) pad with zeros
                crop = {d: (wins[d].origin(rows[d][0]) - rng[d][0],
                            rng[d][1] - wins[d].origin(rows[d][0]) - shape[d]) for d in t.dims}
                if all(a <= 0 and e <= 0 for a, e in crop.values()):
                    for d in t.dims:
                        out, shape = self.narrow(out, gin, shape, d, -crop[d][0],
                                                 rng[d][1] - rng[d][0], k, f"{nm}_o{k}", cat)
                else:
                    out = self.pad(out, gin, shape, crop, 0.0, k, f"{nm}_o{k}", cat)
                self.made[v] = out
        if not (mask[1] or mask[2]):
            return
        # the band this tile owns of one input (grad_output; a transposed
        # convolution's input), and the window of the other it pairs with
        oi = wins[t.dims[0]].sum_own
        own = _band(g.tensor(refs[oi]).shape, t.dims, self.n, tile)
        other = {d: wins[d].sum_need(*own[d]) for d in t.dims}
        src = {oi: self.fetch(refs[oi], own, wins[t.dims[0]], k, nm, cat)}
        pj = xi if oi == gi else gi
        src[pj] = self.fetch(refs[pj], other, wins[t.dims[0]], k, nm, cat)
        opad = list(b["output_padding"])
        opad = [0 if i + 2 in t.dims else o for i, o in enumerate(opad * (len(stride) // len(opad)))]
        apart = _bias_apart(node)
        part = {}               # output index -> this tile's part of it
        if mask[1] or not apart:
            mk = [False, mask[1], mask[2] and not apart]
            args = [src[gi], src[xi], weight, b["bias_sizes"], stride, pad0, dil,
                    b["transposed"], opad, b["groups"], mk]
            outs = [None] + [tt if mk[i] else None for i, tt in enumerate(node.outputs) if i]
            nid = self.add(GRAD_CONV, node.op, args, {}, outs, k, f"{nm}_t{k}", cat)
            self.b.nodes[nid].multi = True
            part = {i: Ref(nid, i) for i in (1, 2) if mk[i]}
        if apart:
            gb = node.outputs[2]
            band = self.fetch(refs[gi], _band(g.tensor(refs[gi]).shape, t.dims, self.n, tile),
                              wins[t.dims[0]], k, nm, cat)
            sid = self.add("aten.sum.dim_IntList", aten.sum.dim_IntList,
                           [band, [0] + list(range(2, len(x_shape)))], {}, [gb], k,
                           f"{nm}_db{k}", cat)
            part[2] = Ref(sid, 0)
        for r in t.sums:
            if r.node == v:
                tt = g.tensor(r)
                a = Ref(dest[r], 0)
                writes[r].append(self.add("aten.add_.Tensor", aten.add_.Tensor, [a, part[r.out]],
                                          {}, [tensor_info(tt.shape, tt, alias=a)], k,
                                          f"{nm}_add{k}", cat))

    def part_shapes_of(self, op, args) -> tuple:
        """The shape of ``op`` on ``args`` (proto refs), on the meta device."""
        mk = lambda r, _k: torch.empty(self.shape_of(r), dtype=self.dtype_of(r), device="meta")  # noqa: E731
        return tuple(op(*map_refs(tuple(args), mk, [0])).shape)

    def dtype_of(self, r: Ref):
        if isinstance(r, External):
            return self.g.tensor(Ref(r.node, r.out)).dtype
        return self.b.nodes[r.node].outputs[r.out].dtype

    def is_view(self, r: Ref) -> bool:
        if isinstance(r, External):
            return False
        return self.b.nodes[r.node].outputs[r.out].alias is not None

    def edited(self, node: Node, size: dict) -> tuple[tuple, dict]:
        """The op's arguments with every split dim's edits (``Window.edits``)."""
        b = Bound(node)
        new = {}
        # a pool's one-value padding stands for every image dim: spelled out
        # before one dim's entry changes (F.pad's list is per side already)
        spread = len(node.outputs[0].shape) - 2
        for d in self.t.dims:
            for name, i, val in self.t.wins[node.id][d].edits(size[d]):
                cur = new.get(name, b[name])
                if i is None:
                    new[name] = val
                else:
                    cur = [cur] if isinstance(cur, int) else list(cur)
                    if len(cur) == 1:
                        cur = cur * spread
                    cur[i] = val
                    new[name] = cur
        return b.replace(**new)


def expand_tiles(b: ProtoBuilder, g: Graph, ops, dims, n: int, rid: int, joined: dict,
                 recompute=frozenset()) -> None:
    """Add the tiled region's parts to ``b``; its outputs' full results go into ``joined``."""
    t = tiling(g, ops, dims, recompute)
    if isinstance(t, str):
        raise ValueError(f"invalid tiled region: {t}")
    x = _Tiles(b, g, t, n, rid)
    dest = {r: x.allocate(r) for r in t.outputs}
    for r in t.sums:
        # every tile adds its part into a sum made before the first
        tt, node = g.tensor(r), g.nodes[r.node]
        st = x.full_st[r] = tuple(contiguous(tt.shape))
        dest[r] = b.op("aten.full.default", aten.full.default, [list(tt.shape), 0.0],
                       {"dtype": tt.dtype, "layout": torch.strided, "device": torch.device("cpu"),
                        "pin_memory": False},
                       [tensor_info(tt.shape, tt, stride=st)], x.key(0, 0), node.name + "_acc",
                       node.category)
    writes: dict[Ref, list[int]] = {r: [] for r in t.outputs + list(t.sums)}
    prev = None
    for k, tile in enumerate(product(range(n), repeat=len(dims))):
        first = len(b.nodes)
        x.run_tile(k, tile, dest, writes)
        if prev is not None:
            order_after(b, first, prev)
        prev = len(b.nodes) - 1
    for r in t.outputs + list(t.sums):
        tt, node = g.tensor(r), g.nodes[r.node]
        j = b.op("aten.alias.default", aten.alias.default, [Ref(dest[r], 0)], {},
                 [tensor_info(tt.shape, tt, alias=Ref(dest[r], 0), stride=x.full_st[r])], x.key(2, 0),
                 node.name,
                 node.category, deps=writes[r])
        joined[r] = Ref(j, 0)


def spatial_candidates(g: Graph, hotspots: dict[Ref, int], start: int,
                       halo_only: bool = True, train: bool = True) -> list:
    """F-Tree candidates that tile image regions (Note [tiles with halos]): every
    maximal convex, connected set of ops with window rules, split along its
    first image dim alone and along all of them, numbered from ``start``, scored
    by the ``hotspots`` they split (as `build_ftree`). In a training step, of the
    backward's ops alone (Note [gradients in tiles]); none there with ``train=False``.
    ``halo_only``: only regions with an op whose window is wider than its rows
    (`halo.HALO_TARGETS`); elementwise regions the D-Graph splits already."""
    from .ftree import Candidate, forward_ops, late_readers
    ops = [n.id for n in g.ops]
    if not ops:
        return []
    fwd = forward_ops(g) if any(role and role[0] == "loss" for role in g.output_roles) else set()
    if fwd and not train:
        return []
    late = late_readers(g, fwd) if fwd else {}
    hot_by_op: dict[int, int] = {}
    for r, size in hotspots.items():
        hot_by_op[r.node] = hot_by_op.get(r.node, 0) + size
    rd = g.readers()
    able: dict[int, tuple[int, dict]] = {}       # op -> (rank, its windows)
    for v in ops:
        if v in fwd:
            continue
        node = g.nodes[v]
        out0 = node.outputs[0] if node.outputs else None
        if node.target == GRAD_CONV and node.refs():
            out0 = g.tensor(node.refs()[0])       # its image: grad_output's rank
        dims = spatial_dims(len(out0.shape)) if out0 is not None else ()
        w = op_windows(g, v, dims, rd) if dims else None
        if w is not None:
            able[v] = (len(dims) + 2, w)
    # linked: a reader of an op's output 0 that windows it too, at the same rank
    linked = set()
    for v, (rank, w) in able.items():
        node = g.nodes[v]
        for j, r in enumerate(node.refs()):
            if r.node in able and r.out == 0 and able[r.node][0] == rank \
                    and all(j in wd.inputs for wd in w.values()):
                linked |= {v, r.node}
    out = []
    regions, todo = [], list(weak_pieces(g, linked))
    while todo:
        # the ops a path out of a piece re-enters (those after a BatchNorm's
        # reduction in the backward) make pieces of their own
        piece = frozenset(todo.pop())
        again = reentered(g, piece)
        regions.append(piece - again)
        if again and again != piece:
            todo += weak_pieces(g, again)
    for region in regions:
        for sub in weak_pieces(g, region):
            sub = frozenset(sub)
            if len(sub) < 2 or (halo_only and
                                not any(g.nodes[v].target in HALO_TARGETS for v in sub)):
                continue
            every = spatial_dims(region_rank(g, sub))
            for dims in sorted({(2,), every}, key=len):
                rec = tile_recompute(g, sub, dims, fwd, late, rd) if fwd else frozenset()
                t = tiling(g, sub, dims, rec)
                if isinstance(t, str):
                    continue
                top = max_tiles(g, t)
                if top < 2:
                    continue
                # the forward tensors it remakes are no longer kept for it
                heat = sum(hot_by_op.get(v, 0) for v in sub | rec)
                # eq. 4's gain at the least split: 2 parts along each dim
                score = (1 - 1 / 2 ** len(dims)) * heat
                c = Candidate(start + len(out), sub, -1, min(sub), 1, score, heat, top,
                              tiles=dims, recompute=rec, reads=recompute_reads(g, rec),
                              outs=frozenset(region_outputs(g, sub)))
                out.append(c)
    return out


def tile_recompute(g: Graph, region: frozenset[int], dims, fwd: set[int],
                   late: dict[Ref, set[int]], readers=None) -> frozenset[int]:
    """Note [gradients in tiles]: the forward ops whose outputs a backward tile
    region reads by rows and nothing else in the backward reads, and so on
    upward while that holds and they have window rules: each tile remakes its
    rows of them (a ReLU and BatchNorm's normalize from the convolution's
    output, which BatchNorm's backward keeps anyway), and their whole outputs
    die in the forward instead of waiting for the backward."""
    rank = region_rank(g, region)
    wins = {v: op_windows(g, v, dims, readers) for v in region}
    returned = set(g.outputs)
    rec: set[int] = set()
    todo = sorted(region, reverse=True)
    while todo:
        v = todo.pop()
        if wins.get(v) is None:
            continue
        for j, r in enumerate(g.nodes[v].refs()):
            p = r.node
            if p in rec or p in region or p not in fwd or r.out != 0 or r in returned \
                    or any(j not in wins[v][d].inputs for d in dims) \
                    or not late.get(r, set()) <= region:
                continue
            node = g.nodes[p]
            if node.target == GRAD_CONV or node.outputs[0] is None \
                    or len(node.outputs[0].shape) != rank:
                continue
            w = op_windows(g, p, dims, readers)
            if w is None:
                continue
            wins[p] = w
            rec.add(p)
            todo.append(p)
    return frozenset(rec)
