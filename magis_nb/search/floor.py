"""A lower bound on the peak of every plan under a latency budget, for a
training step with BatchNorm: `bench optimize --part b`'s "lat floor".

The op floor (`simulate.memory.op_floor`) says how low a plan that keeps every
op whole can go at any latency. This one says how low any plan of the search's
space can go at a latency budget, through fission too, when the step has a
training BatchNorm: it tells a bar the search misses from a bar no plan meets.

Note [the first BatchNorm backward is a barrier]
A training BatchNorm's backward reduces its output gradient over the whole
batch (and over H, W): no part of its input gradient is known before every
sample's forward has run to the loss and back to it. Batch and spatial fission
run it in phases (Note [phased normalization]), but its sums still wait for
every part. So at the moment t* those sums are done, every op the backward
``b`` depends on (its ancestors A) has run, none of those depending on it (its
descendants D) has, and every storage made by A and read by b, by D, or
returned (parameter gradients) is either on the device, on the host (stored
before t*, loaded after), or made again after t* by recomputing its producer.

What that costs, relaxed so that no plan can do better:
- Recomputing: a set X of A's ops is recomputed after t*, each once, costing
  its recompute price (`_CostTable.recompute`: a training BatchNorm's is its
  normalize from the saved statistics, which must then be kept). X's inputs
  made by A must be kept too, or be in X. A cat costs nothing and is "recomputed"
  from its pieces: the cat splits (`rules.cat_conv`) remove it. Ops that cannot
  be recomputed (random numbers) are never in X.
- Latency: every op runs at least once at its price in the eager program (a
  split op's parts cost at least the whole in the roofline; BatchNorm's phases
  at least its fused kernel), cats excepted. So the recompute and whatever time
  before t* is not spent on eager ops (sigma) fit in R = lat_budget * T - T.
- Copies: one copy stream at the host link's bandwidth: storages away at t*
  were stored before t*, each after its producer ran (the stream idles tau0
  at the start, `_idle_start`), and are loaded after t*; t* <= T - T_D + sigma
  and the step ends by lat_budget * T.

The kept bytes for a given X are a project-selection problem: storage s is
"available" (kept, or made by X) or not; a needed storage is available; an op
in X needs its inputs available; an available storage whose producer is not in
X costs its bytes; an op in X costs lambda times its price. For a fixed lambda
that is a minimum cut, and max over lambda of (cut - lambda * budget) bounds
the kept bytes under the budget from below (weak duality). The floor is the
resident bytes plus that, less what the copy stream can carry, with sigma
chosen worst for the bound. It ignores everything else at t* (gradients,
working memory) and every later moment, so it is low: paper ResNet-50's at
lat 1.10 is 0.292 of eager's peak where the search's plan is 0.326.
"""
from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import rustworkx as rx

from ..ir.graph import Graph, Ref
from ..rules.cat_conv import CAT
from ..rules.remat import can_rematerialize
from ..simulate.cost import is_training_batch_norm

BN_BACKWARD = "aten.native_batch_norm_backward.default"
BARRIERS = 3          # BatchNorm backwards tried: those with the most descendants
LAMBDA_STEPS = 36     # golden-section steps over log(lambda)
INF = float("inf")
EPS = 1e-6            # residual capacity below this is none (bytes; lambda-scaled seconds)


class Floor(NamedTuple):
    bytes: int            # no plan's peak under the budget is lower
    barrier: str          # the BatchNorm backward whose t* gives it
    needed: int           # bytes made before t* and read after it
    kept: int             # least bytes available at t* (kept or stored)
    copied: int           # most bytes the copy stream can hold away at t*


def barrier_floor(g: Graph, order: list[int], costs, lat_budget: float) -> Floor | None:
    """The floor of ``g`` (an eager program, run in ``order``, priced by
    ``costs``: a `search.space._CostTable`) at ``lat_budget`` times its
    latency (Note [the first BatchNorm backward is a barrier]). None without a
    training BatchNorm, or where copies are synchronous (they cost compute
    time: not modeled here)."""
    bns = [v for v in order if g.nodes[v].target == BN_BACKWARD]
    if not bns or not getattr(costs.cost, "async_copies", False):
        return None
    dag = g.dag
    ops = set(order)
    cost = {v: 0.0 if g.nodes[v].target == CAT else costs.of(g, v) for v in order}
    total = sum(cost.values())
    limit = lat_budget * sum(costs.of(g, v) for v in order)
    rate = 2**30 / costs.transfer_cost(2**30)          # bytes per second
    readers = g.readers()
    returned = {g.storage_of(r) for r in g.outputs}
    resident = sum(t.nbytes for n in g.inputs if n.category != "host"
                   for t in n.outputs if t is not None and t.alias is None)
    best = None
    for b in sorted(bns, key=lambda v: -len(rx.descendants(dag, v)))[:BARRIERS]:
        A = set(rx.ancestors(dag, b)) & ops
        D = set(rx.descendants(dag, b)) & ops
        cut = _KeptCut(g, costs, A, D | {b}, readers, returned)
        t_a = sum(cost[v] for v in A)
        t_d = sum(cost[v] for v in D)
        tau0 = _idle_start(g, dag, A, cost, rate)
        slack = max(0.0, limit - total)

        def copied(sigma: float) -> float:
            return rate * max(0.0, min(total - t_d - tau0 + sigma, limit - t_a - sigma,
                                       (limit - tau0) / 2))

        def bound(log_lam: float) -> tuple[float, float, float]:
            lam = math.exp(log_lam)
            kept = cut.value(lam)
            # sigma: time before t* off the eager ops; the worst for the bound
            # is at an end or a kink of the (convex, piecewise linear) sum
            kinks = (0.0, slack, (limit - t_a - total + t_d + tau0) / 2,
                     limit - t_a - (limit - tau0) / 2, (limit - tau0) / 2 - total + t_d + tau0)
            low = min(kept - lam * (slack - s) - copied(s)
                      for s in (min(max(k, 0.0), slack) for k in kinks))
            return low, kept - lam * slack, copied(0.0)

        lo, hi = math.log(1e6), math.log(1e16)
        seen: dict[float, tuple] = {}
        for _ in range(LAMBDA_STEPS):
            m1, m2 = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
            for m in (m1, m2):
                if m not in seen:
                    seen[m] = bound(m)
            if seen[m1][0] < seen[m2][0]:
                lo = m1
            else:
                hi = m2
        low, kept, away = max(seen.values())
        row = Floor(int(resident + max(0.0, low)), g.nodes[b].name, cut.needed,
                    int(max(0.0, kept)), int(away))
        if best is None or row.bytes > best.bytes:
            best = row
    return best


def _idle_start(g: Graph, dag, A: set[int], cost: dict, rate: float) -> float:
    """Seconds of copy stream lost at the start: a storage cannot be stored
    before its producer and the producer's ancestors have run, so by any time
    tau the stream has stored at most the bytes made by then; the most of tau
    minus their copy time it cannot have spent (a storage's earliest end is
    its ancestors' eager seconds plus its producer's)."""
    made = sorted((sum(cost[v] for v in rx.ancestors(dag, p) if v in A) + cost[p],
                   sum(t.nbytes for t in g.nodes[p].outputs if t is not None and t.alias is None))
                  for p in A)
    lost, before = 0.0, 0
    for end, nbytes in made:
        lost = max(lost, end - before / rate)
        before += nbytes
    return lost


class _KeptCut:
    """The minimum cut of Note [the first BatchNorm backward is a barrier]
    for one barrier: ``value(lam)`` is the least kept bytes plus lam times the
    recompute seconds, over every recompute set."""

    def __init__(self, g: Graph, costs, A: set[int], after: set[int],
                 readers: dict[Ref, set[int]], returned: set[Ref]):
        stor = [Ref(p, i) for p in sorted(A) for i, t in enumerate(g.nodes[p].outputs)
                if t is not None and t.alias is None]
        need = {s for s in stor if readers.get(s, set()) & after or s in returned}
        self.needed = sum(g.tensor(s).nbytes for s in need)
        index = {s: i for i, s in enumerate(stor)}
        op_index = {p: len(stor) + i for i, p in enumerate(sorted(A))}
        self.n = len(stor) + len(A) + 2
        self.source, self.sink = self.n - 2, self.n - 1
        # (u, v, cap, lam-scaled): the source side is "available" / "recomputed"
        self.edges: list[tuple[int, int, float, bool]] = []
        for s in stor:
            if s in need:
                self.edges.append((self.source, index[s], INF, False))
            self.edges.append((index[s], op_index[s.node], float(g.tensor(s).nbytes), False))
        for p in sorted(A):
            n = g.nodes[p]
            if n.target == CAT:
                price = 0.0
            elif can_rematerialize(g, p) is None:
                price = costs.recompute(g, p)
            else:
                price = INF
            if price > 0:
                self.edges.append((op_index[p], self.sink, price, price < INF))
            reads = {g.storage_of(r) for r in n.refs()}
            if is_training_batch_norm(n):       # normalized again from its saved statistics
                reads |= {Ref(p, 1), Ref(p, 2)}
            for s in reads:
                if s in index:
                    self.edges.append((op_index[p], index[s], INF, False))

    def value(self, lam: float) -> float:
        return max_flow(self.n, [(u, v, c * lam if scaled else c)
                                 for u, v, c, scaled in self.edges], self.source, self.sink)


def max_flow(n: int, edges: list[tuple[int, int, float]], s: int, t: int) -> float:
    """Dinic's maximum flow (= the minimum cut) on ``n`` nodes."""
    to: list[int] = []
    cap: list[float] = []
    adj: list[list[int]] = [[] for _ in range(n)]
    for u, v, c in edges:
        adj[u].append(len(to))
        to.append(v)
        cap.append(c)
        adj[v].append(len(to))
        to.append(u)
        cap.append(0.0)
    flow = 0.0
    while True:
        level = [-1] * n
        level[s] = 0
        q = deque([s])
        while q:
            u = q.popleft()
            for e in adj[u]:
                if cap[e] > EPS and level[to[e]] < 0:
                    level[to[e]] = level[u] + 1
                    q.append(to[e])
        if level[t] < 0:
            return flow
        it = [0] * n
        while True:                      # augmenting paths along the levels
            path: list[int] = []
            u = s
            while u != t:
                while it[u] < len(adj[u]):
                    e = adj[u][it[u]]
                    if cap[e] > EPS and level[to[e]] == level[u] + 1:
                        break
                    it[u] += 1
                else:
                    if u == s:
                        break
                    level[u] = -1        # a dead end: not tried again this phase
                    e = path.pop()
                    u = to[e ^ 1]
                    it[u] += 1
                    continue
                path.append(e)
                u = to[e]
            if u != t:
                break
            f = min(cap[e] for e in path)
            for e in path:
                cap[e] -= f
                cap[e ^ 1] += f
            flow += f
