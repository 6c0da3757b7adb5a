"""The search space: a state is a fission plan plus batches of rewrites (remat,
swap, and the TASO subset: merge matmuls sharing an input, sink a scale).

A state's graph is the captured graph with the plan's F-Tree regions split
(`apply_fission`), then each batch of rewrites applied in turn. Rewrites name ops
by their (stable) node names, so a batch can be replayed on a graph with another
fission plan; a rewrite that no longer applies there (its op is now inside a
split region, a user vanished) is dropped, as "rules never cross an enabled
region" requires. Every state is scheduled (incrementally from its parent when
only rewrites changed, Algorithm 2; in full when the fission plan changed), its
Stores and Loads placed to hide transfers, and simulated for memory and latency.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

from ..analysis import DGraph, apply_fission, build_ftree
from ..analysis.spatial import spatial_candidates
from ..analysis.ftree import add_pack_twins
from ..distributed import DataParallel, add_buckets
from ..ir.digest import graph_digest
from ..ir.graph import PART_SUFFIX, Graph, Ref, Region
from ..ir.in_place import rewrite_in_place
from ..ir.phase_fusion import fuse_whole_phases
from ..ir.phased_norm import PHASED_TARGETS
from ..ir.passes import written_in_place
from ..program import Program
from ..rules.algebra import merge_all, why_not_merge
from ..rules.cat_conv import CONV_BWD, split_all, why_not_split
from ..rules.remat import can_rematerialize, recompute_graph, rematerialize_all
from ..rules.scale import sink_all, why_not_sink
from ..rules.swap import rd_region, swap_all
from ..schedule import BlockCache, reschedule, schedule
from ..simulate.cost import is_training_batch_norm
from ..simulate.latency import simulate_latency
from ..simulate.memory import simulate_memory
from .transfers import is_load, is_store, place_transfers, transfers_of


# Incremental rescheduling (Algorithm 2) pays off for rewrites whose touched ops
# sit close together in the schedule. A swap or remat touches an op in the
# forward and its users in the backward: the intervals to redo then cover most
# of the order, and the full DP over narrow-waist blocks is faster (measured on
# paper-size GPT: 0.6 s incremental vs 0.2 s full). So: incremental when at most
# INCREMENTAL_MAX ops are touched within INCREMENTAL_SPAN of the schedule.
INCREMENTAL_MAX = 12
INCREMENTAL_SPAN = 0.1


class Swap(NamedTuple):
    producer: str               # op whose output is stored to host
    out: int
    users: frozenset[str]       # ops that read the loaded copy


class Remat(NamedTuple):
    op: str                     # op recomputed
    users: frozenset[str]       # ops that read the recomputed copy
    chain: tuple[str, ...] = ()  # ancestors recomputed with it (rules.remat.chain_to_live)


class Merge(NamedTuple):
    ops: tuple[str, ...]        # matmuls sharing an input, merged into one


class Sink(NamedTuple):
    op: str                     # a constant scale of a product, moved onto its input


class Split(NamedTuple):
    op: str                     # a convolution of a cat, run one per piece (rules/cat_conv.py)
    forward: bool = True        # False: its backward only (Note [a backward of a cat, one per piece])


class Batch(NamedTuple):
    kind: str                   # "swap" | "remat" | "merge" | "sink" | "split"
    specs: frozenset            # of Swap, Remat, Merge, Sink or Split


@dataclass(eq=False)
class State:
    plan: tuple                 # ((candidate id, n), ...) enabled fission regions
    batches: tuple              # Batch, ... applied in order
    graph: Graph
    sched_names: list[str]      # the memory-aware schedule (op names) before placing transfers
    order: list[int]            # node ids: the executed order (transfers placed)
    peak: int
    latency: float
    hot: list[tuple[int, Ref]]  # (bytes, tensor) of swappable/recomputable activations live at the peak
    peak_step: int
    digest: bytes = b""
    depth: int = 0
    meta: dict = field(default_factory=dict)
    # (bytes, tensor) of the input gradients of convolution backwards live at
    # the peak: a cat's, split away per piece (`proposals.cat_splits`)
    hot_grads: list = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.plan, self.batches)

    @property
    def runs(self) -> tuple[Graph, list[int]]:
        """The graph and order a module of this state runs: its own, or with its
        whole BatchNorms as ATen's kernels (Note [whole phases run as one
        kernel]), which its peak and latency are then of."""
        return self.meta.get("runs") or (self.graph, self.order)


class _CostTable:
    """Op seconds cached by (name, target, shapes): unchanged ops keep their names
    across rewrites, so most of a child's ops are already known. Per graph, the
    seconds are also kept by node id: a state's evaluation, its transfer placement
    and its children's ranking ask for every op of the same graph again, and
    building the key is most of a lookup's cost."""

    def __init__(self, cost, sync_copies: bool = False):
        self.cost = cost
        # Synchronous copies (the CPU): a swap's Store and Load run on the compute
        # stream, priced as transfers. Timed alone like other ops they would be
        # copies between warm caches: 3.3x cheaper than in the step (BERT tiny,
        # 74 swaps: 7.0 ms simulated so, 22.3 ms measured, 23.0 ms as transfers).
        self.sync_copies = sync_copies
        self.table: dict[tuple, float] = {}
        self._by_graph: weakref.WeakKeyDictionary[Graph, dict[int, float]] = \
            weakref.WeakKeyDictionary()

    def key(self, g: Graph, nid: int) -> tuple:
        n = g.nodes[nid]
        ins = tuple(g.tensor(r).shape for r in n.refs())
        outs = tuple(t.shape if t is not None else None for t in n.outputs)
        return (n.name, n.target, ins, outs)

    def of(self, g: Graph, nid: int) -> float:
        known = self._by_graph.get(g)
        if known is None:
            known = self._by_graph[g] = {}
        v = known.get(nid)
        if v is None:
            k = self.key(g, nid)
            v = self.table.get(k)
            if v is None:
                v = self.table[k] = float(self._price(g, nid))
            known[nid] = v
        return v

    def recompute(self, g: Graph, nid: int) -> float:
        """Seconds of op ``nid``'s recomputed copy: the op again, or the ops
        `rules.remat` recomputes it with (a training BatchNorm normalizes from
        its saved statistics), priced alone."""
        if not is_training_batch_norm(g.nodes[nid]):
            return self.of(g, nid)
        key = ("recompute",) + self.key(g, nid)[1:]
        v = self.table.get(key)
        if v is None:
            alone = recompute_graph(g, nid)
            v = self.table[key] = sum(float(self.cost.op_cost(alone, n.id)) for n in alone.ops)
        return v

    def _price(self, g: Graph, nid: int) -> float:
        if self.sync_copies:
            if is_store(g, nid):
                return self.cost.transfer_cost(g.tensor(g.nodes[nid].args[1]).nbytes)
            if is_load(g, nid):
                return self.cost.transfer_cost(g.tensor(Ref(nid, 0)).nbytes)
        return self.cost.op_cost(g, nid)

    def op_cost(self, g: Graph, node) -> float:      # CostModel protocol, for the simulator
        return self.of(g, node if isinstance(node, int) else node.id)

    def transfer_cost(self, nbytes: int) -> float:
        return self.cost.transfer_cost(nbytes)


class Space:
    """Builds and evaluates states of one captured program."""

    def __init__(self, program: Program, cost, *, async_copies: bool, levels: int = 4,
                 algebra: bool = True, fission: bool = True, swap: bool = True,
                 comm: DataParallel | None = None, tiles: bool | None = None):
        self.program = program
        self.comm = comm            # data parallel: gradient buckets priced in every state
        self.algebra = algebra      # kill switch for the merge/sink rules (proposals)
        self.swap = swap            # kill switch for swapping (pricing.ranked)
        # Note [a convolution of a cat] in rules/cat_conv.py: not on CPU op
        # timings, which price the split as free where the step measures it slower
        self.split_cats = algebra and not _cpu_timed(cost)
        self.base = program.graph
        self.costs = _CostTable(cost, sync_copies=not async_copies)
        self.blocks = BlockCache()  # a child's blocks are mostly its parent's
        self.async_copies = async_copies
        # fission=False: no D-Graph (about 2 s on paper BTLM) and no F-Tree
        # candidates, so no plan ever names a region and nothing reads self.dg
        self.dg, self.cands = None, []
        if fission:
            self.dg = DGraph(self.base)
            hot = program.hotspots()
            self.cands = build_ftree(self.dg, hot, levels=levels)
            add_pack_twins(self.dg, self.cands)
            # image regions in tiles (Note [tiles with halos]); a training
            # step's backward ones when asked (Note [gradients in tiles]): no
            # search measured so far gains from them, and they cost it time
            if tiles is not False:
                self.cands += spatial_candidates(self.base, hot, len(self.cands),
                                                 train=bool(tiles))
        self._fission: dict[tuple, Graph] = {}
        self.evaluated = 0
        # Note [whole phases run as one kernel]: states are priced as they run
        self.phased = any(n.target in PHASED_TARGETS for n in self.base.ops)
        # Note [elementwise ops in place] (a switch for measuring without)
        self.elementwise_in_place = True

    # -- graphs -----------------------------------------------------------------
    def plan_ops(self, plan: tuple) -> int:
        """About how many nodes ``plan``'s graph has, before it is built: each
        split region's ops once per part."""
        return len(self.base.nodes) + sum((n - 1) * len(self.cands[c].ops) for c, n in plan)

    def fission_graph(self, plan: tuple) -> Graph:
        g = self._fission.get(plan)
        if g is None:
            g = self.base if not plan else apply_fission(
                self.dg, [self.cands[c].ftrans(n) for c, n in plan])
            if len(self._fission) > 16:
                self._fission.pop(next(iter(self._fission)))
            self._fission[plan] = g
        return g

    def apply(self, g: Graph, batch: Batch) -> tuple[Graph, Batch]:
        """``batch`` on ``g``, keeping the specs that still apply there. A spec
        on an op of a split region applies in every part (Note [rewrites inside
        the parts])."""
        if batch.kind in ("merge", "sink", "split"):
            return _apply_algebra(g, batch)
        ids = {n.name: n.id for n in g.nodes}
        rd = g.readers()
        written = written_in_place(g)
        kept, args, taken = [], [], set()
        for spec in sorted(batch.specs):
            ok = False
            for s in every_part(g, ids, spec):
                one = _swap_arg(g, ids, rd, written, s) if batch.kind == "swap" \
                    else _remat_arg(g, ids, rd, s)
                if one is None or one[0] in taken:
                    continue
                taken.add(one[0])
                args.append(one)
                ok = True
            if ok:
                kept.append(spec)
        if not args:
            return g, Batch(batch.kind, frozenset())
        g2 = swap_all(g, args) if batch.kind == "swap" else rematerialize_all(g, args)
        return g2, Batch(batch.kind, frozenset(kept))

    def build(self, plan: tuple, batches: tuple) -> tuple[Graph, tuple]:
        g = self.fission_graph(plan)
        kept = []
        for b in batches:
            g, b2 = self.apply(g, b)
            if b2.specs:
                kept.append(b2)
        return g, tuple(kept)

    # -- evaluation ---------------------------------------------------------------
    def evaluate(self, plan: tuple, batches: tuple, graph: Graph, *,
                 parent: State | None = None, touched: set[str] | None = None,
                 digest: bytes | None = None) -> State:
        # Note [elementwise ops in place]: the same kernels (same node ids),
        # priced on ``graph``; the memory, and so the schedule, is the
        # rewritten program's
        ip, last = self.in_place(graph) or (None, {})
        mg, op_ids, refs = (ip or graph).memgraph()
        if parent is not None and touched and _local(parent.sched_names, touched):
            s = reschedule(mg, parent.sched_names, touched, cache=self.blocks)
        else:
            s = schedule(mg, cache=self.blocks)
        tight = nodes = [op_ids[i] for i in s.order]
        index = {nid: i for i, nid in enumerate(op_ids)}
        if self.async_copies:
            nodes = self.placed(graph, nodes, simulate_memory(mg, s.order).live)
        meta = {} if ip is None else {"runs": (ip, nodes)}
        if self.comm is not None:
            latency, tl, mg, refs, _ = self.with_buckets(ip or graph, nodes)
        else:
            latency = self._latency(graph, nodes)
            tl = simulate_memory(mg, [index[v] for v in nodes])
        peak = tl.peak
        if self.phased:
            peak, latency, fmeta = self.fused(graph, nodes, peak, latency, tight)
            meta = fmeta or meta
        hot, grads = [], []
        for i in tl.hotspots:
            st = mg.storages[i]
            r = last.get(refs[i], refs[i])
            if st.category == "activation" and st.producer >= 0 and st.size > 0:
                hot.append((st.size, r))
            elif r.out == 0 and r.node < len(graph.nodes) and graph.nodes[r.node].target == CONV_BWD:
                grads.append((st.size, r))
        hot.sort(key=lambda t: (-t[0], t[1].node, t[1].out))
        grads.sort(key=lambda t: (-t[0], t[1].node))
        self.evaluated += 1
        return State(plan, batches, graph, s.names, nodes, peak, latency, hot,
                     tl.peak_steps[0] if tl.peak_steps else 0,
                     digest if digest is not None else graph_digest(graph),
                     0 if parent is None else parent.depth + 1, meta, grads)

    def placed(self, graph: Graph, tight: list[int], live: list[int] | None = None) -> list[int]:
        """``tight`` (the memory-aware order, node ids; ``live``: its bytes at
        each step, simulated when not given) with its swaps' copies moved to
        hide behind compute (`place_transfers`), within that order's peak."""
        if not any(_moves(graph, v) for v in tight):
            return tight
        if live is None:
            live = _simulate(graph, tight)[0].live
        live = [m for m, v in zip(live, tight) if not _moves(graph, v)]
        return place_transfers(graph, tight, lambda v: self.costs.of(graph, v),
                               self.costs.transfer_cost, live)

    def in_place(self, graph: Graph) -> tuple[Graph, dict] | None:
        """`rewrite_in_place` of ``graph`` (Note [elementwise ops in
        place]), or None."""
        return rewrite_in_place(graph) if self.elementwise_in_place else None

    def fused(self, graph: Graph, nodes: list[int], peak: int, latency: float,
              tight: list[int] | None = None, in_place: bool = True) -> tuple[int, float, dict]:
        """(peak, latency, meta) of the order with its whole BatchNorms as ATen's
        kernels (Note [whole phases run as one kernel]) where that is no higher
        and no slower; else the order's own, and no meta.

        ``tight``: the memory-aware order ``nodes`` placed its copies in, when
        copies are asynchronous. The fused program's copies are placed again
        on its own op times: the fused ops run faster than the phases, so copies
        timed against the phases would be exposed (paper ResNet-50, four swaps of
        196 MiB: 0.93 ms stalled in the phased program, 3.9 ms once fused)."""
        out = fuse_whole_phases(graph, nodes if tight is None else tight)
        if out is None:
            return peak, latency, {}
        g2, n2 = out
        if tight is not None:
            n2 = self.placed(g2, n2)
        # ``in_place``: False for the program PyTorch runs (eager's memory)
        run = ((self.in_place(g2) if in_place else None) or (g2,))[0]
        if self.comm is not None:    # as it runs data parallel: with its buckets
            latency2, tl2, *_ = self.with_buckets(run, n2)
            peak2 = tl2.peak
        else:
            peak2 = _simulate(run, n2)[0].peak
            latency2 = self._latency(g2, n2)
        if peak2 <= peak and latency2 <= latency:
            return peak2, latency2, {"runs": (run, n2)}
        return peak, latency, {}

    def _latency(self, graph: Graph, nodes: list[int], comms=()) -> float:
        if self.async_copies or comms:
            compute, xs = transfers_of(graph, nodes) if self.async_copies else (nodes, [])
            return simulate_latency(graph, compute, self.costs, transfers=xs, check=False,
                                    comms=comms, comm_cost=self.comm.link.allreduce_cost
                                    if comms else None).total_s
        return sum(self.costs.of(graph, v) for v in nodes)

    def bucketed(self, graph: Graph, nodes: list[int]):
        """(graph, order, buckets) of a plan with its gradients in buckets."""
        return add_buckets(graph, nodes, self.comm.cap)

    def with_buckets(self, graph: Graph, nodes: list[int]):
        """Latency and memory of the plan as it runs data parallel: its gradient
        buckets are ops and storages (their copies, their memory), their
        all_reduces the latency model's third stream (`distributed.buckets`)."""
        g2, order2, buckets = self.bucketed(graph, nodes)
        tl, mg, refs = _simulate(g2, order2)
        latency = self._latency(g2, order2, [(b.nbytes, b.node) for b in buckets])
        return latency, tl, mg, refs, g2


def _cpu_timed(cost) -> bool:
    from ..simulate.measured import MeasuredCost
    return isinstance(cost, MeasuredCost) and str(cost.device) == "cpu"


def _simulate(graph: Graph, order: list[int]):
    """(timeline, memgraph, storage refs) of ``graph`` run in ``order`` (node ids)."""
    mg, op_ids, refs = graph.memgraph()
    index = {nid: i for i, nid in enumerate(op_ids)}
    return simulate_memory(mg, [index[v] for v in order]), mg, refs


def _apply_algebra(g: Graph, batch: Batch) -> tuple[Graph, Batch]:
    """Merge/sink/split specs that apply on ``g`` (ops present; outside fission
    regions, but for a backward's split in a part, made in every part)."""
    ids = {n.name: n.id for n in g.nodes}
    kept, args, used = [], [], set()
    whole = []      # splits of the backward alone
    for spec in sorted(batch.specs):
        ok = False
        # a backward's split in a fission part is made in every part
        for s in every_part(g, ids, spec) if batch.kind == "split" else [spec]:
            names = s.ops if batch.kind == "merge" else (s.op,)
            nids = [ids.get(nm) for nm in names]
            if None in nids or used & set(nids):
                continue
            why = why_not_merge(g, nids) if batch.kind == "merge" else why_not_sink(g, nids[0]) \
                if batch.kind == "sink" else why_not_split(g, nids[0])
            if why is None:
                ok = True
                args.append(nids if batch.kind == "merge" else nids[0])
                used.update(nids)
                if batch.kind == "split" and not s.forward:
                    whole.append(nids[0])
        if ok:
            kept.append(spec)
    if not args:
        return g, Batch(batch.kind, frozenset())
    if batch.kind == "sink":
        return sink_all(g, args), Batch("sink", frozenset(kept))
    if batch.kind == "split":
        return split_all(g, args, whole), Batch("split", frozenset(kept))
    try:
        return merge_all(g, args), Batch("merge", frozenset(kept))
    except ValueError:
        # groups that would each hoist the other's inputs: merge them one at a time
        done = []
        for s in kept:
            cur = {n.name: n.id for n in g.nodes}
            nids = [cur[nm] for nm in s.ops]
            if why_not_merge(g, nids) is None:
                g = merge_all(g, [nids])
                done.append(s)
        return g, Batch("merge", frozenset(done))


def _local(order_names: list[str], touched: set[str]) -> bool:
    if len(touched) > INCREMENTAL_MAX:
        return False
    pos = [i for i, nm in enumerate(order_names) if nm in touched]
    return bool(pos) and max(pos) - min(pos) <= INCREMENTAL_SPAN * len(order_names)


def _swap_arg(g: Graph, ids, rd, written, s: Swap):
    """(tensor, users) of swap ``s`` on ``g``, or None when it no longer applies."""
    p = ids.get(s.producer)
    if p is None or g.nodes[p].kind != "op" \
            or s.out >= len(g.nodes[p].outputs) or g.nodes[p].outputs[s.out] is None \
            or g.nodes[p].outputs[s.out].alias is not None:
        return None
    a = Ref(p, s.out)
    if a in written or is_load(g, p):
        return None
    users = {ids.get(u) for u in s.users}
    if None in users or not users <= rd.get(a, set()) \
            or any(_moves(g, u) for u in users) \
            or any(rd_region(g, u) != rd_region(g, p) for u in users):
        return None
    return a, users


def _remat_arg(g: Graph, ids, rd, s: Remat):
    """(op, users, chain) of remat ``s`` on ``g``, or None when it no longer applies."""
    a = ids.get(s.op)
    chain = tuple(ids.get(c) for c in s.chain)
    if a is None or None in chain or any(can_rematerialize(g, v) is not None
                                         for v in chain + (a,)) \
            or list(chain) != sorted(chain) or (chain and chain[-1] >= a):
        return None
    outs = {Ref(a, i) for i, t in enumerate(g.nodes[a].outputs) if t is not None}
    reach = set().union(*(rd.get(g.storage_of(r), set()) for r in outs))
    users = {ids.get(u) for u in s.users}
    if None in users or not users <= reach:
        return None
    part = rd_region(g, a)
    if any(rd_region(g, v) != part for v in chain + tuple(users)):
        return None
    return a, users, chain


# Note [rewrites inside the parts]
# A split region's parts are the same ops on slices, one part after another: a
# whole-step batch split runs part k's forward and backward before part k+1's.
# Each part's saved activations then make the peak (paper GPT-Neo split in 16:
# 3.1 GB of a part's activations next to 5.2 GB of weights and gradient sums),
# and a part is where they can be recomputed or swapped. A swap or remat on an
# op of a part serves readers in that part only (it never crosses the region's
# boundary, DESIGN.md §5), and it is applied in every part: the peak moves from
# part to part otherwise. Part ops are named ``{op}_p{k}`` (``_pv{k}`` for a
# part's slice, rewrites add suffixes such as ``_re`` or ``_load``): a spec named
# in part k is the same names with k replaced, in each part that has them all.
# Such a rewrite costs a state more than one outside the parts (it touches every
# part, so no incremental schedule), and `pricing.ranked` lists them apart:
# a state proposes them after all its other children (`proposals`).
def every_part(g: Graph, ids, spec):
    """``spec`` (a Swap, Remat or Split) once per part of the split region its
    op is in, renamed for each part; ``[spec]`` outside a region (or when a
    name is not a part op's)."""
    head = ids.get(spec.producer if isinstance(spec, Swap) else spec.op)
    reg = g.nodes[head].region if head is not None else ()
    if not isinstance(reg, Region) or reg.parts < 2:
        return [spec]
    k = str(reg.part)
    names = [spec.producer if isinstance(spec, Swap) else spec.op, *getattr(spec, "users", ()),
             *getattr(spec, "chain", ())]
    if any(not (m := PART_SUFFIX.search(nm)) or m.group(2) != k for nm in names):
        return [spec]

    def rename(nm: str, j: int) -> str:
        return PART_SUFFIX.sub(lambda m: f"_p{m.group(1)}{j}{m.group(3)}", nm)

    out = []
    for j in range(reg.parts):
        if isinstance(spec, Split):
            out.append(Split(rename(spec.op, j), spec.forward))
        elif isinstance(spec, Swap):
            out.append(Swap(rename(spec.producer, j), spec.out,
                            frozenset(rename(u, j) for u in spec.users)))
        else:
            out.append(Remat(rename(spec.op, j), frozenset(rename(u, j) for u in spec.users),
                             tuple(rename(c, j) for c in spec.chain)))
    return out


def _moves(g: Graph, v: int) -> bool:
    return is_store(g, v) or is_load(g, v)
