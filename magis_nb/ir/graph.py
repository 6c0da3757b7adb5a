"""The IR: one node per ATen op (or graph input), tensors as (node, output) refs.

Note [views keep their base alive]
A view op (t, view, permute, expand, slice, select, _unsafe_view, alias, detach,
split ...) allocates nothing: its output shares the storage of its input, and that
storage stays allocated until the last user of *any* alias of it has run. Every
tensor therefore maps to a base storage (``Graph.storage_of``); the memory model
counts storages, never tensors. Counting a view as a new allocation is the main
error of the reference implementation's simulator.

Multi-output ops (native_layer_norm, native_dropout, convolution_backward ...)
are single nodes with several outputs; FX's getitem nodes are folded into refs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import rustworkx as rx

from ..simulate.memory import MemGraph, Storage


@dataclass(frozen=True, order=True)
class Ref:
    node: int
    out: int = 0


@dataclass
class TensorInfo:
    shape: tuple[int, ...]
    dtype: Any                      # torch.dtype (kept opaque here)
    nbytes: int                     # bytes of the storage it allocates (0 for a view)
    alias: Ref | None = None        # the tensor whose storage this one shares
    stride: tuple[int, ...] | None = None  # as captured (None when made by a rewrite)
    device: str | None = None       # device type as captured ("cpu", "cuda", "meta")


@dataclass
class Node:
    id: int
    name: str                       # a valid Python identifier, unique in the graph
    kind: str                       # "input" | "op"
    target: str                     # "aten.mm.default", or "input"
    op: Any = None                  # the callable (an OpOverload) for ops
    args: tuple = ()                # Refs where tensors go
    kwargs: dict = field(default_factory=dict)
    outputs: list[TensorInfo | None] = field(default_factory=list)
    category: str = "activation"    # weight|buffer|input|activation|gradient|loss|host
    role: tuple = ()                # inputs: ("param", name) | ("buffer", name) | ("input", i)
                                    # | ("pool", i): a host buffer the module owns (swap)
    rng: bool = False               # draws from the global RNG
    multi: bool = False             # returns a tuple/list (outputs unpacked)
    deps: tuple = ()                # extra predecessors (ordering only, no data)
    region: tuple = ()              # fission: (region id, part k) of an op in a split region


def iter_refs(obj) -> Iterator[Ref]:
    if isinstance(obj, Ref):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from iter_refs(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_refs(o)


def map_refs(obj, fn, counter=None):
    """Rebuild an args structure with each Ref replaced by fn(ref, index)."""
    counter = counter if counter is not None else [0]
    if isinstance(obj, Ref):
        k = counter[0]
        counter[0] += 1
        return fn(obj, k)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_refs(o, fn, counter) for o in obj)
    if isinstance(obj, dict):
        return {k: map_refs(v, fn, counter) for k, v in obj.items()}
    return obj


class Graph:
    """Nodes in a deterministic order (ids are positions); edges in a PyDiGraph."""

    def __init__(self, nodes: list[Node], outputs: list[Ref], output_roles: list[tuple]):
        self.nodes = nodes
        self.outputs = outputs
        self.output_roles = output_roles
        self.dag = rx.PyDiGraph(check_cycle=False, multigraph=False)
        self.dag.add_nodes_from([n.id for n in nodes])
        edges = set()
        for n in nodes:
            for r in iter_refs((n.args, n.kwargs)):
                edges.add((r.node, n.id))
            for d in n.deps:
                edges.add((d, n.id))
        # RNG ops keep their program order in every schedule, so a re-ordered
        # program draws the same random numbers as eager PyTorch (same dropout masks).
        rng = [n.id for n in nodes if n.rng]
        for a, b in zip(rng, rng[1:]):
            edges.add((a, b))
        self.dag.add_edges_from_no_data(sorted(edges))
        self._storage = self._resolve_storages()
        self._readers: dict[Ref, set[int]] | None = None

    # -- structure ---------------------------------------------------------
    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "input"]

    @property
    def ops(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "op"]

    def preds(self, v: int) -> list[int]:
        return sorted(self.dag.predecessor_indices(v))

    def succs(self, v: int) -> list[int]:
        return sorted(self.dag.successor_indices(v))

    def program_order(self) -> list[int]:
        """The op ids in the order the framework emitted them."""
        return [n.id for n in self.nodes if n.kind == "op"]

    def tensor(self, r: Ref) -> TensorInfo:
        t = self.nodes[r.node].outputs[r.out]
        if t is None:
            raise KeyError(f"{self.nodes[r.node].name} has no output {r.out}")
        return t

    # -- storages ----------------------------------------------------------
    def _resolve_storages(self) -> dict[Ref, Ref]:
        base: dict[Ref, Ref] = {}
        for n in self.nodes:
            for i, t in enumerate(n.outputs):
                if t is None:
                    continue
                r = Ref(n.id, i)
                base[r] = base[t.alias] if t.alias is not None else r
        return base

    def storage_of(self, r: Ref) -> Ref:
        """The base tensor owning the storage that ``r`` lives in."""
        return self._storage[r]

    def readers(self) -> dict[Ref, set[int]]:
        """Base tensor -> ops that read its storage, directly or through a view.
        Built on first use and kept, like the storage map: a graph's args do not
        change once it is built (rewrites make new graphs)."""
        if self._readers is None:
            out: dict[Ref, set[int]] = {}
            for n in self.ops:
                for r in iter_refs((n.args, n.kwargs)):
                    out.setdefault(self._storage[r], set()).add(n.id)
            self._readers = out
        return self._readers

    def memgraph(self) -> tuple[MemGraph, list[int], list[Ref]]:
        """The plain-data memory model of this graph.

        Returns the MemGraph (its ops are this graph's op nodes, renumbered
        0..k-1), the op-index -> node-id map, and the storage-index -> base Ref map.
        """
        op_ids = self.program_order()
        index = {nid: i for i, nid in enumerate(op_ids)}
        users: dict[Ref, set[int]] = {}
        for n in self.ops:
            for r in iter_refs((n.args, n.kwargs)):
                users.setdefault(self._storage[r], set()).add(index[n.id])
        kept = {self._storage[r] for r in self.outputs}
        storages, refs = [], []
        for n in self.nodes:
            for i, t in enumerate(n.outputs):
                r = Ref(n.id, i)
                if t is None or t.alias is not None:
                    continue
                producer = index.get(n.id, -1)
                # Host memory (swap buffers) is not device memory: it costs no
                # bytes in the device peak that the simulator and schedulers minimize.
                storages.append(Storage(
                    size=0 if n.category == "host" else t.nbytes, producer=producer,
                    users=tuple(sorted(users.get(r, ()))), keep=r in kept,
                    category=n.category))
                refs.append(r)
        preds = [[index[p] for p in self.preds(nid) if p in index] for nid in op_ids]
        names = [self.nodes[nid].name for nid in op_ids]
        return MemGraph(len(op_ids), preds, storages, names), op_ids, refs

    def summary(self) -> dict:
        from collections import Counter
        cats = Counter()
        for n in self.nodes:
            for t in n.outputs:
                if t is not None and t.alias is None:
                    cats[n.category] += t.nbytes
        return {"nodes": len(self.nodes), "ops": len(self.ops),
                "bytes_by_category": dict(sorted(cats.items()))}

    def __repr__(self) -> str:
        return f"Graph({len(self.inputs)} inputs, {len(self.ops)} ops, {len(self.outputs)} outputs)"
