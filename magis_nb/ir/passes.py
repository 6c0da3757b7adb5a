"""Graph rewrites applied right after capture.

Note [dropout as a mask plus an elementwise op]
``native_dropout(x, p, train=True)`` draws its mask and applies it in one op, so
it could never sit inside a fission region: split, it would draw other random
numbers than eager. ATen's CPU kernel fills a bool tensor laid out like x with
``bernoulli_(1 - p)`` and returns ``x * mask * (1 / (1 - p))``; we emit exactly
that as ``empty_like`` + ``bernoulli_`` (the only RNG op, kept in program order)
+ ``native_dropout_backward(x, mask, scale)`` (elementwise, splittable). The
masks and outputs are bit-identical to eager's (tests/test_passes.py checks it),
and the memory is the same: one bool mask and one output.
"""
from __future__ import annotations

import torch

from .build import _ident
from .graph import Graph, Node, Ref, TensorInfo, map_refs

aten = torch.ops.aten


def decompose_dropout(g: Graph) -> Graph:
    if not any(n.target == "aten.native_dropout.default" and _train(n) for n in g.nodes):
        return g
    nodes: list[Node] = []
    remap: dict[Ref, Ref] = {}
    taken = {n.name for n in g.nodes}

    def fix(r: Ref, _k=None) -> Ref:
        return remap.get(r, r)

    def add(node: Node) -> int:
        node.id = len(nodes)
        nodes.append(node)
        return node.id

    for n in g.nodes:
        if n.target == "aten.native_dropout.default" and _train(n):
            x = fix(n.args[0])
            p = float(n.args[1])
            out_t, mask_t = n.outputs
            empty = add(Node(0, _ident(n.name + "_mask", taken), "op", "aten.empty_like.default",
                             aten.empty_like.default, (x,),
                             {"dtype": torch.bool},
                             [TensorInfo(mask_t.shape, mask_t.dtype, mask_t.nbytes)], n.category))
            draw = add(Node(0, _ident(n.name + "_draw", taken), "op", "aten.bernoulli_.float",
                            aten.bernoulli_.float, (Ref(empty, 0), 1.0 - p), {},
                            [TensorInfo(mask_t.shape, mask_t.dtype, 0, Ref(empty, 0))],
                            n.category, rng=True))
            scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
            apply = add(Node(0, n.name, "op", "aten.native_dropout_backward.default",
                             aten.native_dropout_backward.default, (x, Ref(draw, 0), scale), {},
                             [TensorInfo(out_t.shape, out_t.dtype, out_t.nbytes)], n.category))
            remap[Ref(n.id, 0)] = Ref(apply, 0)
            remap[Ref(n.id, 1)] = Ref(draw, 0)
            continue
        new = Node(0, n.name, n.kind, n.target, n.op, map_refs(n.args, fix),
                   map_refs(n.kwargs, fix), [None if t is None else TensorInfo(
                       t.shape, t.dtype, t.nbytes, None if t.alias is None else fix(t.alias))
                       for t in n.outputs],
                   n.category, n.role, n.rng, n.multi, tuple(fix(Ref(d, 0)).node for d in n.deps),
                   n.region)
        old = n.id
        add(new)
        for i in range(len(n.outputs)):
            remap[Ref(old, i)] = Ref(new.id, i)
    return Graph(nodes, [fix(r) for r in g.outputs], g.output_roles)


def _train(n: Node) -> bool:
    return len(n.args) < 3 or n.args[2] is None or bool(n.args[2])
