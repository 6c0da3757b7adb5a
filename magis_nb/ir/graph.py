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

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


class LossSeed(float):
    """The backward's seed (the loss's gradient, 1.0 in the capture) as an op
    argument: generated code reads it from the program's ``_seed`` keyword, so a
    GradScaler's scale can seed the backward (runtime/module.py, Note [the step
    behind autograd]). Everything else sees the float 1.0."""
    __slots__ = ()

    def __repr__(self) -> str:
        return "LossSeed(1.0)"

    def __reduce__(self):
        return (LossSeed, (float(self),))


# The end of a fission part op's name: ``_p{k}`` (``_pv{k}`` a view made per
# part), then what rewrites inside the part add (``_re``, ``_load``, ...).
# Renaming it renames an op for another part (`search.space.every_part`).
PART_SUFFIX = re.compile(r"_p(v?)(\d+)((?:_re|_var|_load|_store)*)$")


class Region(NamedTuple):
    """Where an op of a split fission region sits (``Node.region``). Part k of
    n reads its slice of a split input with a ``narrow`` at ``k * chunk``; the code
    generator turns parts that are identical op for op into a loop over k."""
    rid: int        # the region's index among the regions applied
    part: int       # k: the part this op belongs to, 0 <= k < parts
    parts: int      # n: how many parts the region is split into
    chunk: int = 0  # a narrow taking part k's slice: the slice length; 0 for other ops
    # the narrow takes the first (k + 1) * chunk instead: the keys a causal query
    # part sees (Note [the keys a causal part sees] in analysis/causal.py)
    prefix: bool = False


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
    region: Region | tuple = ()     # fission: the op's place in a split region; () outside one
    # (args, kwargs, their Refs): `refs`' memo, valid while args and kwargs are
    # the same objects (passes that rewrite a node assign new ones)
    _refs: tuple | None = field(default=None, repr=False, compare=False)

    def refs(self) -> list[Ref]:
        """The Refs this node reads, in ``iter_refs`` order. Every pass walks
        them, many times per graph (1.4M walks in a 60 s search on paper BTLM):
        kept, not rebuilt. The list is shared: do not mutate it."""
        c = self._refs
        if c is None or c[0] is not self.args or c[1] is not self.kwargs:
            c = self._refs = (self.args, self.kwargs, iter_refs((self.args, self.kwargs)))
        return c[2]


def contiguous(shape) -> list[int]:
    """The strides of a contiguous tensor of ``shape``."""
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return st[::-1]


def iter_refs(obj) -> list[Ref]:
    """The Refs in an args structure, depth first. A list rather than a generator:
    every graph pass walks every node's args, and nested generators cost several
    times more than one recursive fill."""
    out: list[Ref] = []
    _collect_refs(obj, out)
    return out


def _collect_refs(obj, out: list[Ref]) -> None:
    if isinstance(obj, Ref):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, Ref):
                out.append(o)
            elif isinstance(o, (list, tuple, dict)):
                _collect_refs(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _collect_refs(o, out)


def remap_refs(obj, table: dict[Ref, Ref]):
    """``map_refs`` with a table (Refs not in it stay): the Rewriter's copy, run
    for every node of every rewritten graph, without map_refs' callback and counter."""
    if isinstance(obj, Ref):
        return table.get(obj, obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)([remap_refs(o, table) for o in obj])
    if isinstance(obj, dict):
        return {k: remap_refs(v, table) for k, v in obj.items()}
    return obj


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
    """Nodes in a deterministic order (ids are positions); edges derived from their args."""

    def __init__(self, nodes: list[Node], outputs: list[Ref], output_roles: list[tuple]):
        self.nodes = nodes
        self.outputs = outputs
        self.output_roles = output_roles
        # Edges, storages and readers are derived on first use: a rewrite that
        # prunes dead views builds a graph only to copy it again.
        self._edges: list[tuple[int, int]] | None = None
        self._preds: list[list[int]] = []
        self._succs: list[list[int]] = []
        self._dag: rx.PyDiGraph | None = None
        self._storage: dict[Ref, Ref] | None = None
        self._readers: dict[Ref, set[int]] | None = None
        self._topo: list[int] | None = None

    # -- structure ---------------------------------------------------------
    def _link(self) -> None:
        """Edges (data, deps, RNG order) and the sorted predecessor and successor
        lists that memgraph and the transfer placement ask for every op."""
        edges = set()
        for n in self.nodes:
            for r in n.refs():
                edges.add((r.node, n.id))
            for d in n.deps:
                edges.add((d, n.id))
        # RNG ops keep their program order in every schedule, so a re-ordered
        # program draws the same random numbers as eager PyTorch (same dropout masks).
        rng = [n.id for n in self.nodes if n.rng]
        for a, b in zip(rng, rng[1:]):
            edges.add((a, b))
        self._preds = [[] for _ in self.nodes]
        self._succs = [[] for _ in self.nodes]
        self._edges = sorted(edges)
        for a, b in self._edges:
            self._preds[b].append(a)
            self._succs[a].append(b)

    @property
    def dag(self) -> rx.PyDiGraph:
        """The edges as a rustworkx graph (for its traversals), built on first use:
        most graphs a search builds never need one."""
        if self._dag is None:
            if self._edges is None:
                self._link()
            self._dag = rx.PyDiGraph(check_cycle=False, multigraph=False)
            self._dag.add_nodes_from([n.id for n in self.nodes])
            self._dag.add_edges_from_no_data(self._edges)
        return self._dag

    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "input"]

    @property
    def ops(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "op"]

    def preds(self, v: int) -> list[int]:
        if self._edges is None:
            self._link()
        return list(self._preds[v])

    def succs(self, v: int) -> list[int]:
        if self._edges is None:
            self._link()
        return list(self._succs[v])

    def topo_position(self) -> list[int]:
        """Each node's position in one topological order of the edges (node id ->
        position), built on first use: a walk down from some ops can stop at any
        node placed after the last op it looks for."""
        if self._topo is None:
            pos = [0] * len(self.nodes)
            for i, v in enumerate(rx.topological_sort(self.dag)):
                pos[v] = i
            self._topo = pos
        return self._topo

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

    def _storages(self) -> dict[Ref, Ref]:
        if self._storage is None:
            self._storage = self._resolve_storages()
        return self._storage

    def storage_of(self, r: Ref) -> Ref:
        """The base tensor owning the storage that ``r`` lives in."""
        return self._storages()[r]

    def readers(self) -> dict[Ref, set[int]]:
        """Base tensor -> ops that read its storage, directly or through a view.
        Built on first use and kept, like the storage map: a graph's args do not
        change once it is built (rewrites make new graphs)."""
        if self._readers is None:
            base = self._storages()
            out: dict[Ref, set[int]] = {}
            for n in self.ops:
                for r in n.refs():
                    out.setdefault(base[r], set()).add(n.id)
            self._readers = out
        return self._readers

    def memgraph(self) -> tuple[MemGraph, list[int], list[Ref]]:
        """The plain-data memory model of this graph.

        Returns the MemGraph (its ops are this graph's op nodes, renumbered
        0..k-1), the op-index -> node-id map, and the storage-index -> base Ref map.
        """
        op_ids = self.program_order()
        index = {nid: i for i, nid in enumerate(op_ids)}
        base = self._storages()
        if self._edges is None:
            self._link()
        users: dict[Ref, set[int]] = {}
        for n in self.ops:
            for r in n.refs():
                users.setdefault(base[r], set()).add(index[n.id])
        kept = {base[r] for r in self.outputs}
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
        preds = [[index[p] for p in self._preds[nid] if p in index] for nid in op_ids]
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
