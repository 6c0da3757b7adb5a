"""Algorithm 3 (the seed's §6.2): best-first search over fission, remat and swap.

Modes. Memory limit M: minimize latency among states with peak <= M (states
above M rank by peak). Latency limit L: minimize peak among states with latency
<= L (states above L rank by latency). ``better(a, b, relax)`` is the seed's
BetterThan: the lexicographic key of ``a`` against ``b``'s key scaled by
``relax``; a child enters the queue when it is better than the best so far
relaxed by 1.1, so slightly worse states stay explorable. Under a memory limit
the search is steered by a latency target that climbs until M is met (see
`_Ladder`), while the mode's own order keeps one turn in DIVE_EVERY.

Which rewrites a state proposes (the seed's heuristic H2): only tensors live at
the peak. Swap and remat act on the cheapest of them per byte saved (see
`_ranked`), one at a time and in batches of 2 to 128, biggest first (a training
peak holds hundreds of saved activations: one tensor per step would need hundreds
of steps), with their users being the readers after the peak. F-Tree rules: enable the best-scoring candidates, mutate n, lift, disable.
Before the queue runs, the best-scoring candidate of the whole F-Tree is
enabled on the root (`_enable_top`), and every F-Tree child that lowers the
peak starts a line search along its n (`_jump`): on a paper-size transformer
the batch split of the whole step is the plan to find, and a state per lift
and per divisor would not get there within a minute.
Inverse rules: drop one of the latest batches (de-swap, de-remat).
TASO subset (`_algebra`): merges of matmuls sharing an input and scale sinks
whose own ops cost less by the cost model, all together and the best one alone;
the state's simulated latency and peak then decide, like every other child.
"""
from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from ..analysis.ftrans import divisors
from ..analysis.ftree import least_parts, mutations
from ..ir.digest import graph_digest
from ..ir.graph import iter_refs
from ..rules.algebra import merge_all, merge_groups
from ..rules.remat import can_rematerialize, chain_to_live, written_in_place
from ..rules.scale import sink_all, sink_sites
from .transfers import is_load, is_store
from .space import Batch, Merge, Remat, Sink, Space, State, Swap

RELAX = 1.1
SINGLE = 4                 # single-tensor rewrites proposed per state and rule
BATCHES = (2, 4, 8, 16, 32, 64, 128)  # batch sizes proposed per state and rule
ENABLE = 6                 # F-Tree candidates proposed for enabling per state
QUEUE_CAP = 64             # states kept in the queue (the worst are dropped)
EXPAND = 8                 # children evaluated per pop (see search)
LADDER_START = 1.05        # a memory-budget search's first latency target (see _Ladder)
LADDER_STEP = 1.1
LADDER_MAX = 4.0
DIVE_EVERY = 4             # a memory-budget search's dive turn while the ladder runs
WINDOW = 2 * EXPAND        # states over which the ladder measures its pace


@dataclass
class Objective:
    kind: str                  # "mem" | "lat"
    limit: float               # bytes | seconds

    def key(self, s: State, relax: float = 1.0) -> tuple:
        if self.kind == "mem":
            return (max(relax * s.peak, self.limit), relax * s.latency)
        return (max(relax * s.latency, self.limit), relax * s.peak)

    def better(self, a: State, b: State, relax: float = 1.0) -> bool:
        return self.key(a) < self.key(b, relax)


@dataclass
class SearchLog:
    best: State
    pareto: list[State] = field(default_factory=list)
    states: int = 0
    seconds: float = 0.0
    interrupted: bool = False


def _pareto_add(front: list[State], s: State) -> list[State]:
    if any(o.peak <= s.peak and o.latency <= s.latency for o in front):
        return front
    front = [o for o in front if not (s.peak <= o.peak and s.latency <= o.latency)]
    front.append(s)
    front.sort(key=lambda o: (o.peak, o.latency))
    return front


def _ranked(space: Space, st: State) -> tuple[list[Swap], list[Remat]]:
    """Swap and remat candidates among the peak's tensors, cheapest per byte first.

    A swap costs the part of its Store + Load that the compute between the
    tensor's last use before the peak and its first use after it cannot hide
    (all of it where copies are synchronous). A remat costs its op again, and is
    only proposed when the op's inputs are live at the peak anyway (resident, or
    hot themselves), or can be recomputed from such through a short chain of
    ops, whose cost it adds: keeping a dead input alive for the recompute would
    eat the gain.
    """
    g = st.graph
    pos = {v: i for i, v in enumerate(st.order)}
    rd = g.readers()
    costs = space.costs
    prefix = [0.0]
    for v in st.order:
        prefix.append(prefix[-1] + costs.of(g, v))
    hot_bases = {r for _, r in st.hot}
    written = written_in_place(g)
    swaps, remats = [], []
    for size, r in st.hot:
        readers = rd.get(r, set())
        if any(is_store(g, u) for u in readers):
            continue  # swapped already; its users read the loaded copy
        users = {u for u in readers if pos[u] > st.peak_step}
        if not users:
            continue
        before = readers - users
        last_before = max([pos[u] for u in before] + [pos[r.node]])
        first_after = min(pos[u] for u in users)
        names = frozenset(g.nodes[u].name for u in users)
        src = g.nodes[r.node].name
        if r in written or is_load(g, r.node):
            continue  # a loaded copy is not swapped again: its Load is moved instead
        xfer = 2 * costs.transfer_cost(size)
        gap = prefix[first_after] - prefix[last_before + 1]
        exposed = max(0.0, xfer - gap) if space.async_copies else xfer
        swaps.append((exposed / size, -size, len(swaps), Swap(src, r.out, names)))
        # Recomputing an op whose output nobody reads before the peak only moves
        # it (the scheduler's job), and leaves a dead original behind.
        if before and can_rematerialize(g, r.node) is None:
            chain = chain_to_live(g, r.node, hot_bases)
            if chain is not None:
                cost = sum(costs.of(g, v) for v in chain + [r.node])
                remats.append((cost / size, -size, len(remats),
                               Remat(src, names, tuple(g.nodes[v].name for v in chain))))
    remats = _compatible(g, [t[-1] for t in sorted(remats)])
    return [t[-1] for t in sorted(swaps)], remats


def _compatible(g, remats: list[Remat]) -> list[Remat]:
    """``remats`` in rank order, less those that would undo an earlier one: a
    recompute reads the original of every tensor outside its chain, so it keeps
    alive a tensor that an earlier remat frees (a conv output, when BatchNorm
    and ReLU are recomputed from it), or frees one an earlier recompute reads.
    Every prefix of the result can go in one batch."""
    ids = {n.name: n.id for n in g.nodes}
    out, targets, reads = [], set(), set()
    for s in remats:
        ops = [ids[c] for c in s.chain] + [ids[s.op]]
        inside = set(ops)
        needs = {g.storage_of(r).node for v in ops
                 for r in iter_refs((g.nodes[v].args, g.nodes[v].kwargs))} - inside
        if ids[s.op] in reads or needs & targets:
            continue
        out.append(s)
        targets.add(ids[s.op])
        reads |= needs
    return out


def _product_of(g, name: str) -> str:
    """The op whose output a scale reads through views (a Sink's product)."""
    n = next((m for m in g.nodes if m.name == name), None)
    if n is None:
        return name
    r = n.args[0]
    while g.tensor(r).alias is not None:
        r = g.tensor(r).alias
    return g.nodes[r.node].name


def _algebra_gains(space: Space, plan: tuple) -> list[tuple[float, str, tuple]]:
    """(seconds saved by the rewritten ops, kind, spec) for every merge and sink on
    the plan's fission graph that saves time, best first; once per plan."""
    if plan in space._algebra:
        return space._algebra[plan]
    g = space.fission_graph(plan)
    of = space.costs.of
    out = []
    groups = merge_groups(g)
    if groups:
        g2 = merge_all(g, groups)
        ids = {n.name: n.id for n in g2.nodes}
        for gr in groups:
            merged = g2.nodes[ids[g.nodes[gr[0]].name]].args[0].node   # a slice of it
            new = [merged] + [r.node for r in iter_refs(g2.nodes[merged].args)
                              if g2.nodes[r.node].target == "aten.cat.default"]
            saved = sum(of(g, i) for i in gr) - sum(of(g2, i) for i in new)
            out.append((saved, "merge", Merge(tuple(g.nodes[i].name for i in gr))))
    sites = sink_sites(g)
    ids_g = {n.name: n.id for n in g.nodes}
    if sites:
        g2 = sink_all(g, sites)
        ids = {n.name: n.id for n in g2.nodes}
        for d in sites:
            old = [d, ids_g[_product_of(g, g.nodes[d].name)]]
            new = [ids[g.nodes[i].name] for i in old]
            saved = sum(of(g, i) for i in old) - sum(of(g2, i) for i in new)
            out.append((saved, "sink", Sink(g.nodes[d].name)))
    out = sorted((t for t in out if t[0] > 0), key=lambda t: (-t[0], t[1], t[2]))
    space._algebra[plan] = out
    return out


def _algebra(space: Space, st: State) -> list[tuple[str, list]]:
    """(kind, specs) children: every saving rewrite of a kind at once, and the best alone."""
    if not space.algebra:
        return []
    done = {s for b in st.batches if b.kind in ("merge", "sink") for s in b.specs}
    out = []
    for kind in ("merge", "sink"):
        cand = [s for _, k, s in _algebra_gains(space, st.plan) if k == kind and s not in done]
        if len(cand) > 1:
            out.append((f"{kind}x{len(cand)}", cand))
        if cand:
            out.append((kind, cand[:1]))
    return out


def proposals(space: Space, st: State) -> list[tuple[str, tuple, tuple, set]]:
    """Children of ``st`` as (rule, plan, batches, touched op names)."""
    swaps, remats = _ranked(space, st)
    out = []

    def add(rule, kind, specs):
        if not specs:
            return
        touched = set()
        for s in specs:
            if kind == "merge":
                touched |= set(s.ops)
                continue
            if kind == "sink":    # the product it scaled is rewritten too
                touched.add(_product_of(st.graph, s.op))
            touched |= set(getattr(s, "users", ()))
            touched.add(s.producer if kind == "swap" else s.op)
            touched.update(getattr(s, "chain", ()))
        out.append((rule, st.plan, st.batches + (Batch(kind, frozenset(specs)),), touched))

    # Big steps first: when the search is cut short (time, max_states) the
    # children it did evaluate are the ones that move the peak the most.
    for k in sorted(BATCHES, reverse=True):
        for kind, cand in (("swap", swaps), ("remat", remats)):
            if len(cand) >= k:
                add(f"{kind}x{k}", kind, cand[:k])
    for kind, cand in (("swap", swaps), ("remat", remats)):
        for s in cand[:SINGLE]:
            add(kind, kind, [s])
    # F-Tree rules on the plan; rewrites are replayed on the new fission graph.
    plan = dict(st.plan)
    enables = []
    for rule, new in mutations(space.cands, plan):
        key = tuple(sorted(new.items()))
        if rule == "pack":
            # first: one state, and in a transformer split along the batch it is
            # the biggest step there is (GPT-Neo split in 16: 0.256 -> 0.175)
            out.insert(0, (rule, key, st.batches, set()))
        elif rule == "enable":
            (cid,) = set(new) - set(plan) or {None}
            if cid is None:
                continue
            enables.append((space.cands[cid].score, cid, key))
        else:
            out.append((rule, key, st.batches, set()))
    enables.sort(key=lambda t: (-t[0], t[1]))
    for _, _, key in enables[:ENABLE]:
        out.append(("enable", key, st.batches, set()))
    for rule, specs in _algebra(space, st):
        add(rule, rule.split("x")[0], specs)
    for i in range(max(0, len(st.batches) - 3), len(st.batches)):
        out.append((f"undo-{st.batches[i].kind}", st.plan, st.batches[:i] + st.batches[i + 1:], set()))
    return out


def _enable_top(space: Space, st: State) -> tuple | None:
    """The plan with the best-scoring F-Tree candidate that overlaps no enabled
    region enabled at its least n, or None. Algorithm 1 scores a candidate by
    the hot bytes it splits, so in a transformer this is the whole training
    step split along the batch; reaching it from the leaves takes a lift per
    F-Tree level, each waiting for its turn in the queue."""
    plan = dict(st.plan)
    taken = [space.cands[j].ops for j in plan]
    for c in sorted(space.cands, key=lambda c: (-c.score, c.id)):
        if c.id in plan or any(c.ops & ops for ops in taken):
            continue
        return tuple(sorted({**plan, c.id: least_parts(c.max_n)}.items()))
    return None


FISSION_RULES = ("enable", "enable-top", "lift", "mutate")
JUMPS = 3                  # states a line search along n may add (see _jump)
TRUST = 4                  # a jump from n whose latency fell goes to at most TRUST * n


def _jump(space: Space, parent: State, child: State, objective: Objective, *,
          skip_next: bool = True) -> tuple | None:
    """A line search along n: when an F-Tree rule changed one region's n and
    that lowered the peak, the plan at the n that the two points predict meets
    the budget, or None. Latency grows about linearly with n (every part
    launches its ops again), the peak about as a + b/n (the split bytes shrink
    by n); when the latency fell from n0 to n1, no further than TRUST * n1.
    From an F-Tree child the next n is `mutate`'s, so only jumps past it
    are proposed (``skip_next``); the search follows up to JUMPS of them. One
    step per divisor costs a state each, and at n = 16 a paper-size
    transformer's split graph has 56k ops (about 20 s a state): the queue
    would rarely get there in a 60 s search."""
    old, new = dict(parent.plan), dict(child.plan)
    changed = [c for c in new if new[c] != old.get(c)]
    if len(changed) != 1 or child.peak >= parent.peak:
        return None
    cid = changed[0]
    n0, n1 = old.get(cid, 1), new[cid]
    if n1 <= n0:
        return None
    ahead = [d for d in divisors(space.cands[cid].max_n) if d > n1]
    if len(ahead) < (2 if skip_next else 1):
        return None
    if objective.kind == "lat":
        if child.latency > objective.limit:
            return None
        rise = child.latency - parent.latency
        if rise <= 0:
            # More parts ran faster: the two points contradict "linear in n"
            # and predict nothing. (Ops timed alone on a CPU do this: a small
            # part's op runs from cache.) Extrapolating a zero slope sent BERT
            # and GPT at n=2 straight to n=48, measured x1.43-1.76.
            near = [d for d in ahead if d <= TRUST * n1]
            pick = near[-1] if near else None
        else:
            slope = rise / (n1 - n0)
            fits = [d for d in ahead if child.latency + slope * (d - n1) <= objective.limit]
            pick = fits[-1] if fits else None
    else:
        if child.peak <= objective.limit:
            return None                     # met: more parts only cost latency
        b = (parent.peak - child.peak) / (1 / n0 - 1 / n1)
        a = child.peak - b / n1
        fits = [d for d in ahead if a + b / d <= objective.limit]
        pick = fits[0] if fits else ahead[-1]
    if pick is None or (skip_next and pick == ahead[0]):
        return None
    return tuple(sorted({**new, cid: pick}.items()))


class _Queue:
    """States waiting to be expanded, ranked and admitted by an objective; the
    QUEUE_CAP // 2 best are kept when it grows past QUEUE_CAP."""

    def __init__(self, objective: Objective):
        self.objective = objective
        self.heap: list = []      # (key, seeded tie-break, insertion count, state)

    def push(self, st: State, tie: float, count: int) -> None:
        heapq.heappush(self.heap, (self.objective.key(st), tie, count, st))
        if len(self.heap) > QUEUE_CAP:
            self.heap = heapq.nsmallest(QUEUE_CAP // 2, self.heap)
            heapq.heapify(self.heap)

    def pop(self) -> State | None:
        while self.heap:
            st = heapq.heappop(self.heap)[-1]
            if st.meta.get("pending") != []:   # [] = fully expanded from another queue
                return st
        return None

    def steer(self, objective: Objective, more=()) -> None:
        """Rank (and later admit) by ``objective``, with ``more`` entries added."""
        self.objective = objective
        self.heap = [(objective.key(e[-1]),) + e[1:] for e in list(self.heap) + list(more)]
        heapq.heapify(self.heap)


class _Ladder:
    """How a memory-budget search steers until a plan meets the budget.

    Ranking the states over the budget by peak (the mode's own order) reaches the
    budget through the biggest rewrites, and once a plan meets it the relaxed
    BetterThan admits only states near that plan: at mem 0.4 the search returned
    plans at x1.4-x3.7 latency where a latency-budget search at 1.10 found plans
    at or under 0.4 (see README). So the search first runs as a latency-budget
    search (minimize the peak under a latency target). The target starts at
    LADDER_START x the unrewritten latency and rises by LADDER_STEP whenever the
    best peak under it, lowered at the pace of the last WINDOW states for the
    states the time left allows, would not reach the memory budget. The first
    plan under the target that meets the budget hands the search to the mode's
    own order (a plan over the target that meets it, such as one the dive found,
    does not: a cheaper one may be near); past LADDER_MAX the ladder gives up and
    the mode's own order dives for the peak.
    """

    def __init__(self, root: State, limit: float):
        self.base, self.limit = root.latency, limit
        self.ratio = LADDER_START
        self.target = Objective("lat", self.ratio * self.base)
        self.best = root
        self.peaks: list[int] = []       # best peak under the target after each state

    def behind(self, child: State, states_left: float) -> bool:
        """Count ``child``; True when the target should rise."""
        if self.target.better(child, self.best):
            self.best = child
        self.peaks.append(self.best.peak)
        if len(self.peaks) <= WINDOW:
            return False
        pace = (self.peaks[-WINDOW - 1] - self.peaks[-1]) / WINDOW
        return self.peaks[-1] - pace * states_left > self.limit

    def climb(self, front: list[State]) -> bool:
        """Raise the target: by LADDER_STEP, or up to the fastest state seen with a
        lower peak than the best under it, if that is further (a small model
        searched for 2 s has no states to spend on many small steps). False once
        past LADDER_MAX (the ladder is done)."""
        lower = [o.latency for o in front if o.peak < self.best.peak]
        self.ratio = max(self.ratio * LADDER_STEP, min(lower, default=0.0) / self.base)
        self.target = Objective("lat", self.ratio * self.base)
        self.best = min(front, key=self.target.key)
        self.peaks = []
        return self.ratio <= LADDER_MAX


def _climb(ladder: _Ladder, climbing: _Queue, queue: _Queue, child: State, log: SearchLog,
           counter: int, states_left: float) -> tuple[_Queue | None, int]:
    """The ladder's step after ``child``: (its queue, or None once it is done; counter)."""
    if ladder.behind(child, states_left):
        if not ladder.climb(log.pareto):
            return None, counter              # past LADDER_MAX: the dive goes on alone
        # states the old target turned away may fit the new one
        more = []
        for o in log.pareto:
            if o.latency <= ladder.target.limit and o.meta.get("pending") != []:
                counter += 1
                more.append((None, 0.0, counter, o))
        climbing.steer(ladder.target, more)
    if ladder.best.peak <= ladder.limit:
        # met under the target: the mode's own order, from the ladder's states
        queue.steer(queue.objective, climbing.heap)
        return None, counter
    return climbing, counter


def _states_left(log: SearchLog, t0: float, time_budget: float, max_states: int | None) -> float:
    """How many more states the budget allows, at the pace so far."""
    spent = time.perf_counter() - t0
    left = (time_budget - spent) * log.states / max(spent, 1e-9)
    return min(left, max_states - log.states) if max_states else left


def search(space: Space, root: State, objective: Objective, *, time_budget: float,
           seed: int = 0, max_states: int | None = None,
           progress: Callable[[State, int, float, bool], None] | None = None,
           progress_every: float = 0.25) -> SearchLog:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    log = SearchLog(root, [root], 1)
    seen = {root.digest}
    keys = {root.key}
    counter = 0
    queue = _Queue(objective)
    queue.push(root, rng.random(), counter)
    # Under a memory budget, the ladder's queue has three turns in four until a
    # plan under its latency target meets the budget; the mode's own queue
    # keeps diving for the peak in the fourth, so a short search still gets
    # under the budget when the ladder is too slow to.
    ladder = _Ladder(root, objective.limit) if objective.kind == "mem" else None
    climbing = None
    if ladder is not None:
        climbing = _Queue(ladder.target)
        climbing.push(root, rng.random(), counter)
    turn = 0
    last = 0.0

    def tick(done=False):
        nonlocal last
        now = time.perf_counter() - t0
        if progress is not None and (done or now - last >= progress_every):
            last = now
            progress(log.best, log.states, now, done)

    def out_of_time() -> bool:
        return time.perf_counter() - t0 > time_budget or bool(max_states and log.states >= max_states)

    def visit(st: State, rule: str, plan: tuple, batches: tuple, touched: set) -> State | None:
        """Build, evaluate and record one child of ``st`` (None: seen before)."""
        nonlocal counter, climbing
        if (plan, batches) in keys:
            return None
        keys.add((plan, batches))
        incremental = plan == st.plan and len(batches) == len(st.batches) + 1
        if incremental:
            g, last_b = space.apply(st.graph, batches[-1])
            if not last_b.specs:
                return None
            batches = st.batches + (last_b,)
        else:
            g, batches = space.build(plan, batches)
        d = graph_digest(g)
        if d in seen:
            return None
        seen.add(d)
        child = space.evaluate(plan, batches, g, parent=st if incremental else None,
                               touched=touched if incremental else None, digest=d)
        child.meta["rule"] = rule
        log.states += 1
        log.pareto = _pareto_add(log.pareto, child)
        if objective.better(child, log.best):
            log.best = child
        counter += 1
        tie = rng.random()
        if objective.better(child, log.best, RELAX):
            queue.push(child, tie, counter)
        if climbing is not None:
            climbing, counter = _climb(ladder, climbing, queue, child, log, counter,
                                       _states_left(log, t0, time_budget, max_states))
            if climbing is not None and ladder.target.better(child, ladder.best, RELAX):
                climbing.push(child, tie, counter)
        tick()
        return child

    def line_search(st: State, child: State) -> None:
        """Follow `_jump` from an F-Tree child: at most JUMPS states, each
        predicted from the last two; one divisor back if one overshoots the
        latency budget."""
        prev, cur, first = st, child, True
        for _ in range(JUMPS):
            jump = None if out_of_time() else _jump(space, prev, cur, objective, skip_next=first)
            if jump is None:
                return
            nxt = visit(st, "jump", jump, st.batches, set())
            if nxt is None:
                return
            if objective.kind == "lat" and nxt.latency > objective.limit:
                now = dict(cur.plan)
                cid, n = next((c, n) for c, n in jump if now.get(c) != n)
                back = [d for d in divisors(space.cands[cid].max_n) if now[cid] < d < n]
                if back and not out_of_time():
                    visit(st, "jump", tuple(sorted({**dict(jump), cid: back[-1]}.items())),
                          st.batches, set())
                return
            prev, cur, first = cur, nxt, False

    try:
        # Before the queue runs: the best-scoring F-Tree candidate enabled on the
        # root and a line search along its n (see `_enable_top`, `_jump`). As one
        # of the root's proposals it took a slot of its first chunk and moved
        # every later sibling (a memory-budget search on tiny U-Net then ended
        # at x1.13 instead of x1.10).
        top = _enable_top(space, root)
        if top is not None:
            child = visit(root, "enable-top", top, (), set())
            if child is not None:
                line_search(root, child)
        while not out_of_time():
            turn += 1
            q = climbing if climbing is not None and turn % DIVE_EVERY else queue
            st = q.pop()
            if st is None and q is climbing:
                q, st = queue, queue.pop()
            if st is None:
                break
            # Partial expansion: a state's children are evaluated EXPAND at a time
            # (biggest rewrites first) and the state goes back into the queue with
            # the rest, so a child that improves is expanded before its siblings
            # are all built: deep plans within the time budget, not just wide ones.
            pending = st.meta.get("pending")
            if pending is None:
                pending = proposals(space, st)
            chunk, st.meta["pending"] = pending[:EXPAND], pending[EXPAND:]
            if st.meta["pending"]:
                counter += 1
                q.push(st, rng.random(), counter)
            for rule, plan, batches, touched in chunk:
                if out_of_time():
                    break
                child = visit(st, rule, plan, batches, touched)
                if child is not None and rule in FISSION_RULES:
                    line_search(st, child)
    except KeyboardInterrupt:
        log.interrupted = True
    log.seconds = time.perf_counter() - t0
    tick(done=True)
    return log
