"""Gradient buckets inside the program: data parallel as part of the plan.

A planned backward knows where each gradient becomes final (DESIGN.md §11 "Data
parallel"). `add_buckets` groups a training program's gradients, in the order the
schedule finishes them, into buckets of at most ``cap`` bytes (one dtype each) and
inserts a `grad_bucket` op right after the op that finishes a bucket's last
gradient. The op copies the bucket's gradients into one new flat tensor; the
generated code runs it as ``_comm.bucket(k, [...])`` (`comm.BucketComm`), which also
issues the bucket's ``all_reduce(async_op=True)`` there, so the communication
overlaps the rest of the backward, as DDP's reducer does from autograd hooks. The
gradients the program returns become contiguous views of their bucket (the layout
of the parameters, so they become ``p.grad`` without a copy), and the gradients as
computed die at the bucket op. The program waits for every handle, and averages,
before it returns (``_comm.finish()``).

Nothing here is special to the simulator: a bucket is an op with an output the
size of its gradients, so the memory timeline counts it, and its copy is priced
like any op. The all_reduces are the latency model's third stream (`comm_stream`).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from ..ir.build import unique_ident
from ..ir.graph import Graph, Node, Ref, Region, TensorInfo

aten = torch.ops.aten

_lib = torch.library.Library("magis_nb", "FRAGMENT")
_lib.define("grad_bucket(Tensor[] grads) -> Tensor")


def bucket_copy(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``grads`` one after another (each contiguous)."""
    flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
    o = 0
    for g in grads:
        flat[o:o + g.numel()].view(g.shape).copy_(g)
        o += g.numel()
    return flat


def _bucket_meta(grads):
    return torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)


_lib.impl("grad_bucket", bucket_copy, "CompositeExplicitAutograd")
_lib.impl("grad_bucket", _bucket_meta, "Meta")
BUCKET = torch.ops.magis_nb.grad_bucket.default
BUCKET_TARGET = "magis_nb.grad_bucket.default"
DEFAULT_CAP = 25 * 2**20      # DDP's default bucket_cap_mb


class Bucket(NamedTuple):
    node: int                 # the grad_bucket op
    outputs: tuple            # indices into graph.outputs of its gradients
    nbytes: int
    dtype: torch.dtype


def is_bucket(g: Graph, nid: int) -> bool:
    return g.nodes[nid].target == BUCKET_TARGET


def dense_bytes(t: TensorInfo) -> int:
    """Bytes of ``t`` laid out densely (a view's own size, which ``nbytes`` is not)."""
    return math.prod(t.shape) * t.dtype.itemsize


def _ready(g: Graph, order: Sequence[int]) -> dict[int, int]:
    """Graph output index -> position in ``order`` after which that gradient is final
    (-1: a graph input). A gradient finished inside a fission loop is final
    after the loop's last op."""
    pos = {v: i for i, v in enumerate(order)}
    region_end: dict[int, int] = {}
    for i, v in enumerate(order):
        reg = g.nodes[v].region
        if isinstance(reg, Region):
            region_end[reg.rid] = i
    out = {}
    for k, (r, role) in enumerate(zip(g.outputs, g.output_roles)):
        if not role or role[0] != "grad":
            continue
        n = g.nodes[r.node]
        if n.kind != "op":
            out[k] = -1
        elif isinstance(n.region, Region):
            out[k] = region_end[n.region.rid]
        else:
            out[k] = pos[r.node]
    return out


def group_buckets(g: Graph, order: Sequence[int], cap: int = DEFAULT_CAP) -> list[tuple[int, list[int]]]:
    """[(position after which the bucket is issued, [output indices])], in issue order."""
    ready = _ready(g, order)
    groups: list[tuple[int, list[int]]] = []
    size, dtype = 0, None
    for k in sorted(ready, key=lambda k: (ready[k], k)):
        t = g.tensor(g.outputs[k])
        b = dense_bytes(t)
        if groups and t.dtype == dtype and size + b <= cap:
            groups[-1][1].append(k)
            groups[-1] = (ready[k], groups[-1][1])
            size += b
        else:
            groups.append((ready[k], [k]))
            size, dtype = b, t.dtype
    return groups


def add_buckets(g: Graph, order: Sequence[int], cap: int = DEFAULT_CAP
                ) -> tuple[Graph, list[int], list[Bucket]]:
    """``g`` and ``order`` with the gradients in buckets (see module doc). The
    nodes of ``g`` keep their ids; bucket ops and their views come after them."""
    groups = group_buckets(g, order, cap)
    nodes = list(g.nodes)
    outputs = list(g.outputs)
    taken = {n.name for n in nodes}
    after: dict[int, list[int]] = {}        # order position -> new ops issued after it
    buckets: list[Bucket] = []
    for k, (p, members) in enumerate(groups):
        infos = [g.tensor(g.outputs[m]) for m in members]
        dtype = infos[0].dtype
        numel = sum(math.prod(t.shape) for t in infos)
        nbytes = sum(dense_bytes(t) for t in infos)
        bid = len(nodes)
        nodes.append(Node(id=bid, name=unique_ident(f"bucket_{k}", taken), kind="op",
                          target=BUCKET_TARGET, op=BUCKET,
                          args=([g.outputs[m] for m in members],),
                          outputs=[TensorInfo((numel,), dtype, nbytes, None, (1,), infos[0].device)],
                          category="gradient"))
        new = [bid]
        off = 0
        for m, t in zip(members, infos):
            stride = tuple(math.prod(t.shape[i + 1:]) for i in range(len(t.shape)))
            vid = len(nodes)
            nodes.append(Node(id=vid, name=unique_ident(f"{nodes[g.outputs[m].node].name}_grad", taken),
                              kind="op", target="aten.as_strided.default", op=aten.as_strided.default,
                              args=(Ref(bid, 0), list(t.shape), list(stride), off),
                              outputs=[TensorInfo(tuple(t.shape), dtype, 0, Ref(bid, 0), stride,
                                                  t.device)],
                              category="gradient"))
            outputs[m] = Ref(vid, 0)
            new.append(vid)
            off += math.prod(t.shape)
        after.setdefault(p, []).extend(new)
        buckets.append(Bucket(bid, tuple(members), nbytes, dtype))
    new_order = list(after.get(-1, []))
    for i, v in enumerate(order):
        new_order.append(v)
        new_order.extend(after.get(i, ()))
    return Graph(nodes, outputs, list(g.output_roles)), new_order, buckets
