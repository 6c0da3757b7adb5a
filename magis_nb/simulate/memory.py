"""The memory model shared by the simulator and the schedulers (no torch here).

A program is a set of ops and a set of storages. A storage is allocated when its
producer op runs and freed right after the last op that reads it, directly or
through a view, has run. Resident storages (weights, buffers, user inputs) are live
for the whole program; kept storages (graph outputs) are live from their producer to
the end. An op's outputs and inputs are live together while it runs.

Views allocate nothing: the IR maps every view to its base storage before building
a MemGraph, so a storage's users already include the users of all its views. See
Note [views keep their base alive] in magis_nb/ir/graph.py.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Storage:
    size: int                 # bytes
    producer: int             # op index, or -1 for a resident storage
    users: tuple[int, ...]    # op indices that read it (through any view)
    keep: bool = False        # graph output: live until the end
    category: str = "activation"


@dataclass
class MemGraph:
    """Plain-data program: ops 0..n-1 with dependencies, plus storages.

    ``preds[v]`` lists the ops that must run before ``v`` (data and control edges).
    """
    n: int
    preds: list[list[int]]
    storages: list[Storage]
    names: list[str] = field(default_factory=list)

    def __post_init__(self):
        if len(self.preds) != self.n:
            raise ValueError("preds must have one entry per op")
        outs: list[list[int]] = [[] for _ in range(self.n)]
        ins: list[list[int]] = [[] for _ in range(self.n)]
        for i, s in enumerate(self.storages):
            if s.producer >= 0:
                outs[s.producer].append(i)
            for u in s.users:
                ins[u].append(i)
        self.outputs_of = outs      # storages each op allocates
        self.inputs_of = ins        # storages each op reads
        succ: list[list[int]] = [[] for _ in range(self.n)]
        for v, ps in enumerate(self.preds):
            for p in ps:
                succ[p].append(v)
        self.succs = succ

    @property
    def resident_bytes(self) -> int:
        return sum(s.size for s in self.storages if s.producer < 0)

    def is_topological(self, order: Sequence[int]) -> bool:
        if sorted(order) != list(range(self.n)):
            return False
        pos = {v: i for i, v in enumerate(order)}
        return all(pos[p] < pos[v] for v in range(self.n) for p in self.preds[v])


@dataclass
class MemoryTimeline:
    order: list[int]
    live: list[int]                 # bytes live while order[i] runs
    peak: int
    peak_steps: list[int]           # positions i with live[i] == peak
    hotspots: list[int]             # storage indices live at any peak step
    by_category: dict[str, list[int]]
    intervals: list[tuple[int, int]]  # per storage: first and last step it is live


def storage_intervals(g: MemGraph, order: Sequence[int]) -> list[tuple[int, int]]:
    """Live interval [start, end] (inclusive steps) of each storage under ``order``."""
    pos = [0] * g.n
    for i, v in enumerate(order):
        pos[v] = i
    last = len(order) - 1
    out = []
    for s in g.storages:
        start = 0 if s.producer < 0 else pos[s.producer]
        if s.producer < 0 or s.keep:
            end = last
        else:
            end = max([start] + [pos[u] for u in s.users])
        out.append((start, end))
    return out


def simulate_memory(g: MemGraph, order: Sequence[int]) -> MemoryTimeline:
    """Live bytes at every step of ``order`` (a topological order of all ops)."""
    order = list(order)
    if not g.is_topological(order):
        raise ValueError("order is not a topological order of the graph")
    steps = max(len(order), 1)
    intervals = storage_intervals(g, order) if order else [(0, 0)] * len(g.storages)
    # Difference arrays keep this O(ops + storages) for graphs of thousands of ops.
    delta = [0] * (steps + 1)
    cats: dict[str, list[int]] = {}
    for s, (a, b) in zip(g.storages, intervals):
        delta[a] += s.size
        delta[b + 1] -= s.size
        d = cats.get(s.category)
        if d is None:
            # not setdefault: its default, a list as long as the program, would
            # be built for every storage (1.7 s a call on a 67k-op split program)
            d = cats[s.category] = [0] * (steps + 1)
        d[a] += s.size
        d[b + 1] -= s.size
    live, acc = [], 0
    for i in range(steps):
        acc += delta[i]
        live.append(acc)
    by_cat = {}
    for c, d in sorted(cats.items()):
        run, acc = [], 0
        for i in range(steps):
            acc += d[i]
            run.append(acc)
        by_cat[c] = run
    peak = max(live) if live else 0
    peak_steps = [i for i, m in enumerate(live) if m == peak]
    # A split program holds the peak over long runs of views (free steps):
    # look each interval's first peak step up instead of testing them all.
    hot = []
    for k, (a, b) in enumerate(intervals):
        j = bisect.bisect_left(peak_steps, a)
        if j < len(peak_steps) and peak_steps[j] <= b:
            hot.append(k)
    return MemoryTimeline(order, live, peak, peak_steps, hot, by_cat, intervals)


def peak_memory(g: MemGraph, order: Sequence[int]) -> int:
    return simulate_memory(g, order).peak


def op_floor(g: MemGraph) -> int:
    """A lower bound on the peak of every plan that runs each op whole (no
    fission): the resident bytes plus the largest set of storages one op reads
    and writes. Re-ordering, recomputing and swapping cannot go below it: an
    op's inputs and outputs are on the device while it runs."""
    resident = g.resident_bytes
    most = 0
    for v in range(g.n):
        ids = set(g.inputs_of[v]) | set(g.outputs_of[v])
        most = max(most, sum(g.storages[i].size for i in ids if g.storages[i].producer >= 0))
    return resident + most
