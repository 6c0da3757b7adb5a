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
``unswap`` is the inverse and restores the digest. An output of a split
fission region's op is swapped for readers in its own part only; Store and Load
then belong to that part (Note [rewrites inside the parts] in `search.space`).

A user may read ``a``'s output through views (the backward reads saved
activations through ``detach``): the views are rebuilt on the loaded copy.
They were traced against ``a``'s strides, so the host buffer and the loaded copy
have those strides too (the buffer's TensorInfo carries them; `runtime.copies`
allocates and copies by them): DESIGN.md §11 "Layout is semantics".
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from ..ir.graph import Graph, Node, Ref, TensorInfo
from ..ir.passes import Rewriter, prune_dead_views, written_in_place
from .redirect import Redirect

aten = torch.ops.aten


def is_store(g: Graph, nid: int) -> bool:
    """A swap's Store: the in-place copy of a tensor into its host buffer."""
    n = g.nodes[nid]
    return n.target == "aten.copy_.default" and n.category == "host"


def is_load(g: Graph, nid: int) -> bool:
    """A swap's Load: the copy of a Store's host buffer back to the device."""
    n = g.nodes[nid]
    return n.target == "aten._to_copy.default" and bool(n.args) \
        and isinstance(n.args[0], Ref) and is_store(g, n.args[0].node)


def pool_inputs(g: Graph) -> list[Node]:
    """The host buffers swaps copy into: graph inputs with role ("pool", i)."""
    return [n for n in g.inputs if n.role and n.role[0] == "pool"]


def swap_ops(g: Graph) -> tuple[list[int], list[int]]:
    """(stores, loads) node ids, in node order."""
    stores = [n.id for n in g.ops if is_store(g, n.id)]
    loads = [n.id for n in g.ops if is_load(g, n.id)]
    return stores, loads


def rd_region(g: Graph, v: int) -> tuple:
    """(region, part) of op ``v`` in a split fission region; () outside one."""
    reg = g.nodes[v].region
    return tuple(reg[:2]) if reg else ()


def swap(g: Graph, a: Ref, users: Iterable[int]) -> Graph:
    """``users`` read ``a``'s output directly or through views of it; they get the
    loaded copy (views are rebuilt on it), so ``a``'s storage can die after its
    other readers."""
    return swap_all(g, [(a, users)])


def swap_all(g: Graph, specs: Iterable[tuple[Ref, Iterable[int]]]) -> Graph:
    """Several swaps (tensor, users) in one pass over the graph: the same result
    as applying `swap` to each in turn, without rebuilding the graph each time."""
    specs = [(a, set(users)) for a, users in specs]
    if len({a for a, _ in specs}) != len(specs):
        raise ValueError("a tensor is swapped twice in one batch")
    written = written_in_place(g)
    rd = g.readers()
    for a, users in specs:
        t = g.tensor(a)
        src = g.nodes[a.node]
        if src.kind != "op" or t.alias is not None:
            raise ValueError(f"{src.name}: only an op's own (non-view) output can be swapped")
        if src.region and any(rd_region(g, u) != rd_region(g, a.node) for u in users):
            raise ValueError(f"{src.name} is in a fission region: its swap serves "
                             "readers in its own part only")
        if a in written:
            # the Store would copy it before the in-place write fills it
            raise ValueError(f"{src.name}'s output is written in place by {written[a]}")
        if not users or not users <= rd.get(a, set()):
            raise ValueError(f"users must read {src.name}'s output {a.out}")
    # numbered past the largest pool index: an unswap may have left a gap
    n_pools = 1 + max((n.role[1] for n in pool_inputs(g)), default=-1)
    last_input = max(n.id for n in g.inputs)
    by_first: dict[int, list[int]] = {}
    by_user: dict[int, list[int]] = {}
    by_src: dict[int, list[int]] = {}
    for k, (a, users) in enumerate(specs):
        by_first.setdefault(min(users), []).append(k)
        by_src.setdefault(a.node, []).append(k)
        for u in users:
            by_user.setdefault(u, []).append(k)
    pools: dict[int, int] = {}
    stores: dict[int, int] = {}
    loads: dict[int, int] = {}
    redirect = Redirect(g, [a for a, _ in specs])

    def rule(rw: Rewriter, n: Node) -> bool:
        for k in by_first.get(n.id, ()):
            a = specs[k][0]
            t, src = g.tensor(a), g.nodes[a.node]
            loads[k] = rw.add(src.name + "_load", "aten._to_copy.default",
                              aten._to_copy.default, (Ref(stores[k], 0),),
                              {"device": torch.device("cpu")},
                              [TensorInfo(t.shape, t.dtype, t.nbytes, None, t.stride, t.device)],
                              src.category)
            rw.nodes[loads[k]].region = src.region
        if n.id in by_user:
            redirect.copy(rw, n, {specs[k][0]: Ref(loads[k], 0) for k in by_user[n.id]})
        else:
            rw.copy(n)
        if n.id == last_input:
            for k, (a, _) in enumerate(specs):
                t, src = g.tensor(a), g.nodes[a.node]
                pid = len(rw.nodes)
                rw.nodes.append(Node(pid, f"host{n_pools + k}_{src.name}", "input", "input",
                                     outputs=[dataclasses.replace(t, alias=None)],
                                     category="host", role=("pool", n_pools + k)))
                pools[k] = pid
        for k in by_src.get(n.id, ()):
            a = specs[k][0]
            t, src = g.tensor(a), g.nodes[a.node]
            pool = Ref(pools[k], 0)
            stores[k] = rw.add(src.name + "_store", "aten.copy_.default",
                               aten.copy_.default, (pool, rw.fix(a)), {},
                               [TensorInfo(t.shape, t.dtype, 0, pool, t.stride, t.device)], "host")
            rw.nodes[stores[k]].region = src.region
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
           for r in n.refs()):
        raise ValueError("the stored copy has other readers")

    def rule(rw: Rewriter, n: Node) -> bool:
        if n.id in (pool.node, store.id):
            return True
        if n.id == load:
            rw.remap[Ref(load, 0)] = rw.fix(orig)
            return True
        return False

    return Rewriter(g).run(rule)
