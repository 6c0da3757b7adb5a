"""The search's queues: states waiting to be expanded, and the latency ladder
that steers a memory-budget search until a plan meets the budget."""
from __future__ import annotations

import heapq

from .objective import Objective
from .space import State

QUEUE_CAP = 64             # states kept in a queue (the worst are dropped)
LADDER_START = 1.05        # a memory-budget search's first latency target
LADDER_STEP = 1.025        # a rung of 1.1 skipped 1.10 (1.05 -> 1.155): tiny GPT met
                           # the peak of a lat-1.10 search at x1.136, at x1.101 with 1.05;
                           # tiny U-Net's (0.535, remat 11; swap 4) at x1.137 with 1.05
                           # (rungs 1.1025, then 1.158), x1.119 with 1.025; paper ResNet-50
                           # mem 0.4 x1.111 -> x1.095, U-Net x1.075 -> x1.054
LADDER_MAX = 4.0
WINDOW = 16                # states over which the ladder measures its pace (two
                           # expansion chunks: 2 * algorithm.EXPAND)


def expanded(st: State) -> bool:
    """True once every child of ``st`` has been evaluated (from any queue)."""
    return st.meta.get("pending") == []


class StateQueue:
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
            if not expanded(st):
                return st
        return None

    def steer(self, objective: Objective, more=()) -> None:
        """Rank (and later admit) by ``objective``, with ``more`` entries added."""
        self.objective = objective
        self.heap = [(objective.key(e[-1]),) + e[1:] for e in list(self.heap) + list(more)]
        heapq.heapify(self.heap)


class Ladder:
    """How a memory-budget search steers until a plan meets the budget.

    Ranking the states over the budget by peak (the mode's own order) reaches the
    budget through the biggest rewrites, and once a plan meets it the relaxed
    BetterThan admits only states near that plan: at mem 0.4 the search returned
    plans at x1.4-x3.7 latency where a latency-budget search at 1.10 found plans
    at or under 0.4 (docs/optimizer.md). So the search first runs as a
    latency-budget search (minimize the peak under a latency target). The target
    starts at LADDER_START x the unrewritten latency and rises by LADDER_STEP
    whenever the best peak under it, lowered at the pace of the last WINDOW
    states for the states the budget allows, would not reach the memory budget.
    The first plan under the target that meets the budget hands the search to
    the mode's own order (a plan over the target that meets it, such as one the
    dive found, does not: a cheaper one may be near); past LADDER_MAX the ladder
    gives up and the mode's own order dives for the peak.
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
