"""Block problems: the memory model of ``simulate_memory`` seen from inside a block.

A schedule is cut into *units* that run one after another: each unit is either a
block that a scheduler may re-order or a single fixed op. Given which unit every op
belongs to, the set of ops that ran before a block is fixed, so the bytes live at
any moment inside the block depend only on the set of block ops already scheduled.
That is what makes blocks independent: the peak of the spliced order is the max of
the block peaks (and of the fixed ops' steps).

For a storage s let a = unit of its producer (-1 if resident) and e = the unit of
its last reader (never before a), or "end" if s is resident or kept. Then s is

- constant in every unit strictly between a and e (live throughout),
- allocated by its producer in unit a and, if e == a, freed once the producer and
  all its readers in the unit have run,
- live at the start of unit e > a and freed once its readers in e have run.

This mirrors ``storage_intervals`` in magis_nb/simulate/memory.py exactly (end =
max(producer step, reader steps), resident and kept storages live to the end).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from magis_nb.simulate.memory import MemGraph

_END = 1 << 62   # "live to the end of the program"


@dataclass
class BlockProblem:
    """One block to order. Local op i is global op ``ops[i]``; masks are local."""
    ops: list[int]
    pred_mask: list[int]                    # block preds of each op (local bits)
    succs: list[list[int]]                  # block succs of each op (local ids)
    alloc: list[int]                        # bytes an op allocates when it runs
    frees: list[list[tuple[int, int]]] = field(default_factory=list)
    # frees[i]: (need_mask, size) of storages freed once need_mask has run; listed
    # under every member of need_mask, so a step only checks its own entries.
    base: int = 0                           # bytes live when the block starts

    @property
    def m(self) -> int:
        return len(self.ops)

    def peak_of(self, local_order: Sequence[int]) -> tuple[int, int]:
        """(peak, live bytes after the block) of a local order (assumed valid)."""
        done, live, peak = 0, self.base, 0
        for v in local_order:
            peak = max(peak, live + self.alloc[v])
            done |= 1 << v
            live += self.alloc[v] - sum(sz for need, sz in self.frees[v]
                                        if need & ~done == 0)
        return peak, live


def unit_spans(g: MemGraph, unit: Sequence[int]) -> list[tuple[int, int]]:
    """(a, e) per storage under a unit assignment (see module docstring)."""
    spans = []
    for s in g.storages:
        a = -1 if s.producer < 0 else unit[s.producer]
        if s.producer < 0 or s.keep:
            e = _END
        else:
            e = a
            for u in s.users:
                if unit[u] > e:
                    e = unit[u]
        spans.append((a, e))
    return spans


def block_problems(g: MemGraph, unit: Sequence[int], blocks: dict[int, list[int]],
                   n_units: int) -> dict[int, BlockProblem]:
    """Build the problem of every block ``blocks[u]`` (ops of unit u) in context.

    ``unit[v]`` is the unit of op v (units run in increasing order); units not in
    ``blocks`` hold fixed ops. Cost O(ops + storages + reader entries).
    """
    spans = unit_spans(g, unit)
    local = {}
    probs: dict[int, BlockProblem] = {}
    for u, ops in blocks.items():
        for i, v in enumerate(ops):
            local[v] = i
        pm, sc = [0] * len(ops), [[] for _ in ops]
        for i, v in enumerate(ops):
            for p in g.preds[v]:
                if unit[p] == u:
                    pm[i] |= 1 << local[p]
                    sc[local[p]].append(i)
        probs[u] = BlockProblem(list(ops), pm, sc, [0] * len(ops),
                                [[] for _ in ops], 0)
    # Constant part: storages live through whole units, via a difference array.
    diff = [0] * (n_units + 2)
    for s, (a, e) in zip(g.storages, spans):
        lo, hi = a + 1, min(e, n_units)
        if lo < hi:
            diff[lo] += s.size
            diff[hi] -= s.size
    acc = 0
    for u in range(n_units):
        acc += diff[u]
        if u in probs:
            probs[u].base = acc
    for s, (a, e) in zip(g.storages, spans):
        if a >= 0 and a in probs:
            p = probs[a]
            i = local[s.producer]
            p.alloc[i] += s.size
            if e == a:
                need = 1 << i
                for r in s.users:
                    if unit[r] == a:
                        need |= 1 << local[r]
                _add_free(p, need, s.size)
        if e != _END and e > a and e in probs:
            p = probs[e]
            p.base += s.size
            need = 0
            for r in s.users:
                if unit[r] == e:
                    need |= 1 << local[r]
            _add_free(p, need, s.size)
    return probs


def _add_free(p: BlockProblem, need: int, size: int) -> None:
    m = need
    while m:
        low = m & -m
        p.frees[low.bit_length() - 1].append((need, size))
        m ^= low
