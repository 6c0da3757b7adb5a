"""The next-token loss without its shift: every position, the last one ignored.

Note [the shifted loss]
Causal LMs compute ``cross_entropy(logits[:, :-1].reshape(-1, V),
labels[:, 1:].reshape(-1))`` (HF's models, the zoo's): the slice leaves S-1
positions, so the loss head falls out of the sequence's D component (a slice has
no axis along the sliced dim) and into one of length S-1, and the backward's
``slice_backward`` pads the [B,S-1,V] gradient back to a fresh [B,S,V]. The
logits and their gradient, [tokens, vocab], are the largest tensors of
small-batch LM training, and the head could never be split along the tokens.

The same loss over all S positions, with the labels shifted by one and the last
position given ``ignore_index``, is the same number: NLL skips ignored
targets, in the sum and in the count of a mean, and gives them a zero
gradient, which ``log_softmax``'s backward keeps zero (``g - exp(lp) * sum(g)``
with g = 0). So ``logits[:, :-1] -> log_softmax -> nll`` becomes
``logits -> log_softmax -> nll`` with ``labels' = cat(labels[:, 1:], ignore)``,
and ``slice_backward`` becomes the gradient itself (a view, no copy). Results
equal eager's to rounding (one more zero term in each sum). The rows of the
head are now the sequence's rows, so fission splits it with the blocks.

The pass matches the pattern from each ``nll_loss_forward`` and re-derives the
shapes of what reads the head (detaches, the loss's backward, views of the
gradient) by running those ops on meta tensors. Anything else reading the
sliced logits (the logits returned, a second loss on them) leaves the graph
unchanged.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .build import alias_arg
from .graph import Graph, Node, Ref, TensorInfo, contiguous, map_refs
from .passes import Rewriter

aten = torch.ops.aten

_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
_SLICE = "aten.slice.Tensor"


def _arg_ref(g: Graph, n: Node, i: int = 0) -> Node | None:
    a = n.args[i] if len(n.args) > i else None
    return g.nodes[a.node] if isinstance(a, Ref) else None


def _through_copy(g: Graph, n: Node | None) -> tuple[Node | None, list[int]]:
    """Back from a view through an optional clone to a slice: (slice, [clone ids])."""
    if n is None or n.target not in _VIEWS:
        return None, []
    src = _arg_ref(g, n)
    skipped = []
    if src is not None and src.target == "aten.clone.default":
        skipped.append(src.id)
        src = _arg_ref(g, src)
    return (src if src is not None and src.target == _SLICE else None), skipped


def _slice_args(n: Node):
    dim, start, end = (list(n.args[1:4]) + [0, None, None])[:3]
    step = n.args[4] if len(n.args) > 4 else 1
    return dim, start, end, step


@dataclasses.dataclass
class _Match:
    logits: Ref          # [.., S, V] before the slice
    view: int            # the [N(S-1), V] view the log_softmax reads
    dropped: list[int]   # the slice and its clone
    target: int          # the [N(S-1)] view of the labels
    labels_part: Ref     # labels[:, 1:] (or its clone): what the new labels start with
    dim: int
    ignore: int


def _match(g: Graph, nll: Node) -> _Match | None:
    lp, tv = _arg_ref(g, nll, 0), _arg_ref(g, nll, 1)
    if lp is None or lp.target != "aten._log_softmax.default" or lp.args[1] not in (1, -1):
        return None
    u = _arg_ref(g, lp)
    s, clones = _through_copy(g, u)
    ts, tclones = _through_copy(g, tv)
    if s is None or ts is None:
        return None
    L, lab = g.tensor(s.args[0]), g.tensor(ts.args[0])
    d, start, end, step = _slice_args(s)
    dt, tstart, tend, tstep = _slice_args(ts)
    r = len(L.shape)
    if r < 2 or d < 0:
        d += r
    S, V = L.shape[d] if 0 <= d < r else 0, L.shape[-1]
    if not (d == r - 2 and start == 0 and end in (-1, S - 1) and step == 1):
        return None
    if dt < 0:
        dt += len(lab.shape)
    if not (tuple(lab.shape) == tuple(L.shape[:-1]) and dt == d and tstart == 1
            and (tend is None or tend >= S) and tstep == 1):
        return None
    if tuple(g.tensor(Ref(u.id, 0)).shape) != (math.prod(L.shape[:-1]) // S * (S - 1), V):
        return None
    # the slice and its clone feed only this view
    rd = {v: set() for v in [s.id] + clones}
    for n in g.ops:
        for a in n.refs():
            if a.node in rd:
                rd[a.node].add(n.id)
    chain = [s.id] + clones + [u.id]
    if any(rd[v] - {chain[i + 1]} for i, v in enumerate(chain[:-1])):
        return None
    if any(r.node in chain for r in g.outputs):
        return None
    st = L.stride
    if st is not None and list(st) != contiguous(L.shape):
        return None
    part = Ref(tclones[-1], 0) if tclones else Ref(ts.id, 0)
    return _Match(s.args[0], u.id, chain[:-1], tv.id, part, d, int(nll.args[4]))


def unshift_loss(g: Graph) -> Graph:
    """See Note [the shifted loss]."""
    matches = [m for n in g.ops if n.target == "aten.nll_loss_forward.default"
               for m in [_match(g, n)] if m is not None]
    if not matches:
        return g
    try:
        return _rewrite(g, matches)
    except Exception:  # noqa: BLE001 - a shape the meta run cannot redo: keep the graph
        return g


def _rewrite(g: Graph, matches: list[_Match]) -> Graph:
    rw = Rewriter(g)
    by_view = {m.view: m for m in matches}
    by_target = {m.target: m for m in matches}
    dropped = {v for m in matches for v in m.dropped}
    grown: dict[tuple, tuple] = {}       # a shape of the sliced head -> the unsliced one
    for m in matches:
        L = tuple(g.tensor(m.logits).shape)
        cut = L[:m.dim] + (L[m.dim] - 1,) + L[m.dim + 1:]
        grown[cut] = L
        grown[(math.prod(cut[:-1]), cut[-1])] = (math.prod(L[:-1]), L[-1])

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id in dropped:
            return True
        if n.id in by_view:
            m = by_view[n.id]
            L = g.tensor(m.logits)
            t = n.outputs[0]
            shape = (math.prod(L.shape[:-1]), L.shape[-1])
            nid = rw.add(n.name, "aten.view.default", aten.view.default, (rw.fix(m.logits), list(shape)),
                         {}, [TensorInfo(shape, t.dtype, 0, rw.fix(m.logits), tuple(contiguous(shape)),
                                         t.device)], n.category, keep_name=True)
            rw.remap[Ref(n.id, 0)] = Ref(nid, 0)
            return True
        if n.id in by_target:
            m = by_target[n.id]
            part = g.tensor(m.labels_part)
            t = n.outputs[0]
            pad_shape = list(part.shape)
            pad_shape[m.dim] = 1
            kw = {"dtype": part.dtype, "layout": torch.strided, "device": torch.device("cpu"),
                  "pin_memory": False}
            pad = rw.add(n.name + "_last", "aten.full.default", aten.full.default,
                         (pad_shape, m.ignore), kw,
                         [TensorInfo(tuple(pad_shape), part.dtype, math.prod(pad_shape) * part.dtype.itemsize,
                                     device=t.device)], n.category)
            cat_shape = list(part.shape)
            cat_shape[m.dim] += 1
            cat = rw.add(n.name + "_shifted", "aten.cat.default", aten.cat.default,
                         ([rw.fix(m.labels_part), Ref(pad, 0)], m.dim), {},
                         [TensorInfo(tuple(cat_shape), part.dtype,
                                     math.prod(cat_shape) * part.dtype.itemsize, device=t.device)],
                         n.category)
            shape = (math.prod(cat_shape),)
            nid = rw.add(n.name, "aten.view.default", aten.view.default, (Ref(cat, 0), list(shape)), {},
                         [TensorInfo(shape, t.dtype, 0, Ref(cat, 0), (1,), t.device)], n.category,
                         keep_name=True)
            rw.remap[Ref(n.id, 0)] = Ref(nid, 0)
            return True
        if not any(_grew(rw, g, r) for r in n.refs()):
            return False
        if n.target == "aten.slice_backward.default":
            src = rw.fix(n.args[0])
            if _shape(rw, src) != tuple(n.outputs[0].shape):
                raise ValueError("slice_backward of another shape")
            rw.remap[Ref(n.id, 0)] = src        # the gradient already has every position
            return True
        _redo(rw, n)
        return True

    def _redo(rw: Rewriter, n: Node) -> None:
        """``n`` again, on the new shapes: a view's size follows its input's
        change; outputs come from running the op on meta tensors."""
        args = map_refs(n.args, lambda r, _k: rw.fix(r))
        kwargs = map_refs(n.kwargs, lambda r, _k: rw.fix(r))
        if n.target in _VIEWS and tuple(args[1]) in grown:
            # the view back to [B, S-1, V] (or to the flat head) of the grown head
            args = (args[0], list(grown[tuple(args[1])])) + tuple(args[2:])
        meta = lambda r, _k: _meta(rw, r)
        out = n.op(*map_refs(args, meta), **map_refs(kwargs, meta))
        outs = list(out) if n.multi else [out]
        infos = []
        for i, (t, o) in enumerate(zip(n.outputs, outs)):
            if t is None or not isinstance(o, torch.Tensor):
                infos.append(t)
                continue
            ai = alias_arg(n.op, i)
            alias = args[ai] if ai is not None and ai < len(args) and isinstance(args[ai], Ref) else None
            nb = 0 if alias is not None else o.numel() * o.element_size()
            infos.append(TensorInfo(tuple(o.shape), o.dtype, nb, alias, tuple(o.stride()), t.device))
        nid = rw.add(n.name, n.target, n.op, args, kwargs, infos, n.category, keep_name=True)
        rw.nodes[nid].multi = n.multi
        for i in range(len(n.outputs)):
            rw.remap[Ref(n.id, i)] = Ref(nid, i)

    return rw.run(rule)


def _shape(rw: Rewriter, r: Ref) -> tuple:
    return tuple(rw.nodes[r.node].outputs[r.out].shape)


def _grew(rw: Rewriter, g: Graph, r: Ref) -> bool:
    """The tensor ``r`` names is now another shape than the graph had."""
    return _shape(rw, rw.fix(r)) != tuple(g.tensor(r).shape)


def _meta(rw: Rewriter, r: Ref) -> torch.Tensor:
    t = rw.nodes[r.node].outputs[r.out]
    st = t.stride if t.stride is not None else contiguous(t.shape)
    return torch.empty_strided(tuple(t.shape), tuple(st), dtype=t.dtype, device="meta")
