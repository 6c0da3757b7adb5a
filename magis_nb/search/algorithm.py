"""Algorithm 3 (the seed's §6.2): best-first search over fission, remat and swap.

The parts, each in its own module: what a budget optimizes (`objective`),
which children a state proposes (`proposals`, priced by `pricing` and
`algebra_gains`), a line search along a region's n (`linesearch`), and the
queues and the latency ladder of a memory-budget search (`queues`). This module
runs them: a child enters the queue when it is better than the best so far
relaxed by RELAX, so slightly worse states stay explorable. Under a memory
limit the search is steered by a latency target that climbs until the limit is
met (`queues.Ladder`), while the mode's own order keeps one turn in DIVE_EVERY.

Before the queue runs, the best-scoring candidate of the whole F-Tree is
enabled on the root (`proposals.enable_top`), and every F-Tree child that
lowers the peak starts a line search along its n: on a paper-size transformer
the batch split of the whole step is the plan to find, and a state per lift and
per divisor would not get there within a minute. When that region reads
dropout masks, the line runs with them packed (`Search.packed`).

Note [a state's cost before it is built]
The clock is read between states, and one state of a big split costs more than
a minute budget: paper GPT-Neo split in 32 packed is ~134k ops, and building and
scheduling it took over a minute, so a 60 s search returned after 80-320 s. A
state's cost is about proportional to its ops, and a plan's ops are known before
it is built (`Space.plan_ops`): each visit measures the seconds per planned op
(the latest split visit's; a rewrite on the same graph costs like its parent), and
a child whose predicted seconds would end past the budget is not built. Cheaper
children are still tried with the time left.
"""
from __future__ import annotations

import random
import time
from typing import Callable, Sequence

from ..ir.digest import graph_digest
from .algebra_gains import AlgebraGains
from .gcpause import collect_due, paused_gc
from .linesearch import JUMPS, jump, step_back
from .objective import Objective, SearchLog, pareto_add
from ..analysis.ftree import coarsenings
from .proposals import enable_blocks, enable_top, proposals
from .queues import Ladder, StateQueue, expanded
from .space import Space, State

RELAX = 1.1
EXPAND = 8                 # children evaluated per pop (see Search.run)
DIVE_EVERY = 4             # a memory-budget search's dive turn while the ladder runs
FISSION_RULES = ("enable", "enable-top", "lift", "mutate")
BLOCK_PARTS = (16, 64)     # n of `Search.every_block`'s plans
EXPENSIVE = 5.0            # seconds a child is predicted to cost: `Search.lat_limit`

Progress = Callable[[State, int, float, bool], None]


class Search:
    """One run of Algorithm 3: its queues, what it has seen, and its clock.
    `search` is the entry point; the class is public so that its steps
    (``too_slow``, ``coarsen``, ...) can be driven one at a time, as the tests do."""

    def __init__(self, space: Space, root: State, objective: Objective, time_budget: float,
                 seed: int, max_states: int | None, progress: Progress | None,
                 progress_every: float, starts: Sequence[State] = ()):
        self.space, self.objective = space, objective
        self.time_budget, self.max_states = time_budget, max_states
        self.progress, self.progress_every = progress, progress_every
        self.algebra = AlgebraGains(space)
        self.rng = random.Random(seed)
        self.t0 = time.perf_counter()
        self.last_tick = 0.0
        self.log = SearchLog(root, [root], 1)
        self.seen = {root.digest}          # graphs evaluated
        self.keys = {root.key}             # (plan, batches) built
        self.counter = 0                   # insertion count: the queues' last tie-break
        self.rate: float | None = None     # seconds per planned op of the last split visit
        # plan -> latency of its state without rewrites (`too_slow`'s points)
        self.plan_lat: dict[tuple, float] = {root.plan: root.latency}
        self.queue = StateQueue(objective)
        self.queue.push(root, self.rng.random(), self.counter)
        # Under a memory budget, the ladder's queue has three turns in four until a
        # plan under its latency target meets the budget; the mode's own queue
        # keeps diving for the peak in the fourth, so a short search still gets
        # under the budget when the ladder is too slow to.
        self.ladder = Ladder(root, objective.limit) if objective.kind == "mem" else None
        self.climbing: StateQueue | None = None
        self.popped_from = self.queue      # the queue `pop` took the current state from
        if self.ladder is not None:
            self.climbing = StateQueue(self.ladder.target)
            self.climbing.push(root, self.rng.random(), self.counter)
        for st in starts:
            self.start(st)

    def start(self, st: State) -> None:
        """``st``, an evaluated state of the space (the user's own checkpointing:
        `user_checkpoint.user_checkpoint_state`), as a second root: counted, on
        the front, the best if it is, and in every queue whatever its rank, so
        that the search expands it as it expands the root."""
        if st.digest in self.seen or st.key in self.keys:
            return
        self.seen.add(st.digest)
        self.keys.add(st.key)
        st.meta.setdefault("rule", "start")
        log = self.log
        log.states += 1
        if not st.batches:
            self.plan_lat[st.plan] = st.latency
        log.pareto = pareto_add(log.pareto, st)
        if self.objective.better(st, log.best):
            log.best = st
        self.counter += 1
        tie = self.rng.random()
        self.queue.push(st, tie, self.counter)
        if self.climbing is not None:
            if self.ladder.target.better(st, self.ladder.best):
                self.ladder.best = st
            self.climbing.push(st, tie, self.counter)

    # -- the clock -----------------------------------------------------------
    def out_of_time(self) -> bool:
        return (time.perf_counter() - self.t0 > self.time_budget
                or bool(self.max_states and self.log.states >= self.max_states))

    def states_left(self) -> float:
        """How many more states the budget allows, at the pace so far."""
        spent = time.perf_counter() - self.t0
        left = (self.time_budget - spent) * self.log.states / max(spent, 1e-9)
        return min(left, self.max_states - self.log.states) if self.max_states else left

    def fits(self, plan: tuple, count: bool = True) -> bool:
        """Whether a state of ``plan`` is predicted to be built and evaluated
        within the budget (Note [a state's cost before it is built]); a refusal
        is counted when ``count``."""
        if self.rate is None:
            return True
        left = self.time_budget - (time.perf_counter() - self.t0)
        if self.rate * self.space.plan_ops(plan) <= left:
            return True
        self.log.too_big += count
        return False

    def shrink(self, plan: tuple, cur: State) -> tuple | None:
        """``plan``, a jump from ``cur`` along one region's n, or when it would end
        past the budget the same jump to the largest n between that fits
        (`linesearch.step_back`, one divisor at a time); None when none does.
        Stopping the line instead left paper BTLM at lat 1.20 on a split in 2
        (0.536): the jump to 32 would not fit, 16 would."""
        while plan is not None and not self.fits(plan, count=False):
            plan = step_back(self.space, cur, plan)
        if plan is None:
            self.log.too_big += 1
        return plan

    def too_slow(self, st: State, plan: tuple) -> bool:
        """Under a latency budget, whether ``plan`` (``st``'s with one region's n
        raised) is predicted over it: latency grows about linearly with n
        (`linesearch`), and the plans along that region's n seen so far give
        the slope. A mutation past where the line search stopped would
        otherwise be built: paper BTLM split in 16 (x1.085), its F-Tree child
        at 32 took 80 s to come back at x1.146."""
        if self.objective.kind != "lat":
            return False
        old, new = dict(st.plan), dict(plan)
        changed = [c for c in new if new[c] != old.get(c)]
        if len(changed) != 1 or set(old) - set(new) or new[changed[0]] <= old.get(changed[0], 1):
            return False
        cid = changed[0]
        rest = {c: n for c, n in new.items() if c != cid}
        pts = []
        for key, lat in self.plan_lat.items():
            d = dict(key)
            n = d.pop(cid, 1)
            if n < new[cid] and d == rest:
                pts.append((n, lat))
        pts.sort()
        if len(pts) < 2:
            return False
        (na, la), (nb, lb) = pts[-2:]
        slope = (lb - la) / (nb - na)
        if slope <= 0 or lb + slope * (new[cid] - nb) <= self.objective.limit:
            return False
        self.log.over += 1
        return True

    def lat_limit(self, st: State) -> float | None:
        """The latency budget a state's rewrite batches are kept within
        (`proposals`), only where its children are expensive: the prices are
        lower bounds of a kind, and on small graphs the batches they would leave
        out are cheap to try and lead on (paper ResNet-50, 0.2 s a state, came
        to 0.4279 instead of 0.3349 at lat 1.10 with them left out)."""
        if self.objective.kind != "lat" or self.rate is None \
                or self.rate * self.space.plan_ops(st.plan) < EXPENSIVE:
            return None
        return self.objective.limit

    def tick(self, done: bool = False) -> None:
        now = time.perf_counter() - self.t0
        if self.progress is not None and (done or now - self.last_tick >= self.progress_every):
            self.last_tick = now
            self.progress(self.log.best, self.log.states, now, done)

    # -- one child -----------------------------------------------------------
    def visit(self, st: State, rule: str, plan: tuple, batches: tuple,
              touched: set) -> State | None:
        """Build, evaluate and record one child of ``st`` (None: seen before, or
        predicted to end past the budget)."""
        if (plan, batches) in self.keys:
            return None
        space = self.space
        if not self.fits(plan):
            return None
        self.keys.add((plan, batches))
        collect_due()           # the collector is paused while planning (`gcpause`)
        t = time.perf_counter()
        incremental = plan == st.plan and len(batches) == len(st.batches) + 1
        if incremental:
            g, last_b = space.apply(st.graph, batches[-1])
            if not last_b.specs:
                return None
            batches = st.batches + (last_b,)
        else:
            g, batches = space.build(plan, batches)
        d = graph_digest(g)
        if d in self.seen:
            return None
        self.seen.add(d)
        child = space.evaluate(plan, batches, g, parent=st if incremental else None,
                               touched=touched if incremental else None, digest=d)
        child.meta["rule"] = rule
        if not incremental and plan:
            # split graphs only: the unsplit one costs far less per op (paper
            # GPT-Neo: 0.2 s against 5-17 s split in 16), and a "disable" child
            # priced at its pace let batches past `lat_limit` that took 17 s to
            # come back at x1.43
            self.rate = (time.perf_counter() - t) / space.plan_ops(plan)
        self.record(child)
        self.tick()
        return child

    def record(self, child: State) -> None:
        """Count ``child``, put it on the front and into the queues that admit it."""
        log, objective = self.log, self.objective
        log.states += 1
        if not child.batches:
            self.plan_lat[child.plan] = child.latency
        log.pareto = pareto_add(log.pareto, child)
        if objective.better(child, log.best):
            log.best = child
        self.counter += 1
        tie = self.rng.random()
        if objective.better(child, log.best, RELAX):
            self.queue.push(child, tie, self.counter)
        if self.climbing is not None:
            self.climb(child)
            if self.climbing is not None and self.ladder.target.better(child, self.ladder.best, RELAX):
                self.climbing.push(child, tie, self.counter)

    def climb(self, child: State) -> None:
        """The ladder's step after ``child``; ``self.climbing`` is None once it is done."""
        ladder = self.ladder
        if ladder.behind(child, self.states_left()):
            if not ladder.climb(self.log.pareto):
                self.climbing = None          # past LADDER_MAX: the dive goes on alone
                return
            # states the old target turned away may fit the new one
            more = []
            for o in self.log.pareto:
                if o.latency <= ladder.target.limit and not expanded(o):
                    self.counter += 1
                    more.append((None, 0.0, self.counter, o))
            self.climbing.steer(ladder.target, more)
        if ladder.best.peak <= ladder.limit:
            # met under the target: the mode's own order, from the ladder's states
            self.queue.steer(self.queue.objective, self.climbing.heap)
            self.climbing = None

    def packed(self, root: State, child: State) -> State | None:
        """``child`` (the root with one region enabled) with that region's
        dropout masks packed (Note [packed masks]), evaluated; None when it has
        no packed twin, or when the objective prefers ``child``."""
        (entry,) = set(child.plan) - set(root.plan) or {None}
        if entry is None or self.out_of_time():
            return None
        cid, _ = entry
        c = self.space.cands[cid]
        if c.twin is None or c.pack:
            return None
        twin = self.visit(root, "pack", _swap_region(child.plan, cid, c.twin), (), set())
        return twin if twin is not None and self.objective.better(twin, child) else None

    def line_search(self, st: State, child: State, packed: State | None = None) -> None:
        """Follow `linesearch.jump` from an F-Tree child: at most JUMPS states,
        each predicted from the last two; one divisor back if one overshoots the
        latency budget.

        ``packed``: ``child`` with its region's masks packed, when the objective
        prefers it; the line then runs packed, its first step predicted from
        ``child``. Left to the queue, packing came after the line search had
        spent the time: paper GPT-Neo at lat 1.20 ended at an unpacked split in
        32 (0.230), where lat 1.10 had reached 0.175 packed. The first step is
        not predicted from the packed state: seen from the unsplit root, the
        packing's fixed cost reads as a steep latency slope per part."""
        prev, cur, first = st, child, True
        unpack = None           # (packed id, unpacked id) once the line runs packed
        for _ in range(JUMPS):
            plan = None if self.out_of_time() else jump(self.space, prev, cur, self.objective,
                                                        skip_next=first)
            if plan is None:
                return
            if packed is not None:
                # the same n, on the packed twin; from here on the line is packed
                (cid,) = set(dict(plan)) - set(dict(packed.plan))
                (tid,) = set(dict(packed.plan)) - set(dict(plan))
                plan, unpack = _swap_region(plan, cid, tid), (tid, cid)
                cur, packed = packed, None
            plan = self.shrink(plan, cur)
            if plan is None:
                return
            nxt = self.visit(st, "jump", plan, st.batches, set())
            if nxt is None:
                return
            over = self.objective.kind == "lat" and nxt.latency > self.objective.limit
            met = self.objective.kind == "mem" and nxt.peak <= self.objective.limit
            if unpack is not None and (over or met) \
                    and not self.out_of_time():
                # Packing costs time: the same n unpacked may fit the latency budget
                # where packed does not (paper GPT-Neo at lat 1.05: n=8 at x1.031),
                # or meet the memory budget too, faster (mem 0.4: n=8 at 0.310 and
                # x1.031, against 0.223 and x1.059 packed).
                self.visit(st, "jump", _swap_region(plan, *unpack), st.batches, set())
            if over:
                back = step_back(self.space, cur, plan)
                if back is not None and not self.out_of_time():
                    self.visit(st, "jump", back, st.batches, set())
                return
            prev, cur, first = cur, nxt, False

    def every_block(self, root: State, top: tuple) -> None:
        """When the top candidate splits along a dimension whose regions
        recompute (the sequence, at batch 1: the batch cannot be split), all of
        them enabled together (`proposals.enable_blocks`) in BLOCK_PARTS[0]
        parts; under a memory budget it does not meet, in the next when that
        took the best peak below half (zoo GPT at 2048 tokens: 379 -> 40 MiB
        in 16 parts, 31 in 64; Llama-style: 85 -> 53, where the queue does
        better without them)."""
        (cid, _), = set(top) - set(root.plan)
        comp = self.space.cands[cid].comp
        for n in BLOCK_PARTS:
            plan = None if self.out_of_time() else enable_blocks(self.space, root, n, comp)
            if plan is None:
                return
            before = self.log.best.peak
            st = self.visit(root, "enable-blocks", plan, (), set())
            if st is None:
                return
            # Slower than the search would take now, it stays a plan on the front
            # but is not expanded: its children cost as much as it did (Llama-style
            # at 2048 tokens: 30 s a state in 64 parts, and expanding it left the
            # 60 s search at 47 MiB where it reaches 42 without)
            limit = self.objective.limit if self.objective.kind == "lat" \
                else self.ladder.target.limit if self.climbing is not None else None
            if limit is not None and st.latency > limit:
                st.meta["pending"] = []
            if self.objective.kind == "mem" and st.peak <= self.objective.limit:
                self.coarsen(st)
                return
            if self.objective.kind != "mem" or st.peak > before / 2:
                return

    def coarsen(self, st: State) -> None:
        """Under a memory budget the every-block plan met with room to spare:
        each region in turn in fewer parts (`coarsenings`), kept while the plan
        stays within the budget and gets faster. The queue does not get there:
        the plan's children are slow to build (Llama-style at 2048 tokens in
        16 parts: 3 s each) and it expanded other states for the whole search."""
        limit = self.objective.limit
        improved = True
        while improved and not self.out_of_time():
            improved = False
            # one try per region a pass, each from the plan the last one kept
            for cid in sorted(dict(st.plan)):
                if self.out_of_time():
                    return
                plan = next((p for _, p in coarsenings(self.space.cands, dict(st.plan))
                             if p[cid] != dict(st.plan)[cid]), None)
                if plan is None:
                    continue
                child = self.visit(st, "coarsen", tuple(sorted(plan.items())), st.batches, set())
                if child is not None and child.peak <= limit and child.latency < st.latency:
                    st, improved = child, True

    # -- the loop ------------------------------------------------------------
    def leader(self) -> State | None:
        """The state a new best is measured against (`run`): under a latency
        budget the best; under a memory budget the ladder's best under its target
        while it climbs, then the best once it meets the budget. Before that the
        memory mode's best is the lowest peak, and following it dove through the
        biggest rewrites (tiny GPT met 0.46 at x1.157 where a latency-budget
        search found it at x1.099)."""
        if self.objective.kind == "lat":
            return self.log.best
        if self.climbing is not None:
            return self.ladder.best
        return self.log.best if self.log.best.peak <= self.objective.limit else None

    def pop(self, turn: int) -> State | None:
        """The next state to expand: the ladder's queue three turns in four while
        it runs, the mode's own queue otherwise (or when the ladder's is empty)."""
        q = self.climbing if self.climbing is not None and turn % DIVE_EVERY else self.queue
        st = q.pop()
        if st is None and q is self.climbing:
            q, st = self.queue, self.queue.pop()
        self.popped_from = q
        return st

    def run(self, root: State) -> SearchLog:
        # Before the queue runs: the best-scoring F-Tree candidate enabled on the
        # root and a line search along its n. As one of the root's proposals it
        # took a slot of its first chunk and moved every later sibling (a
        # memory-budget search on tiny U-Net then ended at x1.13 instead of x1.10).
        top = enable_top(self.space, root)
        if top is not None:
            child = self.visit(root, "enable-top", top, (), set())
            if child is not None:
                self.line_search(root, child, self.packed(root, child))
            self.every_block(root, top)
        turn = 0
        while not self.out_of_time():
            turn += 1
            st = self.pop(turn)
            if st is None:
                break
            # Partial expansion: a state's children are evaluated EXPAND at a time
            # (biggest rewrites first) and the state goes back into the queue with
            # the rest, so a child that improves is expanded before its siblings
            # are all built: deep plans within the time budget, not just wide ones.
            pending = st.meta.get("pending")
            if pending is None:
                pending = proposals(self.space, st, self.algebra, self.lat_limit(st),
                                    coarsen=self.objective.kind == "mem")
            chunk, st.meta["pending"] = pending[:EXPAND], pending[EXPAND:]
            requeued = bool(st.meta["pending"])
            if requeued:
                self.counter += 1
                self.popped_from.push(st, self.rng.random(), self.counter)
            for i, (rule, plan, batches, touched) in enumerate(chunk):
                if self.out_of_time():
                    break
                if rule == "mutate" and self.too_slow(st, plan):
                    continue
                best = self.leader()
                child = self.visit(st, rule, plan, batches, touched)
                if child is not None and rule in FISSION_RULES:
                    self.line_search(st, child)
                if best is not None and self.leader() is not best and i + 1 < len(chunk):
                    # A new best is expanded before the rest of its siblings: they
                    # go back to the front of the state's list. Paper GPT-Neo at lat
                    # 1.10 reached 0.1514 at 28 s of 60, then spent the rest on
                    # five siblings of that state (none better).
                    st.meta["pending"] = chunk[i + 1:] + st.meta["pending"]
                    if not requeued:
                        self.counter += 1
                        self.popped_from.push(st, self.rng.random(), self.counter)
                    break
        return self.log


def _swap_region(plan: tuple, old: int, new: int) -> tuple:
    """``plan`` with candidate ``old`` replaced by ``new`` at the same n."""
    return tuple(sorted((new if c == old else c, n) for c, n in plan))


def search(space: Space, root: State, objective: Objective, *, time_budget: float,
           seed: int = 0, max_states: int | None = None, progress: Progress | None = None,
           progress_every: float = 0.25, starts: Sequence[State] = ()) -> SearchLog:
    """Search plans from ``root`` for ``objective`` until ``time_budget`` seconds
    or ``max_states`` states are spent (Ctrl-C: the best so far, ``interrupted``).
    ``progress(best, states, seconds, done)`` is called a few times a second.
    ``starts``: further evaluated states of ``space`` the search starts from
    beside ``root`` (`Search.start`); none: the search is as without them."""
    s = Search(space, root, objective, time_budget, seed, max_states, progress, progress_every,
               starts)
    with paused_gc():
        try:
            s.run(root)
        except KeyboardInterrupt:
            s.log.interrupted = True
    s.log.seconds = time.perf_counter() - s.t0
    s.tick(done=True)
    return s.log
