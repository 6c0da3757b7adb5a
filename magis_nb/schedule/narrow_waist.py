"""Narrow waists and the partition of a graph into independently scheduled blocks.

nw(v) = |V| - |anc(v)| - |des(v)| - 1 is the number of ops unrelated to v (paper
§6.1). If nw(v) = 0, v sits at the same step in every topological order and the
scheduling problem splits exactly there. Ancestor/descendant sets are Python-int
bitsets, so a few thousand ops take milliseconds.

Note [light ops]: a training graph hangs small side chains off its spine
(weight-gradient sinks, ops that only read weights); each is unrelated to a long
stretch of the spine and would remove every narrow waist there. The partition
therefore measures nw on the *core* and places the light ops (a weight gradient,
a detach, a causal-mask chain, a weight cast) afterwards. An op is light if it has
at most ``light`` ancestors or descendants or allocates nothing, and is unrelated
to more than max(``light``, min(|V|/16, WIDE)) ops (the first and last ops of a
graph, a first cell's branches, stay in the core).
A light op goes to the block of its last predecessor if running early may free
memory, else to the block of its first successor. *Floating* ops are treated the same way: ops
unrelated to a large part of the graph (nw > max(WIDE, min(|V|/8, FLOAT))), such as a
backward chain that reads only saved activations (BTLM's SiLU backward: sigmoid,
sub, mul of a saved tensor) or a recompute copy. They may run anywhere in a long
range, so every spine op of that range is unrelated to them; left in the core
they would remove every waist there. Both thresholds are capped: a batch-split
training step (fission) repeats one part n times, and thresholds that grew with
|V| kept each part's weight views, dropout draws and SiLU backward chains in
the core, which made every part a single block of thousands of ops.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from magis_nb.simulate.memory import MemGraph

LIGHT = 8        # max ancestors or descendants of a light op
FLOAT = 256      # min nw of a floating op (|V|/8 if smaller, but at least WIDE)
MERGE = 24       # merge consecutive blocks up to this many ops
WIDE = 64        # a light op unrelated to at most this many ops (|V|/16 if smaller) stays core


def topo_order(g: MemGraph, nodes: list[int], inset: set[int] | None,
               key: Sequence[int] | None) -> list[int]:
    """Kahn's order of ``nodes``, ties by ``key`` (a hint position; None: op index).
    Only predecessors in ``inset`` count (None: every predecessor)."""
    import heapq
    k = key if key is not None else range(g.n)
    indeg = {v: 0 for v in nodes}
    for v in nodes:
        for p in g.preds[v]:
            if inset is None or p in inset:
                indeg[v] += 1
    heap = [(k[v], v) for v in nodes if indeg[v] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, v = heapq.heappop(heap)
        out.append(v)
        for s in g.succs[v]:
            if s in indeg:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, (k[s], s))
    if len(out) != len(nodes):
        raise ValueError("graph has a cycle")
    return out


def anc_des(g: MemGraph, topo: list[int]):
    """Bitsets (over positions in ``topo``) of ancestors and descendants."""
    pos = {v: i for i, v in enumerate(topo)}
    anc = [0] * len(topo)
    for i, v in enumerate(topo):
        a = 0
        for p in g.preds[v]:
            j = pos.get(p)
            if j is not None:
                a |= anc[j] | (1 << j)
        anc[i] = a
    des = [0] * len(topo)
    for i in range(len(topo) - 1, -1, -1):
        d = 0
        for s in g.succs[topo[i]]:
            j = pos.get(s)
            if j is not None:
                d |= des[j] | (1 << j)
        des[i] = d
    return anc, des


def nw_values(g: MemGraph, nodes: Iterable[int] | None = None) -> dict[int, int]:
    """nw(v) of every op in ``nodes`` (default: all), within the induced subgraph."""
    nodes = list(range(g.n)) if nodes is None else sorted(nodes)
    inset = None if len(nodes) == g.n else set(nodes)
    topo = topo_order(g, nodes, inset, None)
    anc, des = anc_des(g, topo)
    n = len(topo)
    return {v: n - anc[i].bit_count() - des[i].bit_count() - 1
            for i, v in enumerate(topo)}


def _components(g: MemGraph, nodes: list[int], inset: set[int]) -> list[list[int]]:
    parent = {v: v for v in nodes}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    for v in nodes:
        for p in g.preds[v]:
            if p in inset:
                a, b = find(p), find(v)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    comps: dict[int, list[int]] = {}
    for v in nodes:
        comps.setdefault(find(v), []).append(v)
    return list(comps.values())


def _split_component(g, comp, key, light, cut):
    inset = set(comp)
    topo = topo_order(g, comp, inset, key)
    anc, des = anc_des(g, topo)
    n = len(topo)
    na = [a.bit_count() for a in anc]
    nd = [d.bit_count() for d in des]
    core = 0
    if light >= 0:
        wide = max(light, min(n // 16, WIDE))
        for i in range(n):
            side = na[i] <= light or nd[i] <= light or _alloc(g, topo[i]) == 0
            if not side or n - na[i] - nd[i] - 1 <= wide:
                core |= 1 << i
        # Floating ops, measured among the non-light ops only.
        nc, far = core.bit_count(), max(WIDE, min(core.bit_count() // 8, FLOAT))
        drop = 0
        for i in range(n):
            if core >> i & 1 and (nc - (anc[i] & core).bit_count()
                                  - (des[i] & core).bit_count() - 1) > far:
                drop |= 1 << i
        core &= ~drop
    if core.bit_count() < 2:
        core = (1 << n) - 1          # nothing left: plain nw on everything
    ncore = core.bit_count()
    cuts = 0
    for i in range(n):
        if core >> i & 1:
            nw = ncore - (anc[i] & core).bit_count() - (des[i] & core).bit_count() - 1
            if nw <= cut:
                cuts |= 1 << i
    # Block of a core op: number of cut ops among its ancestors and itself; it
    # only grows along edges, so blocks can run in sequence.
    blk = [-1] * n
    for i in range(n):
        if core >> i & 1:
            blk[i] = ((anc[i] | (1 << i)) & cuts).bit_count()
    pos = {v: i for i, v in enumerate(topo)}
    readers: dict[int, int] = {}
    # Counting puts an op unrelated to a cut before it; one that cannot pay for
    # running early (a recompute copy) moves to the block of its first successor.
    # ``reach[i]``: least block of a core op reachable from i through light ops.
    big = 1 << 60
    reach = [big] * n
    for i in range(n - 1, -1, -1):
        r = big
        for s in g.succs[topo[i]]:
            j = pos.get(s)
            if j is not None and s in inset:
                r = min(r, blk[j] if core >> j & 1 else reach[j])
        reach[i] = r
        if (core >> i & 1 and not cuts >> i & 1 and big > r > blk[i]
                and not _runs_early(g, topo[i], des[i], pos, readers)):
            blk[i] = r
    last = max(blk) if n else 0
    # Where each light op will go. One that pays for running early goes as soon
    # as the inputs that drive it are ready (``lo``: core inputs and early light
    # ones). An allocation goes to the block its first successor is expected
    # in, and so does an early op whose only inputs are such allocations (a
    # view of a weight's cast runs where the view is read). A light successor
    # counts by where it is expected, not by the latest block it could take: a
    # fission region's gradient sum (an allocation) feeds one ``add_`` per
    # part, and placing it by their latest block dragged every part's ``add_``
    # into the last block.
    early = [blk[i] < 0 and _runs_early(g, v, des[i], pos, readers) for i, v in enumerate(topo)]
    lo, hi = [-1] * n, [last] * n
    for i, v in enumerate(topo):
        if blk[i] < 0:
            lo[i] = max([blk[pos[p]] if blk[pos[p]] >= 0 else lo[pos[p]]
                         for p in g.preds[v] if p in inset
                         and (blk[pos[p]] >= 0 or early[pos[p]])] + [-1])
    for i in range(n - 1, -1, -1):
        if blk[i] < 0:
            if early[i] and lo[i] >= 0:
                hi[i] = lo[i]
            else:
                hi[i] = min([hi[pos[s]] if blk[pos[s]] < 0 else blk[pos[s]]
                             for s in g.succs[topo[i]] if s in inset] + [last])
    for i, v in enumerate(topo):
        if blk[i] < 0:
            b = max(hi[i], 0)
            for p in g.preds[v]:
                if p in inset:
                    b = max(b, blk[pos[p]])
            blk[i] = b
    groups: dict[int, list[int]] = {}
    for i, v in enumerate(topo):
        groups.setdefault(blk[i], []).append(v)
    return [groups[b] for b in sorted(groups)]


def _alloc(g: MemGraph, v: int) -> int:
    return sum(g.storages[s].size for s in g.outputs_of[v])


def _runs_early(g: MemGraph, v: int, d: int, pos: dict[int, int],
                readers: dict[int, int]) -> bool:
    """Whether running ``v`` early may pay: it allocates nothing (a view, a
    detach), or the inputs it could be the last reader of (no other reader
    descends from it; ``d`` = its descendant bitset) outweigh what it allocates (a
    weight gradient), as opposed to a Load, a recompute copy (its inputs are read
    again later), a mask or a weight cast. ``readers``: a cache of each storage's
    readers as a bitset over ``pos``, filled here."""
    alloc = _alloc(g, v)
    if alloc == 0:
        return True                  # never raises memory: as soon as ready
    may_free = 0
    me = 1 << pos[v]
    for s in g.inputs_of[v]:
        st = g.storages[s]
        if st.producer < 0 or st.keep:
            continue
        # One AND per input: testing each reader's bit shifts the whole
        # bitset, and a region input has a reader per part (paper GPT-Neo split
        # in 16: 2.9M shifts of 67k-bit sets, 5 s of a 42 s evaluation).
        rb = readers.get(s)
        if rb is None:
            rb = readers[s] = _bits(pos[u] for u in st.users if u in pos)
        if not (d & rb) & ~me:
            may_free += st.size
    return may_free > alloc


def _bits(positions) -> int:
    """The bitset with ``positions`` set."""
    out = 0
    for p in positions:
        out |= 1 << p
    return out


def graph_partition(g: MemGraph, nodes: Iterable[int] | None = None, *,
                    hint: Sequence[int] | None = None, light: int = LIGHT,
                    cut: int = 1, merge: int = MERGE) -> list[list[int]]:
    """Cut ``nodes`` (default all ops) into blocks that run one after another.

    Contract: every op of ``nodes`` is in exactly one block; concatenating any
    topological orders of the blocks (in list order) is a topological order of
    the induced subgraph. Weakly connected components are partitioned separately
    (cut at core nodes with nw <= ``cut``) and ordered by their first position in
    ``hint`` (an order of the ops, default op index). Consecutive blocks of a
    component are merged while they total at most ``merge`` ops (bigger blocks
    only help the DP; merging chains adds states, it does not multiply them).
    ``light=-1`` disables Note [light ops] (pure paper partition).
    """
    nodes = list(range(g.n)) if nodes is None else list(nodes)
    key = [0] * g.n
    if hint is not None:
        for i, v in enumerate(hint):
            key[v] = i
    else:
        key = list(range(g.n))
    inset = set(nodes)
    comps = _components(g, nodes, inset)
    comps.sort(key=lambda c: min(key[v] for v in c))
    out: list[list[int]] = []
    for comp in comps:
        blocks = _split_component(g, comp, key, light, cut)
        cur: list[int] = []
        for b in blocks:
            if cur and len(cur) + len(b) > merge:
                out.append(cur)
                cur = []
            cur = cur + b
        if cur:
            out.append(cur)
    return out
