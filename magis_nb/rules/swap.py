"""Swapping and de-swapping (paper §5.2) as graph rewrites.

``swap(g, a, users)``: op ``a``'s output is stored to host memory right after
``a`` and loaded back just before the first of ``users``, who read the loaded
copy; ``a``'s output can die after its other users. The host side is a buffer
the OptimizedModule allocates once per plan and reuses on every call (a graph
input with role ("pool", i) and category "host"): the Store is an in-place
``copy_`` into it, the Load a ``_to_copy`` back to the compute device. Host
buffers count as host memory, not device memory, in the simulator and in the CPU
tracker (they exist before the step and are written in place). On CPU the copies
are synchronous; asynchronous copies on a CUDA stream are the GPU runtime's job.
``unswap`` is the inverse and restores the digest.

A user may read ``a``'s output through views (the backward reads saved
activations through ``detach``): the views are rebuilt on the loaded copy.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from ..ir.graph import Graph, Node, Ref, TensorInfo, iter_refs
from ..ir.passes import Rewriter, prune_dead_views
from .redirect import Redirect, readers

aten = torch.ops.aten


def swap(g: Graph, a: Ref, users: Iterable[int]) -> Graph:
    """``users`` read ``a``'s output directly or through views of it; they get the
    loaded copy (views are rebuilt on it), so ``a``'s storage can die after its
    other readers."""
    t = g.tensor(a)
    src = g.nodes[a.node]
    if src.kind != "op" or t.alias is not None or src.region:
        raise ValueError(f"{src.name}: only an op's own (non-view) output outside a "
                         "fission region can be swapped")
    users = set(users)
    if not users or not users <= readers(g, a):
        raise ValueError(f"users must read {src.name}'s output {a.out}")
    n_pools = sum(1 for n in g.inputs if n.role and n.role[0] == "pool")
    last_input = max(n.id for n in g.inputs)
    first = min(users)
    state: dict = {}
    redirect = Redirect(g, [a])

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id == first:
            store = Ref(state["store"], 0)
            state["load"] = rw.add(src.name + "_load", "aten._to_copy.default",
                                   aten._to_copy.default, (store,), {"device": torch.device("cpu")},
                                   [TensorInfo(t.shape, t.dtype, t.nbytes)], src.category)
        if n.id in users:
            redirect.copy(rw, n, {a: Ref(state["load"], 0)})
            return True
        rw.copy(n)
        if n.id == last_input:
            pid = len(rw.nodes)
            rw.nodes.append(Node(pid, f"host{n_pools}_{src.name}", "input", "input",
                                 outputs=[dataclasses.replace(t, alias=None)],
                                 category="host", role=("pool", n_pools)))
            state["pool"] = pid
        if n.id == a.node:
            pool = Ref(state["pool"], 0)
            state["store"] = rw.add(src.name + "_store", "aten.copy_.default",
                                    aten.copy_.default, (pool, rw.fix(a)), {},
                                    [TensorInfo(t.shape, t.dtype, 0, pool)], "host")
        return True

    return prune_dead_views(Rewriter(g).run(rule))


def unswap(g: Graph, load: int) -> Graph:
    """Users of a Load read the swapped tensor again; Store, Load and buffer go."""
    ld = g.nodes[load]
    if ld.target != "aten._to_copy.default" or g.nodes[ld.args[0].node].target != "aten.copy_.default":
        raise ValueError(f"{ld.name} is not a swap's Load")
    store = g.nodes[ld.args[0].node]
    pool, orig = store.args
    if any(r.node == store.id for n in g.ops if n.id != load
           for r in iter_refs((n.args, n.kwargs))):
        raise ValueError("the stored copy has other readers")

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id in (pool.node, store.id):
            return True
        if n.id == load:
            rw.remap[Ref(load, 0)] = rw.fix(orig)
            return True
        return False

    return Rewriter(g).run(rule)
