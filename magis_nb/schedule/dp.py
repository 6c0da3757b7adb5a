"""Minimum-peak order of one block: Serenity's DP over scheduled sets, bounded.

States are the sets of block ops already scheduled (a bitmask int); the bytes live
between steps depend on the set only (see context.py), so the least peak reaching a
set is all the DP needs. States are expanded level by level (level k = k ops
scheduled), merging equal sets.

Two things keep it bounded (see Note [bounded DP]):
- an upper bound: the peak of the hint order and of a greedy order; a state whose
  peak already reaches it cannot do better and is dropped (exact: if everything is
  dropped the bound's own order is optimal);
- a width cap: a level with more than ``width`` states keeps the ``width`` best by
  (peak, live bytes) and the result is marked inexact (beam search over the same
  state space). Cost is O(ops * width * ready ops), never exponential.

Note [bounded DP]: wide parallel branches make the number of downsets explode
(10 independent 2-op chains already have 3^10 states), while chain-like blocks
have one state per level. Capping the level width rather than the block size keeps
long chain-like blocks exact and wide ones fast.

Huge blocks are the exception (``MAX_DP_OPS``): a state is a bitmask over the
block's ops, so each expansion costs O(m) and a level of ``MIN_WIDTH`` states
O(m * width * ready). A block of 55,651 ops (paper GPT-Neo split in 16 with 64
swaps: the transfers left no narrow waist in the parts) took 279 s in the DP.
Such a block keeps the better of the hint and the greedy order. So does a block
whose DP would expand more than ``DP_WORK / ops`` states: the width caps the
states per level, not the ready ops each one expands, and a block of a few
thousand ops with swaps in every part of a split (a Load is ready from its
Store on) can expand hundreds per state: a 240 s search on paper BTLM split in
16 was still scheduling one state with swaps in its parts after 14 minutes.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from .context import BlockProblem

STATE_BUDGET = 60_000    # states per block before levels get capped
MIN_WIDTH = 48
MAX_DP_OPS = 8192        # bigger blocks: hint or greedy order, no DP (Note [bounded DP])
DP_WORK = 2_000_000_000  # expansions x block ops (each costs O(ops) bit work) before giving up


@dataclass
class BlockResult:
    order: list[int]     # local op ids
    peak: int
    exact: bool
    states: int


def _ready0(p: BlockProblem) -> int:
    r = 0
    for i, pm in enumerate(p.pred_mask):
        if pm == 0:
            r |= 1 << i
    return r


def greedy_order(p: BlockProblem) -> list[int]:
    """Memory-aware list scheduling: an op that allocates nothing first (the
    lowest ready one), else the ready op with the least peak so far, then the
    least live bytes after it, then the lowest id: the order `_search` gives at
    width 1, without its bitmasks. Each step of `_search` tests the frees of
    every ready op against an m-bit mask; in a split region of a few thousand
    ops that made 21 blocks of zoo GPT's every-block plan take 14 s. Here each
    storage's readers still to run are counted down, so a step costs O(ready +
    frees of the ready ops)."""
    m = p.m
    alloc, frees, succs = p.alloc, p.frees, p.succs
    waiting = [pm.bit_count() for pm in p.pred_mask]
    left = {}                  # need mask -> members not yet run
    for fs in frees:
        for need, _ in fs:
            if need not in left:
                left[need] = need.bit_count()
    masks = [set(need for need, _ in fs) for fs in frees]
    ready = [v for v in range(m) if waiting[v] == 0]
    zero = [v for v in ready if alloc[v] == 0]
    heapq.heapify(zero)
    busy = set(v for v in ready if alloc[v] != 0)
    peak, live, order = 0, p.base, []
    while zero or busy:
        if zero:
            v = heapq.heappop(zero)
            step = live + alloc[v]
            freed = sum(sz for need, sz in frees[v] if left[need] == 1)
        else:
            best = None
            for u in busy:
                step_u = live + alloc[u]
                np_ = peak if peak >= step_u else step_u
                key = (np_, step_u - sum(sz for need, sz in frees[u] if left[need] == 1), u)
                if best is None or key < best:
                    best = key
            v = best[2]
            busy.discard(v)
            step = live + alloc[v]
            freed = step - best[1]
        if step > peak:
            peak = step
        live = step - freed
        order.append(v)
        for need in masks[v]:
            left[need] -= 1
        for u in set(succs[v]):
            waiting[u] -= 1
            if waiting[u] == 0:
                if alloc[u] == 0:
                    heapq.heappush(zero, u)
                else:
                    busy.add(u)
    return order if len(order) == m else []


def _search(p: BlockProblem, width: int, bound: int | None, max_expansions: int | None = None):
    """Level-wise DP/beam. Returns (local order or None if bounded out, peak, exact,
    states); None, and not exact, also when more than ``max_expansions`` states
    were expanded."""
    m = p.m
    alloc, frees, pmask, succs = p.alloc, p.frees, p.pred_mask, p.succs
    full = (1 << m) - 1
    # An op that allocates nothing never raises memory and may free some: running
    # it as soon as it is ready is optimal (exchange argument), so a state with
    # such an op ready expands only that op. Views and detaches would otherwise
    # multiply the states.
    zero = 0
    for i, a in enumerate(alloc):
        if a == 0:
            zero |= 1 << i
    # state: mask -> (peak, live, ready, parent mask, op)
    level = {0: (0, p.base, _ready0(p), -1, -1)}
    history = []
    exact, states = True, 1
    expansions = 0
    for _ in range(m):
        nxt: dict[int, tuple] = {}
        for mask, (peak, live, ready, _, _) in level.items():
            r = ready & zero
            r = (r & -r) if r else ready
            while r:
                low = r & -r
                r ^= low
                expansions += 1
                if max_expansions is not None and expansions > max_expansions:
                    return None, bound, False, states
                v = low.bit_length() - 1
                step = live + alloc[v]
                np_ = peak if peak >= step else step
                if bound is not None and np_ >= bound:
                    continue
                nm = mask | low
                old = nxt.get(nm)
                if old is not None and old[0] <= np_:
                    continue
                freed = 0
                for need, sz in frees[v]:
                    if need & ~nm == 0:
                        freed += sz
                nr = ready ^ low
                for u in succs[v]:
                    if pmask[u] & ~nm == 0:
                        nr |= 1 << u
                nxt[nm] = (np_, step - freed, nr, mask, v)
        if not nxt:
            return None, bound, exact, states
        if len(nxt) > width:
            exact = False
            keep = sorted(nxt.items(), key=lambda kv: (kv[1][0], kv[1][1]))[:width]
            nxt = dict(keep)
        states += len(nxt)
        history.append(level)
        level = nxt
    peak = level[full][0]
    order, mask = [], full
    for lv in reversed(history + [level]):
        st = lv[mask]
        if st[4] < 0:
            break
        order.append(st[4])
        mask = st[3]
    order.reverse()
    return order, peak, exact, states


def beam_order(p: BlockProblem, width: int) -> list[int]:
    """The local order of the level-wise search keeping the ``width`` best states
    per level, with no upper bound (the search `solve_block` runs, without its
    bound). Public so that `greedy_order`, which claims to be this search at
    width 1 computed without bitmasks, can be held against it."""
    return _search(p, width, None)[0]


def solve_block(p: BlockProblem, hint: Sequence[int] | None = None, *,
                budget: int = STATE_BUDGET) -> BlockResult:
    """Least-peak local order of ``p``; never worse than ``hint`` (a local order).

    Exact (``exact=True``) when no level had to be capped.
    """
    m = p.m
    if m == 0:
        return BlockResult([], 0, True, 0)
    cands = []
    if hint is not None:
        cands.append((p.peak_of(hint)[0], list(hint)))
    g = greedy_order(p)
    cands.append((p.peak_of(g)[0], g))
    best_peak, best = min(cands, key=lambda c: c[0])
    if m == 1:
        return BlockResult(best, best_peak, True, 1)
    if m > MAX_DP_OPS:
        return BlockResult(best, best_peak, False, 1)
    width = max(MIN_WIDTH, budget // m)
    order, peak, exact, states = _search(p, width, best_peak, DP_WORK // m)
    if order is not None and peak < best_peak:
        return BlockResult(order, peak, exact, states)
    # Nothing strictly below the bound: the bound's order is optimal when exact.
    return BlockResult(best, best_peak, exact, states)


class BlockCache:
    """Solved blocks, so a search does not solve again the blocks that a rewrite
    left unchanged (most of them: a rewrite touches a few blocks of hundreds).

    The key is everything `solve_block` reads except ``base``: adding a constant
    to ``base`` adds it to every step's live bytes, every peak and the bound
    alike (all are >= 0, so the DP's initial peak of 0 never binds), so every
    comparison, and hence the order, is the same. Blocks after a swap or remat
    differ from the parent's in ``base`` only.
    """

    def __init__(self, size: int = 1 << 16):
        self.size = size            # entries kept (the oldest go first)
        self.table: dict[tuple, tuple] = {}

    def solve(self, p: BlockProblem, hint: Sequence[int] | None, budget: int) -> BlockResult:
        key = (budget, None if hint is None else tuple(hint), tuple(p.pred_mask),
               tuple(p.alloc), tuple(tuple(f) for f in p.frees))
        hit = self.table.get(key)
        if hit is None:
            r = solve_block(p, hint, budget=budget)
            if len(self.table) >= self.size:
                del self.table[next(iter(self.table))]
            hit = self.table[key] = (tuple(r.order), r.peak - p.base, r.exact, r.states)
        order, rel_peak, exact, states = hit
        return BlockResult(list(order), rel_peak + p.base, exact, states)


def solve_blocks(g, unit: Sequence[int], blocks: dict[int, list[int]], n_units: int,
                 hint_pos: Sequence[int] | None = None, *, budget: int = STATE_BUDGET,
                 cache: BlockCache | None = None) -> tuple[dict[int, list[int]], bool]:
    """Order every block of a unit assignment in context (see context.py).

    Returns ({unit: global op order}, all blocks exact). ``hint_pos[v]`` is op v's
    position in a reference order; within a block the result is never worse than
    the reference order restricted to the block. ``cache``: blocks solved before.
    """
    from .context import block_problems
    probs = block_problems(g, unit, blocks, n_units)
    out, exact = {}, True
    for u, p in probs.items():
        hint = None
        if hint_pos is not None:
            hint = sorted(range(p.m), key=lambda i: hint_pos[p.ops[i]])
            if not _valid_local(p, hint):
                hint = None
        r = solve_block(p, hint, budget=budget) if cache is None else cache.solve(p, hint, budget)
        exact = exact and r.exact
        out[u] = [p.ops[i] for i in r.order]
    return out, exact


def _valid_local(p: BlockProblem, order: Sequence[int]) -> bool:
    done = 0
    for v in order:
        if p.pred_mask[v] & ~done:
            return False
        done |= 1 << v
    return True
