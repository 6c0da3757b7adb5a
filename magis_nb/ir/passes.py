"""Graph rewrites applied right after capture.

Note [dropout as a mask plus an elementwise op]
``native_dropout(x, p, train=True)`` draws its mask and applies it in one op, so
it could never sit inside a fission region: split, it would draw other random
numbers than eager. ATen's CPU kernel fills a bool tensor laid out like x with
``bernoulli_(1 - p)`` and returns ``x * mask * (1 / (1 - p))``; we emit exactly
that as ``empty_like`` + ``bernoulli_`` (the only RNG op, kept in program order)
+ ``native_dropout_backward(x, mask, scale)`` (elementwise, splittable). The
masks and outputs are bit-identical to eager's (tests/test_passes.py checks it),
and the memory is the same: one bool mask and one output. CUDA's native_dropout is
a fused kernel with its own random stream, so there the op is left whole (a
barrier for fission) rather than draw other masks than eager.

Note [low-precision dropout]
Eager's CPU ``F.dropout`` is not ``native_dropout`` but ATen's ``_dropout``: a
noise tensor in x's dtype, ``empty_like(x).bernoulli_(1 - p)``, divided in place
by ``1 - p`` and multiplied into x; the backward multiplies the gradient by the
same noise. In bf16/fp16 the divide rounds the scale 1/(1-p) to x's dtype
(1.109375 for p = 0.1 in bf16), so the mask form must multiply by that rounded
scale, not by 1/(1-p): with the unrounded one, GPT-2's gradients under bf16
autocast were 1.1% of their max off eager's (eager's own fp32-vs-bf16 spread:
0.9%). With it, ``native_dropout_backward(x, mask, rounded scale)`` (``x * mask
* scale``, the product in float) equals eager's ``x * noise`` bit for bit, and
so does the backward's ``grad * mask * scale``: ``bernoulli_`` draws the same
bits into a bool as into a bf16 or fp16 tensor, and x * 1 and x * 0 are exact
(checked bitwise on [64, 4, 128, 128] at p 0.1 to 0.9, bf16 and fp16). So a
low-precision dropout is the fp32 form with the rounded scale, and its bool mask
packs 8 to a byte in a fission region (Note [packed masks] in analysis/masks.py)
like any other. (An earlier form drew the noise into ``empty_like(x)``: a path
out of every region holding x's producer and back in, which left a bf16 GPT
without its whole-step batch split.)

Note [a mean loss as a sum over the batch]
A mean NLL loss divides by the total weight of the whole batch, so no part of a
split batch can compute its share, and the backward's seed ``ones_like(loss)``
makes every gradient depend on the loss *value*. Both block a fission region that
runs forward, loss and backward part by part (micro-batching, the biggest saving
in a training step). We rewrite ``nll_loss_forward(x, t, None, mean)`` as
``nll_loss_forward(x, t, None, sum) / count(t != ignore_index)`` -- the count
depends on the targets only -- and ``ones_like``/``zeros_like`` as ``full`` of the
same shape, which depends on nothing. Results equal eager's to fp32 rounding.

Note [metadata asserts]
Decompositions that cast (``F.interpolate``'s index arithmetic, ``x.to(dtype)``)
leave ``_assert_tensor_metadata(t, dtype=..., device=..., layout=...)`` in the
graph: an op with no output that checks what the capture already recorded in
every TensorInfo. It would do harm twice: its device is the capture's (``meta``
for a paper-size plan), and, being an op without outputs, it has no dimension
rule, so every tensor it reads leaves any fission region whole (U-Net++ with
interpolation, simulated RTX 3090: each upsampled tensor assembled in full, the
whole step split in 16 peaks at 0.48 of the unsplit peak; without the asserts,
at 0.10). The pass drops the asserts that check no size or stride (those would
say something the dtype does not).

Note [a clone that copies nothing]
``F.dropout(x, 0.0, training=True)`` returns x itself in eager PyTorch, but the
captured graph has ``clone(x)`` there: the zoo GPT's attention dropout at p=0
made each block save its softmax output twice (once for the softmax's
backward, once as the clone for ``probs @ v``'s), 64 MiB per block at 2048
tokens, and put the captured step's peak 4.2 MiB (14%) above eager's at 256
tokens: a plan could meet "eager's peak" as the search saw it and still measure
above eager. Many Hugging Face configs set attention dropout to 0. The pass
reads the original where nothing can tell the two apart: the same shape,
strides and dtype, the input's storage no bigger than the copy (keeping a big
base alive for a small slice's readers would cost more than the copy), neither
written in place, and the copy not an output of the step (the caller would
get an alias).

Note [reading through detach]
The captured joint graph passes saved activations to the backward through
``detach`` (aten's autograd saves ``softmax(x).detach()`` for
``_softmax_backward_data``, the zoo GPT two detaches per block). Nothing runs
autograd on the captured program, so a detach there is an alias that changes
no value. As an op of its own it sat between the forward and the backward: a
backward region along the sequence could not follow it up to the softmax and
recompute the [T, T] probabilities per query part (Note [recomputed in parts]
in `analysis/ftrans.py`), so every block kept them whole from its forward (64
MiB a block, zoo GPT at 2048 tokens). Readers of a detach (or ``alias``) read
its input instead, unless the alias is returned or written in place.
"""
from __future__ import annotations

import dataclasses
import math
import weakref

import torch

from .build import unique_ident
from .graph import Graph, LossSeed, Node, Ref, TensorInfo, iter_refs, remap_refs

_WRITTEN: "weakref.WeakKeyDictionary[Graph, dict[Ref, str]]" = weakref.WeakKeyDictionary()

aten = torch.ops.aten


class Rewriter:
    """Copies a graph node by node (ids stay topological) while a rule may replace
    a node by several; ``fix`` maps old refs to new ones."""

    def __init__(self, g: Graph):
        self.g = g
        self.nodes: list[Node] = []
        self.remap: dict[Ref, Ref] = {}
        self.taken = {n.name for n in g.nodes}

    def fix(self, r: Ref, _k=None) -> Ref:
        return self.remap.get(r, r)

    def add(self, name, target, op, args, kwargs, outputs, category, *, rng=False, keep_name=False) -> int:
        nid = len(self.nodes)
        nm = name if keep_name else unique_ident(name, self.taken)
        self.nodes.append(Node(nid, nm, "op", target, op, tuple(args), dict(kwargs), outputs,
                               category, rng=rng))
        return nid

    def copy(self, n: Node) -> None:
        fix, table = self.fix, self.remap
        # A TensorInfo that is no view names no node: the copy shares it (nothing
        # mutates a TensorInfo once its graph is built).
        new = Node(len(self.nodes), n.name, n.kind, n.target, n.op, remap_refs(n.args, table),
                   remap_refs(n.kwargs, table), [t if t is None or t.alias is None else
                                                 dataclasses.replace(t, alias=fix(t.alias))
                                                 for t in n.outputs],
                   n.category, n.role, n.rng, n.multi,
                   tuple(fix(Ref(d, 0)).node for d in n.deps), n.region)
        self.nodes.append(new)
        for i in range(len(n.outputs)):
            self.remap[Ref(n.id, i)] = Ref(new.id, i)

    def run(self, rule) -> Graph:
        for n in self.g.nodes:
            if not rule(self, n):
                self.copy(n)
        return Graph(self.nodes, [self.fix(r) for r in self.g.outputs], self.g.output_roles)


def _dropout_scale(dtype, p: float) -> float:
    """What eager's dropout multiplies by: 1/(1-p), rounded to ``dtype`` as
    ``_dropout``'s in-place divide of its noise rounds it (Note [low-precision
    dropout])."""
    if p == 1.0:
        return 0.0
    if dtype in (torch.float32, torch.float64):
        return 1.0 / (1.0 - p)
    return float(torch.ones((), dtype=dtype).div(1.0 - p).item())


def _dropout_rule(rw: Rewriter, n: Node, scales: dict[Ref, float]) -> bool:
    if n.target != "aten.native_dropout.default" or not _train(n):
        return False
    if (n.outputs[0].device or "cpu") not in ("cpu", "meta"):
        return False  # CUDA's fused dropout kernel draws differently: keep it whole
    x = rw.fix(n.args[0])
    p = float(n.args[1])
    out_t, mask_t = n.outputs
    # The mask is laid out like x (empty_like's preserve_format) but made from x's
    # shape and strides only, so it does not depend on x: drawing it is a side
    # entry that a fission region reads whole, not a path out of the region and back.
    xt = rw.g.tensor(n.args[0])
    if xt.stride is not None and _dense(xt.shape, xt.stride):
        empty = rw.add(n.name + "_mask", "aten.empty_strided.default", aten.empty_strided.default,
                       (list(xt.shape), list(xt.stride)),
                       {"dtype": torch.bool, "layout": torch.strided,
                        "device": torch.device("cpu"), "pin_memory": False},
                       [TensorInfo(mask_t.shape, mask_t.dtype, mask_t.nbytes)], n.category)
    else:
        empty = rw.add(n.name + "_mask", "aten.empty_like.default", aten.empty_like.default, (x,),
                       {"dtype": torch.bool}, [TensorInfo(mask_t.shape, mask_t.dtype, mask_t.nbytes)],
                       n.category)
    draw = rw.add(n.name + "_draw", "aten.bernoulli_.float", aten.bernoulli_.float,
                  (Ref(empty, 0), 1.0 - p), {},
                  [TensorInfo(mask_t.shape, mask_t.dtype, 0, Ref(empty, 0))], n.category, rng=True)
    scale = _dropout_scale(out_t.dtype, p)
    apply = rw.add(n.name, "aten.native_dropout_backward.default",
                   aten.native_dropout_backward.default, (x, Ref(draw, 0), scale), {},
                   [TensorInfo(out_t.shape, out_t.dtype, out_t.nbytes)], n.category, keep_name=True)
    rw.remap[Ref(n.id, 0)] = Ref(apply, 0)
    rw.remap[Ref(n.id, 1)] = Ref(draw, 0)
    scales[Ref(draw, 0)] = scale
    return True


def _dropout_backward_rule(rw: Rewriter, n: Node, scales: dict[Ref, float]) -> bool:
    """A dropout's backward multiplies by the forward's scale (rounded in low
    precision: Note [low-precision dropout])."""
    if n.target != "aten.native_dropout_backward.default" or not scales:
        return False
    mask = rw.fix(n.args[1])
    if mask not in scales or n.args[2] == scales[mask]:
        return False
    nid = rw.add(n.name, n.target, n.op, (rw.fix(n.args[0]), mask, scales[mask]), {},
                 [n.outputs[0]], n.category, keep_name=True)
    rw.remap[Ref(n.id, 0)] = Ref(nid, 0)
    return True


def decompose_dropout(g: Graph) -> Graph:
    if not any(n.target == "aten.native_dropout.default" and _train(n) for n in g.nodes):
        return g
    scales: dict[Ref, float] = {}      # each drawn mask -> the scale its dropout multiplies by
    return Rewriter(g).run(lambda rw, n: _dropout_rule(rw, n, scales)
                           or _dropout_backward_rule(rw, n, scales))


def _loss_refs(g: Graph) -> set:
    return {r for r, role in zip(g.outputs, g.output_roles) if role and role[0] == "loss"}


_NLL = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")


def _mean_loss_rule(rw: Rewriter, n: Node) -> bool:
    """See Note [a mean loss as a sum over the batch]."""
    if n.target in ("aten.ones_like.default", "aten.zeros_like.default"):
        t = n.outputs[0]
        fill = 1.0 if n.target.startswith("aten.ones") else 0.0
        if fill == 1.0 and n.args and n.args[0] in _loss_refs(rw.g):
            fill = LossSeed(1.0)    # the backward's seed: the program takes it as _seed
        kw = {"dtype": t.dtype, "layout": torch.strided, "device": torch.device("cpu"),
              "pin_memory": False}
        nid = rw.add(n.name, "aten.full.default", aten.full.default, (list(t.shape), fill), kw,
                     [TensorInfo(t.shape, t.dtype, t.nbytes)], n.category, keep_name=True)
        rw.remap[Ref(n.id, 0)] = Ref(nid, 0)
        return True
    if n.target not in _NLL or n.args[2] is not None or n.args[3] != 1:
        return False
    logp, target = rw.fix(n.args[0]), rw.fix(n.args[1])
    ignore = n.args[4]
    loss_t, tw_t = n.outputs
    ne = rw.add(n.name + "_counted", "aten.ne.Scalar", aten.ne.Scalar, (target, ignore), {},
                [TensorInfo(rw.g.tensor(n.args[1]).shape, torch.bool,
                            math.prod(rw.g.tensor(n.args[1]).shape))], n.category)
    tw = rw.add(n.name + "_weight", "aten.sum.default", aten.sum.default, (Ref(ne, 0),),
                {"dtype": tw_t.dtype}, [TensorInfo(tw_t.shape, tw_t.dtype, tw_t.nbytes)], n.category)
    fwd = rw.add(n.name + "_sum", n.target, n.op, (logp, target, None, 2, ignore), {},
                 [TensorInfo(loss_t.shape, loss_t.dtype, loss_t.nbytes),
                  TensorInfo(tw_t.shape, tw_t.dtype, tw_t.nbytes)], n.category)
    rw.nodes[fwd].multi = True
    loss = rw.add(n.name, "aten.div.Tensor", aten.div.Tensor, (Ref(fwd, 0), Ref(tw, 0)), {},
                  [TensorInfo(loss_t.shape, loss_t.dtype, loss_t.nbytes)], n.category, keep_name=True)
    rw.remap[Ref(n.id, 0)] = Ref(loss, 0)
    rw.remap[Ref(n.id, 1)] = Ref(tw, 0)
    return True


def split_mean_loss(g: Graph) -> Graph:
    return Rewriter(g).run(_mean_loss_rule)


def _metadata_assert(rw: Rewriter, n: Node) -> bool:
    """True (dropped) for a dtype/device/layout assert; see Note [metadata asserts]."""
    if n.target != "aten._assert_tensor_metadata.default" or n.deps:
        return False
    names = [a.name for a in n.op._schema.arguments]
    bound = dict(zip(names, n.args)) | n.kwargs
    return bound.get("size") is None and bound.get("stride") is None


def drop_metadata_asserts(g: Graph) -> Graph:
    if not any(n.target == "aten._assert_tensor_metadata.default" for n in g.nodes):
        return g
    return Rewriter(g).run(_metadata_assert)


def _dense(shape, stride) -> bool:
    """Non-overlapping and dense: empty_like(preserve_format) keeps these strides."""
    expect = 1
    for size, st in sorted(zip(shape, stride), key=lambda p: p[1]):
        if size != 1 and st != expect:
            return False
        expect *= size
    return True


def _train(n: Node) -> bool:
    return len(n.args) < 3 or n.args[2] is None or bool(n.args[2])


def prune_dead_views(g: Graph) -> Graph:
    """Drop views nobody reads (and views only those read, transitively).

    A view allocates nothing, but it reads its base: the memory model keeps the
    base alive until the view op runs. After a rewrite redirects a view's readers
    (swap, remat), the orphaned view would pin the base storage to its old place.
    """
    read: set[int] = {r.node for r in g.outputs}
    dead: set[int] = set()
    for n in reversed(g.nodes):
        if (n.kind == "op" and n.id not in read and not n.rng and not n.deps
                and n.outputs and all(t is not None and t.alias is not None for t in n.outputs)
                and not writes_into_input(n)):
            dead.add(n.id)
            continue
        read.update(r.node for r in n.refs())
        read.update(n.deps)
    if not dead:
        return g
    return Rewriter(g).run(lambda rw, n: n.id in dead)


def writes_into_input(n: Node) -> bool:
    schema = getattr(n.op, "_schema", None)
    return bool(schema) and any(a.alias_info is not None and a.alias_info.is_write
                                for a in schema.arguments)


def written_in_place(g: Graph) -> dict[Ref, str]:
    """Base tensors that some op writes into -> that op's name (once per graph:
    the search asks it of the same graph for every candidate)."""
    if g in _WRITTEN:
        return _WRITTEN[g]
    out: dict[Ref, str] = {}
    for m in g.ops:
        if not writes_into_input(m):
            continue
        for i, arg in enumerate(m.op._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            val = m.args[i] if i < len(m.args) else m.kwargs.get(arg.name)
            for r in iter_refs(val):
                out.setdefault(g.storage_of(r), m.name)
    _WRITTEN[g] = out
    return out


def read_through_detaches(g: Graph) -> Graph:
    """Readers of a detach or alias read its input (Note [reading through detach])."""
    returned = set(g.outputs)
    written = {r for m in g.ops if writes_into_input(m) for r in m.refs()}
    drop = {n.id for n in g.ops
            if n.target in ("aten.detach.default", "aten.alias.default")
            and isinstance(n.args[0], Ref) and not n.deps and n.outputs[0] is not None
            and Ref(n.id, 0) not in returned and Ref(n.id, 0) not in written}
    if not drop:
        return g

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id not in drop:
            return False
        rw.remap[Ref(n.id, 0)] = rw.fix(n.args[0])
        return True

    return Rewriter(g).run(rule)


def drop_identity_clones(g: Graph) -> Graph:
    """Readers of a clone read its input instead, where the copy changes nothing
    (Note [a clone that copies nothing])."""
    clones = [n for n in g.ops if n.target == "aten.clone.default"]
    if not clones:
        return g
    written = {g.storage_of(r) for m in g.ops if writes_into_input(m)
               for r in m.refs()}
    returned = {g.storage_of(r) for r in g.outputs}
    drop: set[int] = set()
    for n in clones:
        x = n.args[0]
        if not isinstance(x, Ref) or n.deps or n.outputs[0] is None:
            continue
        t, src = n.outputs[0], g.tensor(x)
        base = g.storage_of(x)
        if (tuple(t.shape), tuple(t.stride or ()), t.dtype) \
                != (tuple(src.shape), tuple(src.stride or ()), src.dtype) \
                or g.tensor(base).nbytes > t.nbytes or t.stride is None:
            continue
        if base in written or Ref(n.id, 0) in written or Ref(n.id, 0) in returned:
            continue
        drop.add(n.id)
    if not drop:
        return g

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id not in drop:
            return False
        rw.remap[Ref(n.id, 0)] = rw.fix(n.args[0])
        return True

    return Rewriter(g).run(rule)
