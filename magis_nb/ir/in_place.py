"""Activations, and their gradients, written into the tensor they read.

Note [elementwise ops in place]
Autograd makes each activation's backward a new tensor: ReLU's
``threshold_backward(grad, y, 0)`` allocates a gradient as large as ``grad``
while ``grad`` is still live, and the two are live together at the op. Where
nothing but that op reads ``grad`` (through any view), the op can write its
result into ``grad`` instead, through the op's ``grad_input=`` overload: an
elementwise kernel whose output is exactly its first input computes each
element from the values it overwrites, so the result is the same, bit for bit,
and one of the two tensors is never allocated. The forward's activations
likewise (``relu(x)`` as ``relu_(x)``, what ``nn.ReLU(inplace=True)`` does)
where nothing else reads ``x``: a BatchNorm's output, or the normalize a
re-materialization remakes for its ReLU. On a BatchNorm U-Net the peak of a
training step is such an op: the last decoder block's ReLU backward, its
incoming and outgoing gradients 512 MiB each (paper U-Net, simulated RTX 3090),
and once that is in place, the ReLU a remat remakes there.

`rewrite_in_place` rewrites every such op of a finished plan (same node ids, so
the plan's order still applies). Whether ``x`` has another reader does not
depend on the order, so any order of the plan may run it. The kernels are the
same, so a plan is priced on the graph before this rewrite; only its memory
changes, and the search schedules each state on that memory (scheduled on the
graph before it, the order minimized a peak the rewrite then removed: paper
U-Net, a ReLU's separate output). The program PyTorch runs (the unoptimized
plan) is eager's own and is never rewritten.
"""
from __future__ import annotations

import dataclasses

import torch

from .graph import Graph, Node, Ref
from .passes import Rewriter, written_in_place

aten = torch.ops.aten

# an elementwise op -> its overload writing into its first argument, and the
# name of the keyword argument that names where to write (None: the op writes
# into its first argument itself)
IN_PLACE = {
    "aten.relu.default": (aten.relu_.default, None),
    "aten.sigmoid.default": (aten.sigmoid_.default, None),
    "aten.tanh.default": (aten.tanh_.default, None),
    "aten.silu.default": (aten.silu_.default, None),
    "aten.gelu.default": (aten.gelu_.default, None),
    "aten.hardtanh.default": (aten.hardtanh_.default, None),
    "aten.leaky_relu.default": (aten.leaky_relu_.default, None),
    "aten.hardswish.default": (aten.hardswish_.default, None),
    "aten.hardsigmoid.default": (aten.hardsigmoid_.default, None),
    "aten.elu.default": (aten.elu_.default, None),
    "aten.mish.default": (aten.mish_.default, None),
    "aten.threshold_backward.default": (aten.threshold_backward.grad_input, "grad_input"),
    "aten.sigmoid_backward.default": (aten.sigmoid_backward.grad_input, "grad_input"),
    "aten.tanh_backward.default": (aten.tanh_backward.grad_input, "grad_input"),
    "aten.silu_backward.default": (aten.silu_backward.grad_input, "grad_input"),
    "aten.gelu_backward.default": (aten.gelu_backward.grad_input, "grad_input"),
    "aten.hardtanh_backward.default": (aten.hardtanh_backward.grad_input, "grad_input"),
    "aten.leaky_relu_backward.default": (aten.leaky_relu_backward.grad_input, "grad_input"),
    "aten.hardswish_backward.default": (aten.hardswish_backward.out, "out"),
    "aten.hardsigmoid_backward.default": (aten.hardsigmoid_backward.grad_input, "grad_input"),
    "aten.softplus_backward.default": (aten.softplus_backward.grad_input, "grad_input"),
}


def in_place_ops(g: Graph) -> list[int]:
    """The ops of ``g`` that may write into what they read first (an
    activation's input, a gradient): an op's
    own output (not a view, not a graph output, nothing writes into it) of the
    result's shape and dtype, which no other op reads."""
    cands = [n for n in g.ops if n.target in IN_PLACE and isinstance(n.args[0], Ref)]
    if not cands:
        return []
    readers = g.readers()
    returned = {g.storage_of(r) for r in g.outputs}
    written = written_in_place(g)
    out = []
    for n in cands:
        a = n.args[0]
        src, t, res = g.nodes[a.node], g.tensor(a), n.outputs[0]
        if src.kind != "op" or t.alias is not None or g.storage_of(a) != a:
            continue
        if a in returned or a in written or readers.get(a) != {n.id} or n.deps:
            continue
        if res is None or res.alias is not None or tuple(res.shape) != tuple(t.shape) \
                or res.dtype != t.dtype or res.nbytes != t.nbytes:
            continue
        out.append(n.id)
    return out


def rewrite_in_place(g: Graph) -> tuple[Graph, dict[Ref, Ref]] | None:
    """Note [elementwise ops in place]: (``g`` with every op `in_place_ops`
    finds writing into what it reads first, node ids unchanged; and each
    storage it writes into -> the tensor of ``g`` that storage holds last), or
    None when there is no such op. The search reads the second:
    a ReLU's output, saved for the backward, is its input's storage in the
    rewritten graph, and the rewrites it proposes name the ReLU's output."""
    ids = sorted(in_place_ops(g))
    if not ids:
        return None
    last: dict[Ref, Ref] = {}
    base_of: dict[Ref, Ref] = {}
    for v in ids:                       # in topological order: chains follow
        a = g.nodes[v].args[0]
        b = base_of.get(a, a)
        base_of[Ref(v, 0)] = b
        last[b] = Ref(v, 0)
    ids = set(ids)

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id not in ids:
            return False
        rw.copy(n)
        new = rw.nodes[-1]
        op, kw = IN_PLACE[n.target]
        a = new.args[0]
        new.op, new.target = op, f"aten.{op._schema.name.split('::')[1]}.{op._overloadname}"
        if kw is not None:
            new.kwargs = {**new.kwargs, kw: a}
        new.outputs = [dataclasses.replace(new.outputs[0], alias=a)]
        return True

    return Rewriter(g).run(rule), last
