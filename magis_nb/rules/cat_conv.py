"""A convolution of a channel concatenation, run as one convolution per piece.

Note [a convolution of a cat]
A U-Net's decoder block reads ``cat([skip, up], 1)`` with its first
convolution, and autograd saves that cat for the convolution's backward (its
weight gradient): a copy of the skip connection, which the encoder's backward
keeps anyway, and of the upsampled tensor, as one storage as big as both. On
the paper U-Net at lat 1.10 the last block's cat (1 GiB) is the biggest tensor
at the plan's peak, in its backward. A convolution is linear in its input
channels (TASO's concat rules):

    conv(cat([a, b], 1), W) = conv(a, W[:, :Ca]) + conv(b, W[:, Ca:])

and its backward is one backward per piece: the input gradients are the
pieces' gradients (the backward's slices of the cat's gradient read them
directly), the weight gradient the cat of the pieces' along dim 1, the bias
gradient the first piece's. Nothing reads the cat any more: the skip and the
upsampled tensor are saved as themselves, and each may be swapped or
recomputed on its own. The sum rounds differently from one convolution over
all channels (same terms, another order): allclose to eager, not bit for bit.

On this CPU (2 threads) the split's ops timed alone cost no more than the cat
and the whole convolution (forward 16.3 -> 11.5 ms, backward 44.6 -> 45.8 ms
at the tiny U-Net's full-resolution block), but the tiny U-Net's step
measured 2-5% slower with its four splits (medians of 30 interleaved steps:
257.5 -> 271.0 ms, 295.1 -> 301.9 ms), and plans priced on those op times
failed their measured latency budget (lat 1.10: 0.608 where the search
without splits reached 0.384). The search therefore uses the split on
simulated devices and GPU timings only (`Space.split_cats`).

Note [a backward of a cat, one per piece]
The forward's split costs a sum per piece after the first, of the
convolution's output: on the paper U-Net++'s five-piece cats that is more
than the cat it replaces. Its backward's split costs nothing (the same
convolutions, the weight gradient's cat is small), and the backward is where
the cat's weight gradient reads it and where its input gradient, as big as
the cat, waits in one storage for the last piece's reader. Split alone (the
forward keeps one convolution of the cat), the cat lives from its making to
the forward convolution only, and each piece's gradient is made when the
schedule wants it. A batch split of a backward recomputes each part's slice
of such a cat for the backward alone (paper U-Net++, `cat_7_r_p0`): there
the backward is the site, and its split is made in every part.

Only where every reader of the cat is the convolution (groups 1, not
transposed) or a backward of it with the same weight (in one fission part
only where no forward reads the cat), and the backward's input gradient is
read only by slices that each take one piece's channels.
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..ir.graph import PART_SUFFIX, Graph, Node, Ref, TensorInfo
from ..ir.passes import Rewriter, written_in_place
from .algebra import _nbytes, direct_readers

aten = torch.ops.aten
CAT, CONV = "aten.cat.default", "aten.convolution.default"
CONV_BWD, SLICE = "aten.convolution_backward.default", "aten.slice.Tensor"


def _pieces(g: Graph, cat: Node) -> list[tuple[Ref, int, int]] | None:
    """(piece, first channel, channels) of a cat along dim 1, or None."""
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    nd = len(cat.outputs[0].shape)
    if nd < 3 or dim % nd != 1 or not all(isinstance(p, Ref) for p in parts):
        return None
    out, off = [], 0
    for p in parts:
        t = g.tensor(p)
        if len(t.shape) != nd or t.dtype != cat.outputs[0].dtype:
            return None
        out.append((p, off, t.shape[1]))
        off += t.shape[1]
    return out if len(out) > 1 else None


def _slice_range(n: Node, size: int) -> tuple[int, int] | None:
    """(start, end) channels of a step-1 slice along dim 1, or None."""
    args = list(n.args) + [None] * (5 - len(n.args))
    dim, start, end, step = args[1], args[2], args[3], args[4]
    nd = len(n.outputs[0].shape)
    if dim is None or dim % nd != 1 or step not in (None, 1):
        return None
    start = 0 if start is None else start
    end = size if end is None else min(end, size)
    return (start, end) if 0 <= start < end else None


def _site(g: Graph, s: int):
    """(cat, weight, stride..groups) that op ``s`` reads, for a convolution or
    a convolution backward; None for another op."""
    n = g.nodes[s]
    if n.kind == "op" and n.target == CONV:
        return n.args[0], n.args[1], tuple(n.args[3:9])
    if n.kind == "op" and n.target == CONV_BWD:
        return n.args[1], n.args[2], tuple(n.args[4:10])
    return None


def why_not_split(g: Graph, conv: int, rd: dict | None = None) -> str | None:
    """None when convolution ``conv`` of a cat can run one convolution per
    piece. ``conv`` may also name a convolution backward whose cat no forward
    convolution reads (a fission part's recomputed cat, Note [a backward of a
    cat, one per piece]): its backwards alone then run per piece."""
    site = _site(g, conv)
    if site is None:
        return "not a convolution"
    src, weight, params = site
    f = g.nodes[conv]
    if not isinstance(src, Ref) or g.nodes[src.node].target != CAT or src.out != 0:
        return "its input is not a cat"
    cat = g.nodes[src.node]
    if params[3] or params[5] != 1:
        return "a transposed or grouped convolution"
    pieces = _pieces(g, cat)
    if pieces is None:
        return "not a cat of two or more tensors along the channels"
    backward = f.target == CONV_BWD
    # a backward site may sit in a fission part, with its cat: its pieces are
    # that part's (`every_part` makes it in each)
    region = (cat.region or None) if backward else None
    if (f.region or None) != region or (cat.region or None) != region or f.deps or cat.deps:
        return "in a fission region"
    if src in g.outputs or src in written_in_place(g):
        return "the cat is an output or written in place"
    rd = direct_readers(g) if rd is None else rd
    dep = {d for n in g.nodes for d in n.deps}
    readers = rd.get(src, ())
    if backward and conv != min(readers):
        return f"{g.nodes[min(readers)].name} reads the cat first"
    for v in readers:
        if v == conv and not backward:
            continue
        b = g.nodes[v]
        if b.target != CONV_BWD or b.args[1] != src or b.args[2] != weight \
                or tuple(b.args[4:10]) != params or (b.region or None) != region or b.deps \
                or v in dep:
            return f"{b.name} reads the cat"
        if Ref(v, 0) in g.outputs:
            return f"{b.name}'s input gradient is an output"
        if b.outputs[0] is not None and _grad_slices(g, rd, v, pieces) is None:
            return f"{b.name}'s input gradient is read other than by one slice per piece"
    if src.node in dep:
        return "an op waits for the cat"
    return None


def _grad_slices(g: Graph, rd, b: int, pieces) -> dict[int, int] | None:
    """Slice node -> piece index, for every reader of backward ``b``'s input gradient."""
    size = sum(c for _, _, c in pieces)
    out = {}
    for v in rd.get(Ref(b, 0), ()):
        s = g.nodes[v]
        if s.target != SLICE or s.args[0] != Ref(b, 0) or s.rng:
            return None
        rng = _slice_range(s, size)
        k = next((i for i, (_, o, c) in enumerate(pieces) if rng == (o, o + c)), None)
        if k is None:
            return None
        out[v] = k
    return out


def split_forms(g: Graph, v: int, rd: dict) -> tuple[bool, bool]:
    """(whole, backward alone): the splits op ``v`` can take (``rd``: the
    graph's `direct_readers`). A convolution that `why_not_split` accepts
    splits whole, and its backwards alone while a backward still reads its
    cat (one whose backward is split already has nothing left to split
    there); a backward that is a site itself, its backwards alone."""
    if why_not_split(g, v, rd) is not None:
        return False, False
    n = g.nodes[v]
    if n.target == CONV_BWD:
        return False, True
    return True, len(rd.get(n.args[0], ())) > 1


def split_sites(g: Graph, backward: bool = False) -> list[int]:
    """The ops that `split_forms` splits whole (with ``backward``: their
    backwards alone), in program order."""
    rd = direct_readers(g)
    return [n.id for n in g.ops if n.target in (CONV, CONV_BWD) and split_forms(g, n.id, rd)[backward]]


def _tagged(name: str, tag: str) -> str:
    """``name`` with ``tag`` before a fission part's suffix (``_p0``, ``_p0_re``),
    which renaming per part (`search.space.every_part`) reads at the end."""
    m = PART_SUFFIX.search(name)
    return name + tag if m is None else name[:m.start()] + tag + name[m.start():]


def split_all(g: Graph, convs: Iterable[int], whole_forward: Iterable[int] = ()) -> Graph:
    """Each of ``convs`` (see `why_not_split`) as one convolution per piece of its
    cat, its backwards likewise; the sum keeps the convolution's name. Those
    in ``whole_forward`` keep their forward convolution of the cat and split
    their backwards only (Note [a backward of a cat, one per piece]); so does
    a backward named in ``convs``, whose cat then goes."""
    convs = list(convs)
    whole = {c for c in whole_forward if g.nodes[c].target == CONV}
    rd = direct_readers(g)
    for c in convs:
        why = why_not_split(g, c, rd)
        if why:
            raise ValueError(f"cannot split {g.nodes[c].name}: {why}")
    site = {c: _site(g, c) for c in convs}
    cat_of = {site[c][0].node: c for c in convs}
    pieces = {c: _pieces(g, g.nodes[site[c][0].node]) for c in convs}
    bwd_of: dict[int, int] = {}     # backward -> its site
    slice_of: dict[int, tuple[int, int]] = {}   # slice -> (backward, piece)
    for c in convs:
        for v in rd.get(site[c][0], ()):
            if g.nodes[v].target == CONV_BWD:
                bwd_of[v] = c
                if g.nodes[v].outputs[0] is not None:
                    for s, k in _grad_slices(g, rd, v, pieces[c]).items():
                        slice_of[s] = (v, k)
    weights: dict[int, list[Ref]] = {}     # site -> its weight's slices
    grads: dict[tuple[int, int], Ref] = {}  # (backward, piece) -> that piece's input gradient

    def weight_slices(rw: Rewriter, c: int, at: Node) -> list[Ref]:
        if c not in weights:
            w = site[c][1]
            wt = g.tensor(w)
            out = []
            for k, (_, off, ch) in enumerate(pieces[c]):
                shape = (wt.shape[0], ch) + tuple(wt.shape[2:])
                nid = rw.add(_tagged(g.nodes[c].name, f"_w{k}"), SLICE, aten.slice.Tensor,
                             (rw.fix(w), 1, off, off + ch), {},
                             [TensorInfo(shape, wt.dtype, 0, rw.fix(w))], g.nodes[w.node].category)
                rw.nodes[nid].region = at.region
                out.append(Ref(nid, 0))
            weights[c] = out
        return weights[c]

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id in cat_of and cat_of[n.id] not in whole:
            return True
        if n.id in slice_of:
            b, k = slice_of[n.id]
            rw.remap[Ref(n.id, 0)] = grads[(b, k)]
            return True
        if n.id in bwd_of:
            c = bwd_of[n.id]
            used = {k for s, (b, k) in slice_of.items() if b == n.id}
            _emit_backward(rw, g, n, pieces[c], weight_slices(rw, c, n), used, grads)
            return True
        if n.id in site and n.target == CONV and n.id not in whole:
            _emit_forward(rw, g, n, pieces[n.id], weight_slices(rw, n.id, n))
            return True
        return False

    return Rewriter(g).run(rule)


def _emit_forward(rw: Rewriter, g: Graph, f: Node, pieces, ws: list[Ref]) -> None:
    out = f.outputs[0]
    acc = None
    for k, ((p, _, _), w) in enumerate(zip(pieces, ws)):
        args = list(f.args)
        args[0], args[1] = rw.fix(p), w
        args[2] = None if k else rw.fix(f.args[2]) if isinstance(f.args[2], Ref) else f.args[2]
        y = rw.add(_tagged(f.name, f"_part{k}"), CONV, f.op, args, dict(f.kwargs),
                   [TensorInfo(out.shape, out.dtype, out.nbytes)], f.category)
        if acc is None:
            acc = Ref(y, 0)
            continue
        last = k == len(pieces) - 1
        s = rw.add(f.name if last else _tagged(f.name, f"_sum{k}"), "aten.add.Tensor", aten.add.Tensor,
                   (acc, Ref(y, 0)), {}, [TensorInfo(out.shape, out.dtype, out.nbytes)],
                   f.category, keep_name=last)
        acc = Ref(s, 0)
    rw.remap[Ref(f.id, 0)] = acc


def _emit_backward(rw: Rewriter, g: Graph, b: Node, pieces, ws: list[Ref], used: set[int],
                   grads: dict) -> None:
    mask = list(b.args[10])
    gw = []
    for k, ((p, _, ch), w) in enumerate(zip(pieces, ws)):
        args = list(b.args)
        args[0], args[1], args[2] = rw.fix(b.args[0]), rw.fix(p), w
        if k:
            args[3] = None
        m = [bool(mask[0]) and k in used, bool(mask[1]), bool(mask[2]) and k == 0]
        args[10] = m
        pt, wt = g.tensor(p), rw.nodes[w.node].outputs[0]
        outs = [TensorInfo(pt.shape, pt.dtype, _nbytes(pt.shape, pt.dtype)) if m[0] else None,
                TensorInfo(wt.shape, wt.dtype, _nbytes(wt.shape, wt.dtype)) if m[1] else None,
                b.outputs[2] if m[2] else None]
        nid = rw.add(_tagged(b.name, f"_part{k}"), CONV_BWD, b.op, args, dict(b.kwargs), outs,
                     b.category)
        rw.nodes[nid].multi = b.multi
        rw.nodes[nid].region = b.region
        grads[(b.id, k)] = Ref(nid, 0)
        if k == 0 and m[2]:
            rw.remap[Ref(b.id, 2)] = Ref(nid, 2)
        gw.append(Ref(nid, 1))
    if mask[1]:
        wt = b.outputs[1]
        cat = rw.add(_tagged(b.name, "_weight"), CAT, aten.cat.default, (gw, 1), {},
                     [TensorInfo(wt.shape, wt.dtype, _nbytes(wt.shape, wt.dtype))], b.category)
        rw.nodes[cat].region = b.region
        rw.remap[Ref(b.id, 1)] = Ref(cat, 0)
